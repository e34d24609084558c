"""Whether a greedy output is the one plain greedy decoding gives, in any precision.

In float32 a speculative decode must give plain `generate`'s tokens exactly. In bfloat16 and
float16 nobody can promise that: a verification of k tokens multiplies matrices of another shape
than k one-token steps, so the kernels sum in another order and the logits round differently.
Where plain's own top two logits are within a rounding or two of each other, either token is an
honest greedy choice, and every speculative method (transformers' prompt lookup included) can
leave plain's path there. So in reduced precision a greedy output is *consistent* when it equals
plain's, or when, at the first token where it differs, plain's logit for its own token exceeds
plain's logit for ours by at most `max_ulps` units in the last place of the logit dtype.

Between a verification and a one-token step a logit moves by a few ulps at most, so a flip
needs plain's gap within about that. `DEFAULT_MAX_ULPS` is 4, and the report gives the gap
itself, so a reader can hold any run to a stricter bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

DEFAULT_MAX_ULPS = 4

IDENTICAL = "identical"
NEAR_TIE = "near-tie"
DIVERGENT = "divergent"


def logit_ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s representable numbers around `value`: what one rounding can move it."""
    magnitude = abs(value)
    if magnitude == 0.0 or not math.isfinite(magnitude):
        return torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))


def tolerance_for(dtype: torch.dtype, max_ulps: float = DEFAULT_MAX_ULPS) -> float:
    """float32 decodes are held to exact identity; reduced precision gets `max_ulps`."""
    return 0.0 if torch.finfo(dtype).bits >= 32 else max_ulps


@dataclass(frozen=True)
class Consistency:
    verdict: str  # IDENTICAL, NEAR_TIE or DIVERGENT
    first_difference: int | None = None
    # plain's logit gap between its own token and ours at the first difference, in ulps
    gap_ulps: float | None = None

    @property
    def consistent(self) -> bool:
        return self.verdict != DIVERGENT


def check_greedy_consistency(
    tokens: Sequence[int],
    plain_tokens: Sequence[int],
    plain_logits: torch.Tensor | Sequence[torch.Tensor],
    logit_dtype: torch.dtype,
    max_ulps: float | None = None,
) -> Consistency:
    """Compare new tokens with plain greedy's new tokens, using plain's raw logits at each of its
    steps (`generate(..., output_logits=True)`'s `logits`, one `[vocab]` or `[1, vocab]` row a step).

    `logit_dtype` is the dtype the model computes its logits in; `max_ulps` defaults to
    `tolerance_for(logit_dtype)`. An output that stops where plain goes on, or goes on where plain
    stopped, has no second token to compare and is divergent.
    """
    tokens, plain_tokens = list(tokens), list(plain_tokens)
    index = next((i for i, (ours, theirs) in enumerate(zip(tokens, plain_tokens)) if ours != theirs), None)
    if index is None:
        if len(tokens) == len(plain_tokens):
            return Consistency(IDENTICAL)
        return Consistency(DIVERGENT, first_difference=min(len(tokens), len(plain_tokens)))
    row = plain_logits[index].reshape(-1).float()
    theirs, ours = float(row[plain_tokens[index]]), float(row[tokens[index]])
    gap_ulps = (theirs - ours) / logit_ulp(theirs, logit_dtype)
    bound = tolerance_for(logit_dtype) if max_ulps is None else max_ulps
    verdict = NEAR_TIE if gap_ulps <= bound and bound > 0 else DIVERGENT
    return Consistency(verdict, first_difference=index, gap_ulps=gap_ulps)
