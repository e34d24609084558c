"""A model given as a GGUF file in a local directory (`--gguf-file`): dequantised once into the
user cache, then loaded from that copy, with the weights transformers' own GGUF loading gives."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from hf_selfspec.embedded import embedded_gguf_path, load_embedded
from hf_selfspec.loading import load_model_and_tokenizer


def test_a_local_gguf_is_dequantised_once_and_loads_as_the_model(tmp_path, monkeypatch):
    reference, _ = load_embedded(dtype=torch.float32, generation_config=None)  # the embedded copy, as shipped
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(tmp_path / "cache"))
    gguf = embedded_gguf_path()
    gguf_loads = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def counting(*args, **kwargs):
        gguf_loads.append(kwargs.get("gguf_file"))
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counting)
    first, tokenizer = load_model_and_tokenizer(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    second, _ = load_model_and_tokenizer(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    assert gguf_loads.count(gguf.name) == 1  # the second load read the copy
    assert len(list((tmp_path / "cache").iterdir())) == 1
    ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = reference(ids).logits
        assert torch.equal(first(ids).logits, expected) and torch.equal(second(ids).logits, expected)
    assert first.dtype == torch.float32 and hasattr(first, "generate")
