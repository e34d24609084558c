"""The terminal report, drawn from the `results.json` document so that a saved run can be
shown again exactly as it was.

A greedy contender whose tokens diverge from plain greedy beyond a near-tie (see
`hf_selfspec.consistency`) is marked `NO` always, and also in red on a colour terminal: a speedup
bought with different output is not a speedup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from ..consistency import DIVERGENT, IDENTICAL, NEAR_TIE
from .report import SAMPLED

RED = "\033[31m"
RESET = "\033[0m"


@dataclass(frozen=True)
class Cell:
    text: str
    alarm: bool = False


def _grid(headers: Sequence[str], rows: Sequence[Sequence[Cell]], color: bool, left_columns: int) -> list[str]:
    """Aligned columns; padding is applied before colouring, so escape codes never shift them."""
    widths = [max(len(header), *(len(row[i].text) for row in rows)) for i, header in enumerate(headers)]

    def line(cells: Sequence[Cell]) -> str:
        parts = []
        for i, cell in enumerate(cells):
            padded = cell.text.ljust(widths[i]) if i < left_columns else cell.text.rjust(widths[i])
            parts.append(f"{RED}{padded}{RESET}" if cell.alarm and color else padded)
        return "  ".join(parts).rstrip()

    return [line([Cell(h) for h in headers]), "  ".join("-" * w for w in widths), *map(line, rows)]


def _number(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _consistency_cell(consistency: dict[str, Any]) -> Cell:
    verdict = consistency["verdict"]
    if verdict == SAMPLED:
        return Cell("n/a (sampled)")
    if verdict == NEAR_TIE:
        return Cell(f"near-tie (max {consistency['max_gap_ulps']:g} ulp)")
    return Cell("identical") if verdict == IDENTICAL else Cell("NO", alarm=True)


def _ratio(figures: dict[str, Any] | None) -> str:
    return "-" if figures is None else f"{figures['median']:.2f}x"


def _equal_kernels(results: dict[str, Any]) -> dict[str, str | None]:
    """The contenders that plain decoding and lookup ran as on our kernels (None where one did
    not run, or in a document written before they existed)."""
    return results.get("equal_kernels") or {"plain": None, "lookup": None}


def _extra_ratios(results: dict[str, Any]) -> list[tuple[str, str]]:
    """(column header, figure) of each ratio besides the speedup that this run has a reference for."""
    equal = _equal_kernels(results)
    columns = [("x plain, eq. kernels", "speedup_equal_kernels")] if equal["plain"] else []
    columns += [("x lookup", "ratio_to_lookup")] if results["lookup"] else []
    columns += [("x lookup, eq. kernels", "ratio_to_lookup_equal_kernels")] if equal["lookup"] else []
    return columns


def _main_rows(results: dict[str, Any]) -> list[list[Cell]]:
    rows = []
    for contender in results["contenders"]:
        speedup = contender["speedup"]
        rows.append(
            [
                Cell(contender["name"]),
                Cell(contender["params_label"]),
                Cell(_number(contender["tokens_per_second"]["median"], "{:.1f}")),
                Cell(_number(speedup["median"], "{:.2f}x")),
                Cell(_number(speedup["min"], "{:.2f}x")),
                Cell(_number(speedup["max"], "{:.2f}x")),
                *(Cell(_ratio(contender[figure])) for _, figure in _extra_ratios(results)),
                Cell(_number(contender["acceptance_rate"], "{:.0%}")),
                Cell(_number(contender["mean_accepted_length"], "{:.2f}")),
                _consistency_cell(contender["consistency"]),
            ]
        )
    return rows


def _category_grid(
    results: dict[str, Any], figure: str, geomean: str | None, skip: set[str], color: bool, grouping: str = "categories"
) -> list[str]:
    """One row per contender not in `skip`: its median `figure` in each group of `grouping`
    (prompt categories, or positions in a stream), over every prompt ("all", pooled) and, given
    `geomean`, the geometric mean of its category medians."""
    categories = results[grouping]
    rows = []
    for contender in results["contenders"]:
        if contender["name"] in skip:
            continue
        row = [Cell(contender["name"])]
        for category in categories.values():
            summary = category["contenders"][contender["name"]]
            verdict = summary["consistency"]["verdict"]
            consistency = _consistency_cell(summary["consistency"])
            flagged = verdict in (NEAR_TIE, DIVERGENT)  # a speedup never hides what the output became
            row.append(Cell(_ratio(summary[figure]) + (f" {consistency.text}" if flagged else ""), consistency.alarm))
        row.append(Cell(_ratio(contender[figure])))
        if geomean is not None:
            row.append(Cell(_number(contender[geomean], "{:.2f}x")))
        rows.append(row)
    headers = ["contender", *(f"{name} ({len(category['prompt_ids'])})" for name, category in categories.items())]
    return _grid([*headers, "all", *(["geomean"] if geomean is not None else [])], rows, color, left_columns=1)


def _category_lines(results: dict[str, Any], color: bool) -> list[str]:
    """Median speedup per category, and the ratio to transformers' prompt lookup per category: a
    strategy that only wins on code should not hide behind an average over code and chat."""
    if len(results["categories"]) < 2:
        return []
    lines = [
        "",
        "median speedup over plain by prompt category (number of prompts); all: every prompt pooled; "
        "geomean: of the category medians",
        *_category_grid(results, "speedup", "category_geomean_speedup", {results["baseline"]}, color),
    ]
    equal = _equal_kernels(results)
    references = {
        "speedup_equal_kernels": (equal["plain"], "plain decoding on our kernels"),
        "ratio_to_lookup": (results["lookup"], "transformers' prompt lookup"),
        "ratio_to_lookup_equal_kernels": (equal["lookup"], "transformers' prompt lookup on our kernels"),
    }
    transformers_own = {results["baseline"], *(name for name, _ in references.values() if name)}
    # a ratio to one of transformers' own needs a contender of ours beside them
    if not any(contender["name"] not in transformers_own for contender in results["contenders"]):
        return lines
    for header, figure in _extra_ratios(results):
        reference, what = references[figure]
        lines += [
            "",
            f"{header}: median ratio to {what} ({reference}), paired per repeat like the speedup, by prompt category",
            *_category_grid(results, figure, f"category_geomean_{figure}", transformers_own, color),
        ]
    return lines


def _position_lines(results: dict[str, Any], color: bool) -> list[str]:
    """Median speedup, and ratio to transformers' prompt lookup, by position in the stream: an
    online corpus is empty at a stream's start and pays only once it has learned."""
    if not results.get("positions"):
        return []
    lines = [
        "",
        "median speedup over plain by position in the stream (number of prompts); all: every prompt pooled",
        *_category_grid(results, "speedup", None, {results["baseline"]}, color, "positions"),
    ]
    if results["lookup"]:
        lines += [
            "",
            f"x lookup: median ratio to transformers' prompt lookup ({results['lookup']}) by position in the stream",
            *_category_grid(results, "ratio_to_lookup", None, {results["baseline"], results["lookup"]}, color,
                            "positions"),
        ]
    return lines


