"""From raw timings to the figures of `results.json`, overall and per prompt category.

Speedup is computed per repeat, as the baseline's cost over a contender's cost on the same prompts
in that repeat, and then summarised by median, min and max across repeats. Pairing within a repeat
keeps machine drift between repeats out of the ratio; the median keeps one disturbed repeat from
moving the headline figure. The cost is seconds per generated token (total seconds over total
tokens of the prompts), greedy or sampled. Under sampling, lengths differ; so they do under greedy
decoding in bfloat16 or float16, where a consistent contender may take the other side of a
near-tie and reach the end of its answer sooner or later than plain decoding, and dividing total
seconds would credit it for the tokens it did not write. Where the tokens are identical, the
two costs give the same ratio.

The ratio to transformers' prompt lookup pairs the same way, with lookup in the baseline's place:
it is the figure ours must beat, since lookup comes free with transformers. Each ratio has an
equal-kernel counterpart where plain decoding or lookup also ran on our kernels: the speed-up a
draft earns, with the kernel's share taken out.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, Mapping, Sequence

from ..consistency import DIVERGENT, IDENTICAL, NEAR_TIE, Consistency, check_greedy_consistency, tolerance_for
from ..stats import StrategyStats, geometric_mean
from .contenders import BASELINE, PLAIN_OUR_KERNELS, PROMPT_LOOKUP, PROMPT_LOOKUP_OUR_KERNELS
from .runner import Measurements

FORMAT = "hf-selfspec-bench/2"
# Each ratio of `summarize`, and the contender in the baseline's place
RATIOS = {
    "speedup": BASELINE,
    "speedup_equal_kernels": PLAIN_OUR_KERNELS,
    "ratio_to_lookup": PROMPT_LOOKUP,
    "ratio_to_lookup_equal_kernels": PROMPT_LOOKUP_OUR_KERNELS,
}
UNCATEGORIZED = "uncategorized"
# Positions in a stream reported apart: the requests an online corpus meets while it is still
# nearly empty, and the rest.
FIRST_POSITIONS = 10
POSITION_GROUPS = (f"1-{FIRST_POSITIONS}", f"{FIRST_POSITIONS + 1}+")
# What a speedup divides (see the module docstring), named in `settings.speedup_metric`.
SECONDS_PER_TOKEN = "seconds_per_token"
# The consistency verdict of a contender that sampled: no single output is right, so none is judged.
SAMPLED = "sampled"


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


_SEVERITY = {IDENTICAL: 0, NEAR_TIE: 1, DIVERGENT: 2}


def _worst(checks: Sequence[Consistency]) -> Consistency:
    """Divergent over near-tie over identical; among near-ties, the widest gap."""
    return max(checks, key=lambda check: (_SEVERITY[check.verdict], check.gap_ulps or 0.0))


def prompt_consistency(measurements: Measurements, name: str, prompt_index: int) -> Consistency | None:
    """How a greedy contender's output on one prompt compares with plain greedy's, over every
    repeat: the worst repeat decides (divergent over near-tie over identical), so one lucky
    repeat cannot hide a mismatch. None for a sampling contender or a sampled run, which have
    nothing to match."""
    contender = next(c for c in measurements.contenders if c.name == name)
    if not contender.lossless or measurements.sampling is not None:
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
        return {"verdict": SAMPLED, "max_gap_ulps": None, "near_tie_prompts": [], "divergent_prompts": []}
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


def _totals(measurements: Measurements, name: str, prompt_indices: Sequence[int]) -> tuple[list[float], list[int]]:
    """Seconds and generated tokens per repeat, summed over a subset of the prompts."""
    runs = measurements.runs[name]
    repeats = range(measurements.repeats)
    seconds = [sum(runs[r][i].seconds for i in prompt_indices) for r in repeats]
    return seconds, [sum(len(runs[r][i].new_tokens) for i in prompt_indices) for r in repeats]


def _costs(measurements: Measurements, name: str, prompt_indices: Sequence[int]) -> list[float]:
    """What a speedup divides, per repeat, over a subset of the prompts (see the module docstring)."""
    seconds, tokens = _totals(measurements, name, prompt_indices)
    return [secs / count for secs, count in zip(seconds, tokens, strict=True)]


def _paired_ratio(
    measurements: Measurements, reference: str, name: str, prompt_indices: Sequence[int]
) -> dict[str, Any]:
    """`reference`'s cost over `name`'s, repeat by repeat, and their spread."""
    reference_costs = _costs(measurements, reference, prompt_indices)
    costs = _costs(measurements, name, prompt_indices)
    ratios = [base / cost for base, cost in zip(reference_costs, costs, strict=True)]
    return {**spread(ratios), "per_repeat": ratios}


def summarize(measurements: Measurements, name: str, prompt_indices: Sequence[int]) -> dict[str, Any]:
    """Every aggregate figure for one contender over a subset of the prompts; a ratio is None
    where the contender in the baseline's place (`RATIOS`) did not run."""
    repeats = range(measurements.repeats)
    runs = measurements.runs[name]
    seconds, new_tokens = _totals(measurements, name, prompt_indices)
    stats = [runs[r][i].stats for r in repeats for i in prompt_indices if runs[r][i].stats is not None]
    consistency = _consistency_summary(
        [(measurements.prompts[i].id, prompt_consistency(measurements, name, i)) for i in prompt_indices]
    )
    ratios = {
        figure: _paired_ratio(measurements, reference, name, prompt_indices) if reference in measurements.runs else None
        for figure, reference in RATIOS.items()
    }
    return {
        "tokens_per_second": spread([tokens / secs for tokens, secs in zip(new_tokens, seconds, strict=True)]),
        **ratios,
        "seconds_per_repeat": seconds,
        "new_tokens_per_repeat": new_tokens,
        **_acceptance(stats),
        "identical": None if consistency["verdict"] == SAMPLED else consistency["verdict"] == IDENTICAL,
        "consistency": consistency,
    }


