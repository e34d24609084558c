"""What a strategy reports about one `generate` call (`output.strategy_stats`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class StrategyStats:
    """Counters of one speculative `generate` call.

    `accepted_lengths` keeps one entry per verification that had a draft to check, so that the
    distribution (not only the mean) of accepted run lengths can be plotted.
    """

    strategy: str = ""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verification_steps: int = 0
    plain_steps: int = 0
    # Verifications that kept one of the draft's alternatives (counted in accepted_tokens too)
    accepted_alternatives: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accepted_lengths: list[int] = field(default_factory=list)

    def add(self, other: "StrategyStats") -> None:
        """Accumulate another call's counters, so a measurement over many prompts reports rates
        over all of them rather than an average of per-prompt rates."""
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        self.verification_steps += other.verification_steps
        self.plain_steps += other.plain_steps
        self.accepted_alternatives += other.accepted_alternatives
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.accepted_lengths.extend(other.accepted_lengths)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per verification that checked a draft."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    def as_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "verification_steps": self.verification_steps,
            "plain_steps": self.plain_steps,
            "accepted_alternatives": self.accepted_alternatives,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "accepted_lengths": list(self.accepted_lengths),
        }


def geometric_mean(values: Iterable[float]) -> float:
    """The geometric mean of speedups: the workload's one figure over its categories, for the
    bench and the tuner alike. Each category counts once however many prompts it has, and twice
    as fast on one with half as fast on another averages to even, where the arithmetic mean would
    claim a gain. A speedup
    of 0 (a category that never finished) makes it 0; a negative or non-finite one is an error."""
    values = list(values)
    if not values:
        raise ValueError("the geometric mean of no values is undefined")
    for value in values:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"a speedup must be a finite number >= 0, got {value}")
    if any(value == 0 for value in values):
        return 0.0
    return math.exp(math.fsum(math.log(value) for value in values) / len(values))
