"""A trial's speedup per category of its prompts, how the categories make one value, and the
floor a study may require in every category.

A workload mixes kinds of text on which one profile fares very differently: translation copies
much of its prompt, conversation almost none. Summed seconds would let the categories with the
longest decodes or the largest wins outvote the rest; the geometric mean of per-category
speedups weighs every category alike and values the same relative gain anywhere, so a trial
cannot pass off a loss on free text behind a win on copied text. With one category (or prompts
that carry none) the geometric mean of that one speedup is the pooled ratio of plain's seconds
per generated token to the candidate's.

Per generated token, not per prompt: in bfloat16 a candidate may leave plain's text at a
near-tie and end its answer sooner, and total seconds would credit the time it did not spend
writing as speed. Where the tokens are plain's own (float32) the two divisions agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna

from hf_selfspec.tuner_api import StrategyStats, geometric_mean

# What a trial's value is, recorded on the trial and in the exported profile as `speedup_kind`.
POOLED = "pooled"
CATEGORY_GEOMETRIC_MEAN = "category_geometric_mean"
# The name of the constraint a floor sets (Optuna: feasible when its value is at most 0).
FLOOR_CONSTRAINT = "category_floor"
# The name given to prompts without a category among prompts with one.
UNCATEGORISED = "uncategorised"


def alternating_order(categories: Sequence[str | None]) -> list[bool]:
    """For each prompt, whether the candidate decodes before plain decoding."""
    return [offset == 1 for offset in rotation_offsets(categories, 2)]


def rotation_offsets(categories: Sequence[str | None], contenders: int) -> list[int]:
    """For each prompt, by how many places the contenders' order is rotated on it.

    Rotating by position alone would put every prompt of a category in the same place when the
    prompts cycle through a multiple of `contenders` categories, and a category's speedup would
    carry the cost of always going first. So the rotation advances within each category, and
    neighbouring categories start one place apart; with one category it advances prompt by prompt.
    """
    ranks: dict[str | None, int] = {}
    seen: dict[str | None, int] = {}
    offsets = []
    for category in categories:
        rank = ranks.setdefault(category, len(ranks))
        offsets.append((rank + seen.get(category, 0)) % contenders)
        seen[category] = seen.get(category, 0) + 1
    return offsets


@dataclass
class SpeedupTotals:
    """Plain's and the candidate's seconds and generated tokens, and the candidate's draft
    counters, summed over prompts."""

    baseline_seconds: float = 0.0
    baseline_tokens: int = 0
    candidate_seconds: float = 0.0
    candidate_tokens: int = 0
    draft: StrategyStats = field(default_factory=StrategyStats)
    prompts: int = 0

    def add(
        self, baseline: tuple[float, int], candidate: tuple[float, int], stats: StrategyStats | None, prompts: int = 1
    ) -> None:
        """`baseline` and `candidate`: each decode's (seconds, generated tokens), of `prompts`
        prompts decoded at once."""
        self.baseline_seconds += baseline[0]
        self.baseline_tokens += baseline[1]
        self.candidate_seconds += candidate[0]
        self.candidate_tokens += candidate[1]
        self.prompts += prompts
        if stats is not None:
            self.draft.add(stats)

    @property
    def baseline_tokens_per_second(self) -> float:
        return self.baseline_tokens / self.baseline_seconds if self.baseline_seconds > 0 else 0.0

    @property
    def candidate_tokens_per_second(self) -> float:
        return self.candidate_tokens / self.candidate_seconds if self.candidate_seconds > 0 else 0.0

    @property
    def speedup(self) -> float:
        """Plain's seconds per generated token over the candidate's."""
        baseline = self.baseline_tokens_per_second
        return self.candidate_tokens_per_second / baseline if baseline > 0 else 0.0


class CategorySpeedups:
    """A trial's seconds and draft counters, overall and per category, as its prompts are decoded."""

    def __init__(self, categories: Sequence[str | None]):
        """`categories`: those of every prompt the trial will decode, which fix the trial's kind
        of value before any is measured."""
        self.kind = CATEGORY_GEOMETRIC_MEAN if len(set(categories)) > 1 else POOLED
        self.overall = SpeedupTotals()
        self.totals: dict[str, SpeedupTotals] = {}

    def add(
        self,
        category: str | None,
        baseline: tuple[float, int],
        candidate: tuple[float, int],
        stats: StrategyStats | None,
        prompts: int = 1,
    ) -> None:
        """One prompt's plain and candidate decodes, each as (seconds, generated tokens), or a
        batch's of `prompts` prompts (its tokens those of all its rows)."""
        for totals in (self.overall, self.totals.setdefault(category or UNCATEGORISED, SpeedupTotals())):
            totals.add(baseline, candidate, stats, prompts)

    @property
    def value(self) -> float:
        """The geometric mean of the speedups of the categories measured so far (the pruner's
        intermediate value, and the trial's value once all are)."""
        return geometric_mean(totals.speedup for totals in self.totals.values()) if self.totals else 0.0

    def below(self, floor: float) -> dict[str, float]:
        """The categories whose speedup is under `floor`, with their speedups."""
        return {name: totals.speedup for name, totals in self.totals.items() if totals.speedup < floor}

    def user_attrs(self) -> dict[str, Any]:
        draft = self.overall.draft
        attrs: dict[str, Any] = {
            "speedup": self.value,
            "speedup_kind": self.kind,
            "acceptance_rate": draft.acceptance_rate,
            "mean_accepted_length": draft.mean_accepted_length,
            "tokens_per_second": self.overall.candidate_tokens_per_second,
            "baseline_tokens_per_second": self.overall.baseline_tokens_per_second,
            "prompts_measured": self.overall.prompts,
        }
        if self.kind == CATEGORY_GEOMETRIC_MEAN:
            attrs["category_speedups"] = {name: totals.speedup for name, totals in self.totals.items()}
            attrs["category_acceptance"] = {name: totals.draft.acceptance_rate for name, totals in self.totals.items()}
            attrs["category_prompts"] = {name: totals.prompts for name, totals in self.totals.items()}
        return attrs

    def record(self, trial: optuna.trial.BaseTrial, floor: float | None = None) -> None:
        """Record the figures on the trial and, with a floor, whether it is feasible: the
        constraint is how far the worst category falls short of the floor (at most 0 where none
        does), which Optuna's TPE sampler reads to steer away from infeasible regions. Only for
        a trial that decoded all its prompts: one cut short has not measured every category."""
        attrs = self.user_attrs()
        if floor is not None and self.totals:
            attrs["below_category_floor"] = self.below(floor)
            trial.set_constraint(FLOOR_CONSTRAINT, floor - min(t.speedup for t in self.totals.values()))
        for key, value in attrs.items():
            trial.set_user_attr(key, value)


def is_feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """Optuna's rule: every constraint at most 0; a trial without constraints is feasible."""
    return all(value <= 0 for value in trial.constraints.values())


def describe_categories(attrs: dict[str, Any]) -> str:
    """`<category> <speedup>x, ...` from a trial's user attributes, or ''."""
    speedups = attrs.get("category_speedups") or {}
    return ", ".join(f"{name} {speedup:.2f}x" for name, speedup in speedups.items())
