"""Loading the model a command names: `embedded`, a packaged model's name (`packaged_models`), a
local directory, or a Hub id."""

from __future__ import annotations

from pathlib import Path

import torch

from .dtypes import AUTO, parse_dtype, settle_auto_dtype

EMBEDDED = "embedded"


def pretrained_source(model: str) -> str:
    """Where `from_pretrained` reads the model a command names: the embedded model's converted
    copy, a packaged model's dequantised copy (made on first use), else the name as given (a local
    directory or a Hub id). Whatever reads the model's files (its configs) reads them here, with no
    Hub call for the models that ship in packages."""
    from .embedded import converted_model_dir
    from .packaged_models import PACKAGED_MODELS, packaged_model_dir

    if model == EMBEDDED:
        return str(converted_model_dir())
    if model in PACKAGED_MODELS:
        return str(packaged_model_dir(model))
    return model


def load_model_and_tokenizer(
    model: str = EMBEDDED,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = AUTO,
    device: str = "cpu",
    generation_config: str | Path | None = None,
):
    """`(enabled model, tokenizer)`. `generation_config` optionally replaces the model's own
    generation config with a `generation_config.json` (for example an exported tuned profile).
    `dtype="auto"` is the checkpoint's dtype (see `dtypes.settle_auto_dtype`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import load_embedded
    from .gguf import dequantised_copy
    from .inputs import existing_file
    from .mixin import enable
    from .packaged_models import PACKAGED_MODELS
    from .profiles import use_generation_config_file

    dtype = parse_dtype(dtype)
    if generation_config is not None:
        generation_config = existing_file(generation_config, "generation_config")
    if model == EMBEDDED:
        if gguf_file is not None:
            raise ValueError("--gguf-file applies to a directory or Hub id, not to the embedded model")
        loaded, tokenizer = load_embedded(dtype=dtype, device=device, generation_config=None)
    else:
        extra = {}
        if model in PACKAGED_MODELS:
            if gguf_file is not None:
                raise ValueError(f"--gguf-file applies to a directory or Hub id, not to the packaged model {model}")
            model = pretrained_source(model)
        elif gguf_file and Path(model).is_dir():
            model = str(dequantised_copy(existing_file(Path(model) / gguf_file, "--gguf-file")))
        elif gguf_file:  # a Hub id: transformers fetches and dequantises it
            extra = {"gguf_file": gguf_file}
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, **extra).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(model, **extra)
        loaded = enable(settle_auto_dtype(loaded) if dtype == AUTO else loaded)
    if generation_config is not None:
        use_generation_config_file(loaded, generation_config)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return loaded, tokenizer
