"""The reduced-precision consistency rule: identical, or a near-tie in plain greedy's own logits."""

from __future__ import annotations

import pytest
import torch

from hf_selfspec.consistency import (
    DEFAULT_MAX_ULPS,
    DIVERGENT,
    IDENTICAL,
    NEAR_TIE,
    check_greedy_consistency,
    logit_ulp,
    tolerance_for,
)


@pytest.mark.parametrize(
    "value, dtype, expected",
    [
        (20.0, torch.bfloat16, 0.125),  # 2**4 * 2**-7
        (-20.0, torch.bfloat16, 0.125),
        (35.0, torch.bfloat16, 0.25),
        (1.0, torch.bfloat16, 2**-7),
        (20.0, torch.float16, 2**4 * 2**-10),
        (20.0, torch.float32, 2**4 * 2**-23),
    ],
)
def test_ulp_is_the_spacing_of_the_dtype_at_that_magnitude(value, dtype, expected):
    assert logit_ulp(value, dtype) == expected
    # and it really is the dtype's spacing there: one ulp up is representable, a quarter rounds away
    up = torch.tensor([abs(value) + expected, abs(value) + expected / 4], dtype=torch.float64).to(dtype)
    assert up.tolist() == [abs(value) + expected, abs(value)]


def _logits(rows):
    """Plain greedy's logits, one `[vocab]` row a step, from {token: logit} dicts (others 0)."""
    table = torch.zeros(len(rows), 8)
    for index, row in enumerate(rows):
        for token, value in row.items():
            table[index, token] = value
    return table


PLAIN_TOKENS = [3, 4, 1]
# Step 1: plain chose 4 at 20.0; token 5 trails by 0.25 (2 bfloat16 ulps), token 6 by 1.0 (8 ulps).
PLAIN_LOGITS = _logits([{3: 20.0}, {4: 20.0, 5: 19.75, 6: 19.0}, {1: 20.0}])


def test_identical_output_is_identical_in_any_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        check = check_greedy_consistency(PLAIN_TOKENS, PLAIN_TOKENS, PLAIN_LOGITS, dtype)
        assert (check.verdict, check.first_difference, check.gap_ulps) == (IDENTICAL, None, None)
        assert check.consistent


def test_a_difference_within_the_tolerance_is_a_near_tie_in_reduced_precision():
    check = check_greedy_consistency([3, 5, 2, 2], PLAIN_TOKENS, PLAIN_LOGITS, torch.bfloat16)
    assert (check.verdict, check.first_difference, check.gap_ulps) == (NEAR_TIE, 1, 2.0)
    assert check.consistent


def test_a_difference_beyond_the_tolerance_is_divergent():
    check = check_greedy_consistency([3, 6, 1], PLAIN_TOKENS, PLAIN_LOGITS, torch.bfloat16)
    assert (check.verdict, check.first_difference, check.gap_ulps) == (DIVERGENT, 1, 8.0)
    assert not check.consistent
    # a looser, explicitly stated tolerance admits it
    assert check_greedy_consistency([3, 6, 1], PLAIN_TOKENS, PLAIN_LOGITS, torch.bfloat16, max_ulps=8).consistent


def test_float32_admits_no_near_tie():
    assert tolerance_for(torch.float32) == 0 and tolerance_for(torch.bfloat16) == DEFAULT_MAX_ULPS
    check = check_greedy_consistency([3, 5, 1], PLAIN_TOKENS, PLAIN_LOGITS, torch.float32)
    assert check.verdict == DIVERGENT


def test_stopping_early_or_late_is_divergent():
    assert check_greedy_consistency([3, 4], PLAIN_TOKENS, PLAIN_LOGITS, torch.bfloat16).verdict == DIVERGENT
    assert check_greedy_consistency(PLAIN_TOKENS + [2], PLAIN_TOKENS, PLAIN_LOGITS, torch.bfloat16).verdict == DIVERGENT


def test_logits_as_generate_returns_them_one_row_a_step():
    rows = tuple(row[None] for row in PLAIN_LOGITS)  # `output.logits`: one [1, vocab] tensor a step
    assert check_greedy_consistency([3, 5, 2], PLAIN_TOKENS, rows, torch.bfloat16).verdict == NEAR_TIE
