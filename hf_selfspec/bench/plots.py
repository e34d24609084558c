"""The two figures of a bench run, drawn from the `results.json` document.

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
    axes.set_ylabel("speedup vs greedy generate (x)")
    axes.legend(
        handles=[Patch(color=color, label=family) for family, color in FAMILY_COLORS.items()]
        + [Patch(color=MISMATCH_COLOR, label="diverges from plain greedy")],
        fontsize=8,
        loc="best",
    )
    settings, machine = results["settings"], results["machine"]
    # Two lines: a long CPU or GPU name on one line ran past the figure's right edge.
    axes.set_title(
        f"{machine['device_name']}, {machine['dtype']}\n{settings['prompts']} prompts x "
        f"{settings['max_new_tokens']} tokens, {settings['repeats']} repeat(s); bars: median, whiskers: min-max",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


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
