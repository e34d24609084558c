"""Safetensors copies of GGUF checkpoints, so a GGUF is dequantised once, not at every load.

transformers loads a GGUF by dequantising every tensor, which is slow next to reading
safetensors, and a model loaded that way refuses `save_pretrained`. A command that loads the same model in several stages (`optimize`: measure,
corpus, tune, confirm) would pay that each time. So the first load writes an ordinary copy under
the user cache, keyed by the file's path, size and modification time, and later loads read it.

GGUF does not record the dtype a model was published in: the copy's weights are float32, the
dequantised values exactly, and its config says float32 unless the caller declares another.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from .files import cache_root, share_as_umask_allows

# Part of every copy's key: bump it when the conversion itself changes.
CONVERSION_VERSION = 2


def dequantised_copy(gguf: Path, name: str | None = None, declared_dtype: torch.dtype | None = None) -> Path:
    """The directory of a safetensors copy of the GGUF file `gguf`, written on first use.

    `name` starts the copy's directory name (by default the file's stem). `declared_dtype` is
    the dtype that `dtype="auto"` then loads the copy in. The copy is written to a temporary
    directory and renamed into place, so an interrupted conversion never leaves a half-written
    model that later loads would trust.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf).resolve()
    stat = gguf.stat()
    fingerprint = hashlib.sha1(
        f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}:{declared_dtype}:{CONVERSION_VERSION}".encode()
    ).hexdigest()[:12]
    target = cache_root() / f"{name or gguf.stem.lower()}-{fingerprint}"
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
        if declared_dtype is not None:
            _declare_dtype(staging / "config.json", declared_dtype)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
        share_as_umask_allows(staging)  # a shared cache: mkdtemp and safetensors write private files
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _declare_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """Set the dtype that `dtype="auto"` reads. `save_pretrained` writes the weights' dtype, and
    the weights stay float32, the dequantised values exactly, for float32 users."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
