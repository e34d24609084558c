"""The figures of a bench run, drawn from the `results.json` document.

matplotlib runs on the Agg backend: the bench often runs on headless machines, and a GUI
backend there either fails or opens windows nobody asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from matplotlib.patches import Patch  # noqa: E402

MISMATCH_COLOR = "tab:red"
FAMILY_COLORS = {"baseline": "tab:gray", "transformers": "tab:blue", "hf_selfspec": "tab:green"}


def plot_speedup(results: dict[str, Any], path: Path) -> None:
    """Median speedup per contender, whiskers from the slowest to the fastest repeat; a greedy
    contender that diverged from plain greedy beyond a near-tie is drawn in red."""
    contenders = results["contenders"]
    names = [c["name"] for c in contenders]
    medians = [c["speedup"]["median"] for c in contenders]
    whiskers = [
        [c["speedup"]["median"] - c["speedup"]["min"] for c in contenders],
        [c["speedup"]["max"] - c["speedup"]["median"] for c in contenders],
    ]
    colors = [
        MISMATCH_COLOR if c["consistency"]["divergent_prompts"] else FAMILY_COLORS.get(c["family"], "tab:olive")
        for c in contenders
    ]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.1 * len(names)), 4.5))
    axes.bar(range(len(names)), medians, yerr=whiskers, capsize=4, color=colors)
    axes.axhline(1.0, color="black", linestyle="--", linewidth=1)
    axes.set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes.set_ylabel(f"speedup vs plain generate, {_decoding(results)} (x)")
    axes.legend(
        handles=[Patch(color=color, label=family) for family, color in FAMILY_COLORS.items()]
        + [Patch(color=MISMATCH_COLOR, label="diverges from plain greedy")],
        fontsize=8,
        loc="best",
    )
    _save_with_title(figure, axes, results, "bars: median, whiskers: min-max", path)


def _save_with_title(figure, axes, results: dict[str, Any], legend: str, path: Path) -> None:
    """Title the figure with the machine and the run's size, then write it and free it."""
    settings, machine = results["settings"], results["machine"]
    # Two lines: a long CPU or GPU name on one line ran past the figure's right edge.
    axes.set_title(
        f"{machine['device_name']}, {machine['dtype']}\n{settings['prompts']} prompts x "
        f"{settings['max_new_tokens']} tokens, {settings['repeats']} repeat(s); {legend}",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_category_speedup(results: dict[str, Any], path: Path) -> None:
    """Median speedup per prompt category, one bar per contender in each group, then every prompt
    pooled ("all"): a contender that wins only where text is copied shows it at a glance. A
    contender that diverged from plain greedy beyond a near-tie in a category is hatched there."""
    categories = results["categories"]
    contenders = [c for c in results["contenders"] if c["name"] != results["baseline"]]
    groups = [*categories, "all"]
    figure, axes = plt.subplots(figsize=(max(6.0, 0.35 * len(groups) * max(1, len(contenders)) + 2.0), 4.5))
    width = 0.8 / max(1, len(contenders))
    colors = plt.get_cmap("tab10")
    for number, contender in enumerate(contenders):
        summaries = [categories[name]["contenders"][contender["name"]] for name in categories] + [contender]
        offsets = [group + (number - (len(contenders) - 1) / 2) * width for group in range(len(groups))]
        medians = [summary["speedup"]["median"] for summary in summaries]
        bars = axes.bar(offsets, medians, width, label=contender["name"], color=colors(number % 10))
        for bar, summary in zip(bars, summaries):
            if summary["consistency"]["divergent_prompts"]:
                bar.set_hatch("xx")
                bar.set_edgecolor(MISMATCH_COLOR)
    axes.axhline(1.0, color="black", linestyle="--", linewidth=1, label="plain")
    labels = [f"{name}\n({len(category['prompt_ids'])})" for name, category in categories.items()]
    axes.set_xticks(range(len(groups)), [*labels, "all"], fontsize=8)
    axes.set_ylabel(f"median speedup vs plain generate, {_decoding(results)} (x)")
    # Beside the axes: inside, with one bar per contender in every group, it always hides one.
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    hatching = "; hatched: diverges from plain greedy" if results["settings"]["sampling"] is None else ""
    _save_with_title(figure, axes, results, f"bars: median{hatching}", path)


def _decoding(results: dict[str, Any]) -> str:
    """How the speedups were measured, for an axis label: sampled speedups are per generated token."""
    return "greedy" if results["settings"]["sampling"] is None else "sampling, per token"


def plot_acceptance(results: dict[str, Any], path: Path) -> None:
    """Share of verifications that accepted 0, 1, 2, ... draft tokens, one panel per strategy:
    the mean alone cannot tell a steady drafter from one that alternates misses and long runs."""
    reporting = [c for c in results["contenders"] if c["accepted_length_counts"] is not None]
    figure, panels = plt.subplots(max(1, len(reporting)), 1, figsize=(7, 1.8 + 1.6 * len(reporting)), squeeze=False)
    if not reporting:
        panels[0][0].text(0.5, 0.5, "no contender reports accepted lengths", ha="center", va="center")
        panels[0][0].set_axis_off()
    for (axes,), contender in zip(panels, reporting):
        counts = {int(length): n for length, n in contender["accepted_length_counts"].items()}
        if not counts:
            axes.text(0.5, 0.5, f"{contender['name']}: no draft was verified", ha="center", va="center")
            axes.set_axis_off()
            continue
        total = sum(counts.values())
        lengths = range(max(counts) + 1)
        axes.bar(lengths, [counts.get(length, 0) / total for length in lengths], color="tab:green")
        axes.set_title(
            f"{contender['name']}: mean {contender['mean_accepted_length']:.2f} over {total} verifications",
            fontsize=9,
        )
        axes.set_ylabel("share")
        axes.set_xticks(lengths)
    figure.supxlabel("accepted draft tokens per verification", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
