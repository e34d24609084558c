"""From raw timings to the figures of `results.json`, overall and per prompt category.

Speedup is computed per repeat, as the baseline's total seconds over a contender's total seconds
on the same prompts in that repeat, and then summarised by median, min and max across repeats.
Pairing within a repeat keeps machine drift between repeats out of the ratio; the median keeps
one disturbed repeat from moving the headline figure.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, Sequence

from ..consistency import DIVERGENT, IDENTICAL, NEAR_TIE, Consistency, check_greedy_consistency, tolerance_for
from ..stats import StrategyStats
from .contenders import BASELINE
from .runner import Measurements

FORMAT = "hf-selfspec-bench/2"
UNCATEGORIZED = "uncategorized"


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


_SEVERITY = {IDENTICAL: 0, NEAR_TIE: 1, DIVERGENT: 2}


def _worst(checks: Sequence[Consistency]) -> Consistency:
    """Divergent over near-tie over identical; among near-ties, the widest gap."""
    return max(checks, key=lambda check: (_SEVERITY[check.verdict], check.gap_ulps or 0.0))


def prompt_consistency(measurements: Measurements, name: str, prompt_index: int) -> Consistency | None:
    """How a greedy contender's output on one prompt compares with plain greedy's, over every
    repeat: the worst repeat decides (divergent over near-tie over identical), so one lucky
    repeat cannot hide a mismatch. None for a sampling contender, which has nothing to match."""
    contender = next(c for c in measurements.contenders if c.name == name)
    if not contender.lossless:
        return None
    reference = measurements.references[prompt_index]
    checks = [
        check_greedy_consistency(
            measurements.runs[name][repeat][prompt_index].new_tokens,
            reference.new_tokens,
            reference.logits,
            measurements.logit_dtype,
        )
        for repeat in range(measurements.repeats)
    ]
    return _worst(checks)


def _consistency_summary(checks: Sequence[tuple[str, Consistency | None]]) -> dict[str, Any]:
    """One contender's verdict over prompts, and which prompts were near-ties or divergent."""
    judged = [(prompt_id, check) for prompt_id, check in checks if check is not None]
    if not judged:
        return {"verdict": None, "max_gap_ulps": None, "near_tie_prompts": [], "divergent_prompts": []}
    worst = _worst([check for _, check in judged])
    return {
        "verdict": worst.verdict,
        "max_gap_ulps": worst.gap_ulps if worst.verdict == NEAR_TIE else None,
        "near_tie_prompts": [prompt_id for prompt_id, check in judged if check.verdict == NEAR_TIE],
        "divergent_prompts": [prompt_id for prompt_id, check in judged if check.verdict == DIVERGENT],
    }


def diverged(results: dict[str, Any], family: str) -> list[str]:
    """The contenders of `family` that left plain greedy decoding beyond a near-tie."""
    return [
        contender["name"]
        for contender in results["contenders"]
        if contender["family"] == family and contender["consistency"]["divergent_prompts"]
    ]


def _acceptance(stats: Sequence[StrategyStats]) -> dict[str, Any]:
    """Acceptance pooled over runs (not a mean of per-run rates, which would overweight short
    runs). Every figure is None for contenders that report nothing (transformers' own), and a
    rate is None rather than 0 when nothing was drafted: 0% would read as "every draft rejected"."""
    if not stats:
        return dict.fromkeys(("acceptance_rate", "mean_accepted_length", "verifications", "accepted_length_counts"))
    lengths = [length for s in stats for length in s.accepted_lengths]
    drafted = sum(s.drafted_tokens for s in stats)
    return {
        "acceptance_rate": sum(s.accepted_tokens for s in stats) / drafted if drafted else None,
        "mean_accepted_length": sum(lengths) / len(lengths) if lengths else None,
        "verifications": len(lengths),
        "accepted_length_counts": {str(length): n for length, n in sorted(Counter(lengths).items())},
    }


