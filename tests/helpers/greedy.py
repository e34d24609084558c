"""The greedy identity check: a strategy's tokens against plain `generate`'s, on random prompts."""

from __future__ import annotations

import torch

from helpers.tiny_models import SLIDING_WINDOW


def random_prompts(vocab_size: int, count: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab_size, (1, length), generator=generator) for length in (3, 9, 17)[:count]]


def assert_same_greedy(model, prompt, new_tokens=3 * SLIDING_WINDOW + 5, **strategy_kwargs):
    expected = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, strategy="plain")
    output = model.generate(
        prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **strategy_kwargs
    )
    assert output.sequences.tolist() == expected.tolist(), strategy_kwargs
    return output
