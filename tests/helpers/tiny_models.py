"""Tiny randomly initialised decoders of every architecture the strategies must support.

The sliding-window architectures get a window shorter than the text the tests generate, so a
rejected draft has to be rolled back past tokens the window already dropped.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_selfspec

SLIDING_WINDOW = 8
NUM_LAYERS = 4
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

ARCHITECTURES = {
    "llama": lambda vocab: LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **_COMMON)),
    "mistral": lambda vocab: MistralForCausalLM(
        MistralConfig(vocab_size=vocab, sliding_window=SLIDING_WINDOW, **_COMMON)
    ),
    "qwen2": lambda vocab: Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab, use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=2, **_COMMON
        )
    ),
    "qwen3": lambda vocab: Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, head_dim=16, **_COMMON)),
    "gemma2": lambda vocab: Gemma2ForCausalLM(
        Gemma2Config(vocab_size=vocab, head_dim=16, sliding_window=SLIDING_WINDOW, **_COMMON)
    ),
    "gemma3": lambda vocab: Gemma3ForCausalLM(
        Gemma3TextConfig(
            vocab_size=vocab, head_dim=16, sliding_window=SLIDING_WINDOW, sliding_window_pattern=2, **_COMMON
        )
    ),
}


def tiny_model(architecture: str, vocab_size: int = 96, seed: int = 0, initializer_range: float | None = None):
    """An enabled, eval-mode tiny model; `initializer_range` sharpens its distributions."""
    return hf_selfspec.enable(tiny_transformers_model(architecture, vocab_size, seed, initializer_range))


def tiny_transformers_model(
    architecture: str, vocab_size: int = 96, seed: int = 0, initializer_range: float | None = None
):
    """The same model, not enabled: transformers' own class, as a user without hf_selfspec has it."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[architecture](vocab_size)
    if initializer_range is not None:
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() > 1:
                    parameter.normal_(0.0, initializer_range)
    return model.eval()