def summarize(measurements: Measurements, name: str, prompt_indices: Sequence[int]) -> dict[str, Any]:
    """Every aggregate figure for one contender over a subset of the prompts."""
    repeats = range(measurements.repeats)
    runs = measurements.runs[name]
    baseline = measurements.runs[BASELINE]
    seconds = [sum(runs[r][i].seconds for i in prompt_indices) for r in repeats]
    baseline_seconds = [sum(baseline[r][i].seconds for i in prompt_indices) for r in repeats]
    new_tokens = [sum(len(runs[r][i].new_tokens) for i in prompt_indices) for r in repeats]
    speedups = [base / own for base, own in zip(baseline_seconds, seconds, strict=True)]
    stats = [runs[r][i].stats for r in repeats for i in prompt_indices if runs[r][i].stats is not None]
    consistency = _consistency_summary(
        [(measurements.prompts[i].id, prompt_consistency(measurements, name, i)) for i in prompt_indices]
    )
    return {
        "tokens_per_second": spread([tokens / secs for tokens, secs in zip(new_tokens, seconds, strict=True)]),
        "speedup": {**spread(speedups), "per_repeat": speedups},
        "seconds_per_repeat": seconds,
        "new_tokens_per_repeat": new_tokens,
        **_acceptance(stats),
        "identical": consistency["verdict"] == IDENTICAL,
        "consistency": consistency,
    }


def _prompt_details(measurements: Measurements, name: str) -> list[dict[str, Any]]:
    details = []
    for index, prompt in enumerate(measurements.prompts):
        consistency = prompt_consistency(measurements, name, index)
        runs = [measurements.runs[name][repeat][index] for repeat in range(measurements.repeats)]
        details.append(
            {
                "id": prompt.id,
                "category": prompt.category,
                "consistency": consistency.verdict if consistency is not None else None,
                "first_difference": consistency.first_difference if consistency is not None else None,
                "gap_ulps": consistency.gap_ulps if consistency is not None else None,
                "seconds": [run.seconds for run in runs],
                "new_tokens": [len(run.new_tokens) for run in runs],
                "acceptance_rate": [
                    run.stats.acceptance_rate if run.stats and run.stats.drafted_tokens else None for run in runs
                ],
            }
        )
    return details


def category_indices(measurements: Measurements) -> dict[str, list[int]]:
    """Prompt indices per category; empty when no prompt carries a category."""
    if all(prompt.category is None for prompt in measurements.prompts):
        return {}
    groups: dict[str, list[int]] = {}
    for index, prompt in enumerate(measurements.prompts):
        groups.setdefault(prompt.category or UNCATEGORIZED, []).append(index)
    return groups


def results_document(
    measurements: Measurements,
    *,
    machine: dict[str, Any],
    skip_sets: dict[str, Any],
    command: dict[str, Any],
) -> dict[str, Any]:
    """The whole of `results.json`: enough to redraw the table and plots, or audit a claim."""
    everything = range(len(measurements.prompts))
    groups = category_indices(measurements)
    return {
        "format": FORMAT,
        "machine": machine,
        "consistency_tolerance_ulps": tolerance_for(measurements.logit_dtype),
        "command": command,
        "settings": {
            "prompts": len(measurements.prompts),
            "max_new_tokens": measurements.max_new_tokens,
            "repeats": measurements.repeats,
            "warmup_runs_per_contender": 1,
        },
        "skip_sets": skip_sets,
        "baseline": BASELINE,
        "prompts": [{"id": prompt.id, "category": prompt.category} for prompt in measurements.prompts],
        "contenders": [
            {
                **contender.describe(),
                **summarize(measurements, contender.name, everything),
                "per_prompt": _prompt_details(measurements, contender.name),
            }
            for contender in measurements.contenders
        ],
        "categories": {
            category: {
                "prompt_ids": [measurements.prompts[i].id for i in indices],
                "contenders": {
                    contender.name: summarize(measurements, contender.name, indices)
                    for contender in measurements.contenders
                },
            }
            for category, indices in groups.items()
        },
    }