def _category_geomeans(by_category: Mapping[str, dict[str, Any]]) -> dict[str, float | None]:
    """Geometric means over categories of each of one contender's median ratios
    (`category_geomean_<ratio>`); None where there are no categories, or the ratio's reference
    did not run."""
    geomeans = {}
    for figure in RATIOS:
        medians = [summary[figure]["median"] for summary in by_category.values() if summary[figure] is not None]
        geomeans[f"category_geomean_{figure}"] = geometric_mean(medians) if medians else None
    return geomeans


def _prompt_details(measurements: Measurements, name: str) -> list[dict[str, Any]]:
    details = []
    for index, prompt in enumerate(measurements.prompts):
        consistency = prompt_consistency(measurements, name, index)
        runs = [measurements.runs[name][repeat][index] for repeat in range(measurements.repeats)]
        details.append(
            {
                "id": prompt.id,
                "category": prompt.category,
                "consistency": consistency.verdict if consistency is not None else SAMPLED,
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


def position_indices(measurements: Measurements) -> dict[str, list[int]]:
    """Prompt indices by position in their stream (`POSITION_GROUPS`); empty when no prompt
    carries a position."""
    if all(prompt.position is None for prompt in measurements.prompts):
        return {}
    groups: dict[str, list[int]] = {}
    for index, prompt in enumerate(measurements.prompts):
        if prompt.position is not None:
            groups.setdefault(POSITION_GROUPS[prompt.position > FIRST_POSITIONS], []).append(index)
    return {name: groups[name] for name in POSITION_GROUPS if name in groups}


def _grouped(measurements: Measurements, groups: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """Each group's prompt ids and every contender's figures over them."""
    return {
        name: {
            "prompt_ids": [measurements.prompts[i].id for i in indices],
            "contenders": {
                contender.name: summarize(measurements, contender.name, indices)
                for contender in measurements.contenders
            },
        }
        for name, indices in groups.items()
    }


def _stopped_early(planned: tuple[int, int] | None) -> dict[str, int] | None:
    if planned is None:
        return None
    prompts, repeats = planned
    return {"planned_prompts": prompts, "planned_repeats": repeats}


def results_document(
    measurements: Measurements,
    *,
    machine: dict[str, Any],
    skip_sets: dict[str, Any],
    command: dict[str, Any],
) -> dict[str, Any]:
    """The whole of `results.json`: enough to redraw the table and plots, or audit a claim."""
    everything = range(len(measurements.prompts))
    categories = _grouped(measurements, category_indices(measurements))
    positions = position_indices(measurements)
    sampling = measurements.sampling
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
            "sampling": sampling.to_json() if sampling is not None else None,
            "speedup_metric": SECONDS_PER_TOKEN,
            "stopped_early": _stopped_early(measurements.planned),
        },
        "skip_sets": skip_sets,
        "baseline": BASELINE,
        "lookup": PROMPT_LOOKUP if PROMPT_LOOKUP in measurements.runs else None,
        "equal_kernels": {
            "plain": PLAIN_OUR_KERNELS if PLAIN_OUR_KERNELS in measurements.runs else None,
            "lookup": PROMPT_LOOKUP_OUR_KERNELS if PROMPT_LOOKUP_OUR_KERNELS in measurements.runs else None,
        },
        "prompts": [{"id": prompt.id, "category": prompt.category} for prompt in measurements.prompts],
        "contenders": [
            {
                **contender.describe(),
                **summarize(measurements, contender.name, everything),
                **_category_geomeans(
                    {category: block["contenders"][contender.name] for category, block in categories.items()}
                ),
                "per_prompt": _prompt_details(measurements, contender.name),
            }
            for contender in measurements.contenders
        ],
        "categories": categories,
        # only for prompts in streams, so that other runs' documents stay as they were
        **({"positions": _grouped(measurements, positions)} if positions else {}),
    }
