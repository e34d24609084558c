"""A batch's bookkeeping alone: how its rows move in the cache (a sliding window's included), how
long its proposals may be, which attention masks it takes, and what weighs its steps. No
transformer runs."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig

from hf_selfspec.batch import quorum_rows, why_not_left_padded, within_quorum
from hf_selfspec.cache import DraftAwareCache, Realignment
from hf_selfspec.decoding_types import Draft
from hf_selfspec.params import SelfSpecParams
from hf_selfspec.policies import Backoff, ThroughputBackoff
from hf_selfspec.strategies import resolve_strategy
from helpers.tiny_models import tiny_model

WINDOW = 4


def _cache() -> DraftAwareCache:
    """Two layers, the first with a sliding window of `WINDOW`, the second full."""
    config = Gemma3TextConfig(num_hidden_layers=2, sliding_window=WINDOW, sliding_window_pattern=2, head_dim=2,
                              num_key_value_heads=1, num_attention_heads=1, hidden_size=2)
    return DraftAwareCache(config)


def _write(cache: DraftAwareCache, tokens: list[list[int]]) -> None:
    """One column per token for every row: each entry holds its row's token, in every layer."""
    entries = torch.tensor(tokens, dtype=torch.float32)[:, None, :, None].expand(-1, 1, -1, 2)
    for layer in range(2):
        cache.update(entries.clone(), entries.clone(), layer)


def _held(cache: DraftAwareCache, layer: int) -> list[list[int]]:
    return cache.layers[layer].keys[:, 0, :, 0].long().tolist()


def test_a_row_that_committed_less_moves_right_and_its_window_keeps_its_newest_tokens():
    cache = _cache()
    # Row 0: tokens 10..15; row 1, a shorter text: padding (-1), then its tokens 20..23.
    _write(cache, [[10, 11, 12, 13, 14, 15], [-1, -1, 20, 21, 22, 23]])
    cache.rollback(6)
    cache.starts = (0, 2)
    # A verification of each row's newest token and two drafted ones: row 0 accepts both (it
    # keeps all three columns), row 1 neither (it keeps its newest token's, 24; -9 is rejected).
    _write(cache, [[16, 17, 18], [24, -9, -9]])
    cache.realign(Realignment(kv_length=9, shifts=(0, 2)))
    full = _held(cache, 1)
    assert full[0] == [10, 11, 12, 13, 14, 15, 16, 17, 18]
    assert full[1][4:] == [20, 21, 22, 23, 24]  # right-aligned: its text ends at the last column
    assert cache.starts == (0, 4)
    # The window holds each row's last WINDOW - 1 tokens, as plain decoding's would.
    assert _held(cache, 0) == [[16, 17, 18], [22, 23, 24]]
    assert cache.layers[0].get_seq_length() == cache.layers[1].get_seq_length() == 9
    mask = cache.padding_mask(10, torch.device("cpu"))
    assert mask.tolist() == [[1] * 10, [0] * 4 + [1] * 6]


def test_rows_that_stop_leave_and_padding_every_row_shares_goes():
    cache = _cache()
    _write(cache, [[-1, -1, 10, 11], [-1, 20, 21, 22], [30, 31, 32, 33]])
    cache.starts = (2, 1, 0)
    cache.realign(Realignment(kv_length=4, kept_rows=(0, 1), dropped_columns=1))
    assert _held(cache, 1) == [[-1, 10, 11], [20, 21, 22]]
    assert cache.starts == (1, 0)
    assert cache.layers[0].get_seq_length() == 3


def test_a_batch_of_one_only_rolls_back():
    cache = _cache()
    _write(cache, [[1, 2, 3, 4, 5]])
    cache.realign(Realignment(kv_length=3))
    assert _held(cache, 1) == [[1, 2, 3]] and cache.starts is None


def test_proposals_are_cut_to_the_length_the_quorum_of_rows_reaches():
    assert [quorum_rows(0.25, rows) for rows in (1, 2, 4, 5, 8)] == [1, 1, 1, 2, 2]
    assert quorum_rows(0.0, 8) == 1 and quorum_rows(1.0, 8) == 8
    drafts = [Draft([1, 2, 3, 4, 5]), Draft([1, 2]), Draft([]), Draft([7, 8, 9])]
    assert [len(d.tokens) for d in within_quorum(drafts, 0.5)] == [3, 2, 0, 3]
    alone = [Draft([1, 2, 3, 4, 5])]
    assert within_quorum(alone, 1.0)[0].tokens == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "mask, phrase",
    [
        ([[1, 1, 1], [0, 1, 1]], None),
        ([[1, 1], [0, 1]], "shape (2, 2) is not input_ids' (2, 3)"),
        ([[1, 1, 1], [1, 1, 0]], "row 1 has zeros after its first one"),
        ([[1, 0, 1], [1, 1, 1]], "row 0 has zeros after its first one"),
        ([[1, 1, 1], [0, 0, 0]], "row 1 is all zeros"),
        ([[1, 1, 2], [1, 1, 1]], "values other than 0 and 1"),
    ],
)
def test_only_left_padding_is_taken(mask, phrase):
    problem = why_not_left_padded(torch.tensor(mask), torch.zeros((2, 3), dtype=torch.long))
    assert problem == phrase if phrase is None else phrase in problem


def test_a_batch_weighs_speculating_against_plain_steps_even_where_one_text_never_backs_off():
    never = SelfSpecParams(backoff_probe_interval=0)
    strategy = resolve_strategy("self_speculative")
    assert type(strategy.build_backoff(never)) is Backoff
    batch_backoff = strategy.build_batch_backoff(never)
    assert isinstance(batch_backoff, ThroughputBackoff)
    assert batch_backoff.modes.first_favoured_steps == strategy.UNMATCHED_FIRST_STEPS

    tiny = tiny_model("llama")
    one, batch = strategy.build(tiny, never, cache=None), strategy.build(tiny, never, cache=None, rows=3)
    assert type(one.backoff) is Backoff and len(one.rows) == 1
    assert isinstance(batch.backoff, ThroughputBackoff) and len(batch.rows) == 3
    # each row decides on its own
    assert len({id(row.exit_policy) for row in batch.rows}) == len({id(row.gate) for row in batch.rows}) == 3
