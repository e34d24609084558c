"""The tests' rooms: unit/ (no model, or a trivial one), integration/ (tiny random models of every
supported architecture), real_model/ (the embedded SmolLM2, marked `real_model`), tuning/ (the
tuner and its commands) and packaging/ (the wheel, the Hub package, zero install, push). What
several test modules share lives in helpers/, imported as `helpers`; the fixtures every room
shares live here: a tiny random Llama that any command can load from disk, offline."""

from __future__ import annotations

import os

import pytest

# Every test runs offline: a test that reached the Hub would be slow, flaky and hide a bug.
os.environ["HF_HUB_OFFLINE"] = "1"
# Tiny models gain nothing from threads, and OpenMP workers spinning for a core that another
# process holds make them ~10x slower; subprocesses started by tests inherit this too.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 4-layer random Llama saved with the embedded model's tokenizer.

    Its weights are random, so its drafts are poor: tests on it check plumbing and losslessness,
    never speed. The real tokenizer keeps chat templates and prompt lengths realistic.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_selfspec.embedded import converted_model_dir

    tokenizer = AutoTokenizer.from_pretrained(converted_model_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
