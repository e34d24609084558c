"""The greedy identity check: a strategy's tokens against plain `generate`'s, on random prompts."""

from __future__ import annotations

import torch

from hf_selfspec.params import PARAM_NAMES
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


# Ragged prompt lengths for batches up to eight: one row of a single token, one longer than the
# sliding window, each left-padded to the longest.
RAGGED_LENGTHS = (3, 9, 17, 5, 12, 1, 7, 20)
PAD = 0


def ragged_batch(vocab_size: int, rows: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`: `rows` random prompts of `RAGGED_LENGTHS`, left-padded with
    `PAD`, as a tokenizer with `padding_side="left"` returns them."""
    generator = torch.Generator().manual_seed(seed)
    lengths = RAGGED_LENGTHS[:rows]
    width = max(lengths)
    input_ids = torch.full((rows, width), PAD, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(1, vocab_size, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def assert_same_batched_greedy(
    model, input_ids, attention_mask, new_tokens=3 * SLIDING_WINDOW + 5, strategy="self_speculative", **kwargs
):
    """Each row of a strategy's batch is the row plain batched greedy decoding gives, in the same
    batch with the same attention mask; `kwargs` that are no strategy parameter (an EOS, stopping
    criteria, processors) go to both."""
    ours = PARAM_NAMES | {"assistant_model"}
    strategy_kwargs = {name: value for name, value in kwargs.items() if name in ours}
    common = {name: value for name, value in kwargs.items() if name not in ours}
    common.update(attention_mask=attention_mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD)
    expected = model.generate(input_ids, strategy="plain", **common)
    output = model.generate(input_ids, return_dict_in_generate=True, strategy=strategy, **common, **strategy_kwargs)
    for row, (mine, theirs) in enumerate(zip(output.sequences.tolist(), expected.tolist())):
        assert mine == theirs, (row, input_ids.shape, strategy_kwargs)
    assert output.sequences.shape == expected.shape
    return output, expected