def _notes(results: dict[str, Any], color: bool) -> list[str]:
    settings, skip_sets = results["settings"], results["skip_sets"]
    default = skip_sets["default_params"]
    lookup = results["lookup"]
    notes = [
        "",
        (
            "speedup: per repeat, baseline seconds per generated token / contender seconds per generated token "
            f"over the same prompts; median, min and max over {settings['repeats']} repeat(s). "
            "accept: accepted / drafted tokens. "
            "acc/verify: accepted tokens per verification."
            + "".join(
                f" {header}: the same ratio with {reference} in the baseline's place."
                for header, reference in (
                    ("x plain, eq. kernels", _equal_kernels(results)["plain"]),
                    ("x lookup", lookup),
                    ("x lookup, eq. kernels", _equal_kernels(results)["lookup"]),
                )
                if reference
            )
        ),
        f"default skip set: attn {default['attn_skip_layers']}, mlp {default['mlp_skip_layers']}",
    ]
    profile = skip_sets["tuned_profile"]
    if profile is None:
        notes.append(f"no tuned profile for {skip_sets['profile_key']}: every strategy used the default skip set")
    else:
        notes.append(
            f"tuned profile for {skip_sets['profile_key']}: {profile['strategy']} with {json.dumps(profile['params'])}"
        )
    tolerance = results["consistency_tolerance_ulps"]
    if settings["sampling"] is not None:
        notes.append("consistent: not applicable to sampling, which has no single right output (n/a, sampled)")
    else:
        notes.append(
            f"consistent: identical to plain greedy, or a near-tie: first differing where plain's own logits for "
            f"the two tokens were within {tolerance:g} ulp of {results['machine']['dtype']}"
            if tolerance
            else f"consistent: identical to plain greedy ({results['machine']['dtype']} admits no near-tie)"
        )
    for contender in results["contenders"]:
        divergent = contender["consistency"]["divergent_prompts"]
        if divergent:
            warning = (
                f"{contender['name']}: tokens diverge from plain greedy beyond a near-tie on "
                f"{len(divergent)} prompt(s): {', '.join(divergent)}"
            )
            notes.append(f"{RED}{warning}{RESET}" if color else warning)
    return notes


def _decoding(settings: dict[str, Any]) -> str:
    sampling = settings["sampling"]
    if sampling is None:
        return "greedy"
    return (
        f"sampling at temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}, "
        f"seed {sampling['seed']} + repeat"
    )


def render(results: dict[str, Any], color: bool = False) -> str:
    settings, machine = results["settings"], results["machine"]
    headers = [
        "contender", "params", "tok/s", "speedup", "min", "max", *(header for header, _ in _extra_ratios(results)),
        "accept", "acc/verify", "consistent",
    ]  # fmt: skip
    title = (
        f"{settings['prompts']} prompts x {settings['max_new_tokens']} new tokens, {settings['repeats']} repeat(s), "
        f"{_decoding(settings)}, {machine['device_name']} ({machine['device']}, {machine['dtype']})"
    )
    stopped = settings["stopped_early"]
    if stopped:
        title += (
            f"\nstopped early: {settings['prompts']} of {stopped['planned_prompts']} prompts, "
            f"{settings['repeats']} of {stopped['planned_repeats']} repeat(s) measured"
        )
    lines = [title, "", *_grid(headers, _main_rows(results), color, left_columns=2)]
    lines += _category_lines(results, color)
    lines += _position_lines(results, color)
    lines += _notes(results, color)
    return "\n".join(lines)
