"""Loading the model a command names: `embedded`, a local directory, or a Hub id."""

from __future__ import annotations

from pathlib import Path

import torch

EMBEDDED = "embedded"


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16")
    return dtype


def load_model_and_tokenizer(
    model: str = EMBEDDED,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = torch.float32,
    device: str = "cpu",
    generation_config: str | Path | None = None,
):
    """`(enabled model, tokenizer)`. `generation_config` optionally replaces the model's own
    generation config with a `generation_config.json` (for example an exported tuned profile)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import load_embedded
    from .mixin import enable
    from .profiles import use_generation_config_file

    dtype = parse_dtype(dtype)
    if model == EMBEDDED:
        if gguf_file is not None:
            raise ValueError("--gguf-file applies to a directory or Hub id, not to the embedded model")
        loaded, tokenizer = load_embedded(dtype=dtype, device=device, generation_config=None)
    else:
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **extra).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(model, **extra)
        loaded = enable(loaded)
    if generation_config is not None:
        path = Path(generation_config)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such generation_config.json")
        use_generation_config_file(loaded, path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return loaded, tokenizer
