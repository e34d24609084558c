"""The terminal report, drawn from the `results.json` document so that a saved run can be
shown again exactly as it was.

A lossless contender whose tokens differ from the baseline is marked `NO` always, and also in
red on a colour terminal: a speedup bought with different output is not a speedup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

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


def _identity_cell(contender: dict[str, Any], identical: bool) -> Cell:
    if identical:
        return Cell("yes")
    return Cell("NO", alarm=True) if contender["lossless"] else Cell("no (sampled)")


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
                Cell(_number(contender["acceptance_rate"], "{:.0%}")),
                Cell(_number(contender["mean_accepted_length"], "{:.2f}")),
                _identity_cell(contender, contender["identical"]),
            ]
        )
    return rows


def _category_lines(results: dict[str, Any], color: bool) -> list[str]:
    """Median speedup per category: a strategy that only wins on code should not hide behind an
    average over code and chat."""
    categories = results["categories"]
    if len(categories) < 2:
        return []
    rows = []
    for contender in results["contenders"]:
        row = [Cell(contender["name"])]
        for category in categories.values():
            summary = category["contenders"][contender["name"]]
            identity = _identity_cell(contender, summary["identical"])
            text = f"{summary['speedup']['median']:.2f}x" + ("" if summary["identical"] else f" {identity.text}")
            row.append(Cell(text, alarm=identity.alarm))
        rows.append(row)
    headers = ["contender", *(f"{name} ({len(category['prompt_ids'])})" for name, category in categories.items())]
    return ["", "median speedup by prompt category (number of prompts):", *_grid(headers, rows, color, left_columns=1)]


def _notes(results: dict[str, Any], color: bool) -> list[str]:
    settings, skip_sets = results["settings"], results["skip_sets"]
    default = skip_sets["default_params"]
    notes = [
        "",
        (
            f"speedup: per repeat, baseline seconds / contender seconds over the same prompts; median, min and max "
            f"over {settings['repeats']} repeat(s). accept: accepted / drafted tokens. "
            "acc/verify: accepted tokens per verification."
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
    for contender in results["contenders"]:
        if contender["lossless"] and not contender["identical"]:
            warning = (
                f"{contender['name']}: tokens differ from the baseline on "
                f"{len(contender['mismatched_prompts'])} prompt(s): {', '.join(contender['mismatched_prompts'])}"
            )
            notes.append(f"{RED}{warning}{RESET}" if color else warning)
    return notes


def render(results: dict[str, Any], color: bool = False) -> str:
    settings, machine = results["settings"], results["machine"]
    headers = ["contender", "params", "tok/s", "speedup", "min", "max", "accept", "acc/verify", "identical"]
    title = (
        f"{settings['prompts']} prompts x {settings['max_new_tokens']} new tokens, {settings['repeats']} repeat(s), "
        f"{machine['device_name']} ({machine['device']}, {machine['dtype']})"
    )
    lines = [title, "", *_grid(headers, _main_rows(results), color, left_columns=2)]
    lines += _category_lines(results, color)
    lines += _notes(results, color)
    return "\n".join(lines)
