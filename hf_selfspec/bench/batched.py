"""`hf-selfspec bench --batch-size`: whole batches of prompts, plain batched `generate` against our
strategies, in tokens per second over each batch.

Prompts are batched within their category, a batch of the given size at a time (a category's
last batch smaller), so that every category keeps a figure of its own as at batch one. For each
batch size, batch after batch, interleaved as the rest of the bench is: plain batched `generate`
(the baseline), each of our contenders on the whole batch, and each of them at batch one on the
batch's prompts one after another (`vs batch 1`: what the same user gets without batching).
transformers' prompt lookup and assisted decoding refuse a batch, so they are no contenders here;
plain batched `generate` on our kernels is, where asked for (`plain+our_kernels`): the ratio
against it (`x plain, our kernels`) is what speculation earns on equal kernels.

A batch's tokens are each row's new tokens up to its end (its EOS, or the limit); the padding
after a row that stopped is none. Each greedy contender's rows are checked against plain batched
greedy's in the same batch: identical in float32, consistent in reduced precision
(`hf_selfspec.consistency`), as the rest of the bench checks a prompt.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from ..consistency import check_greedy_consistency
from ..measure import timed, until_end
from ..prompts import Prompt, encode_batch, encode_prompt
from ..stats import geometric_mean
from .contenders import BASELINE, HF_SELFSPEC, PLAIN_OUR_KERNELS, Contender

BATCHES_FILE = "batches.json"
UNCATEGORISED = "all"


def batch_contenders(contenders: Sequence[Contender]) -> list[Contender]:
    """The contenders that decode a batch: the baseline, the baseline on our kernels and ours,
    none with an online corpus (a corpus learns across requests, which a batch decodes at once)."""
    return [
        contender for contender in contenders
        if (contender.name in (BASELINE, PLAIN_OUR_KERNELS) or contender.family == HF_SELFSPEC)
        and "online_corpus" not in contender.generate_kwargs
    ]


def batches_of(prompts: Sequence[Prompt], size: int) -> list[tuple[str, list[Prompt]]]:
    """`(category, prompts)` batches of `size` prompts of one category, categories in the order
    they first appear."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category or UNCATEGORISED, []).append(prompt)
    return [
        (category, members[start : start + size])
        for category, members in by_category.items()
        for start in range(0, len(members), size)
    ]


def _rows(sequences: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens up to its end: its first EOS, included, or the last token."""
    return [until_end(row, eos) for row in sequences[:, prompt_width:].tolist()]


def _decode(model, inputs: dict[str, torch.Tensor], common: dict, kwargs, logits: bool = False):
    inputs = {name: value.to(model.device) for name, value in inputs.items()}
    return timed(
        lambda: model.generate(**inputs, **common, **kwargs, return_dict_in_generate=True, output_logits=logits),
        model.device,
    )


class _Batches:
    """One batch size's figures: per contender, each repeat's seconds on each batch, and the
    checks of its rows."""

    def __init__(self, model, tokenizer, contenders: Sequence[Contender], batches, common: dict, eos: set[int]):
        self.model, self.tokenizer, self.contenders, self.batches = model, tokenizer, contenders, batches
        self.common, self.eos = common, eos
        self.seconds: dict[str, list[list[float]]] = {}
        self.tokens = [0] * len(batches)
        self.checks: dict[str, list[str]] = {contender.name: [] for contender in contenders}

    def measure(self, repeat: int, index: int, size: int) -> None:
        inputs = encode_batch(self.tokenizer, self.batches[index][1])
        width = inputs["input_ids"].shape[1]
        if repeat == 0:
            reference, _ = _decode(self.model, inputs, self.common, {"strategy": "plain", "do_sample": False}, logits=True)
            self.reference = (_rows(reference.sequences, width, self.eos), reference.logits)
            self.tokens[index] = sum(len(row) for row in self.reference[0])
        for contender in self.contenders:
            output, seconds = _decode(self.model, inputs, self.common, contender.generate_kwargs)
            self._add(contender.name, repeat, index, seconds)
            if repeat == 0 and contender.lossless:
                self.checks[contender.name] += self._checked(_rows(output.sequences, width, self.eos))
            if size > 1 and contender.family == HF_SELFSPEC:
                alone = sum(self._alone(prompt, contender) for prompt in self.batches[index][1])
                self._add(f"{contender.name}@1", repeat, index, alone)

    def _alone(self, prompt: Prompt, contender: Contender) -> float:
        return _decode(self.model, encode_prompt(self.tokenizer, prompt), self.common, contender.generate_kwargs)[1]

    def _add(self, name: str, repeat: int, index: int, seconds: float) -> None:
        per_repeat = self.seconds.setdefault(name, [])
        while len(per_repeat) <= repeat:
            per_repeat.append([0.0] * len(self.batches))
        per_repeat[repeat][index] = seconds

    def _checked(self, rows: list[list[int]]) -> list[str]:
        plain_rows, logits = self.reference
        checks = []
        for row, (mine, theirs) in enumerate(zip(rows, plain_rows)):
            row_logits = [step[row] for step in logits]
            checks.append(check_greedy_consistency(mine, theirs, row_logits, self.model.dtype).verdict)
        return checks

    def figures(self, name: str, indices: Sequence[int]) -> dict[str, float]:
        """Over the batches `indices`: tokens per second and the speedups, medians over repeats."""
        tokens = sum(self.tokens[index] for index in indices)

        def total(of: str) -> list[float]:
            return [sum(seconds[index] for index in indices) for seconds in self.seconds[of]]

        mine, plain = total(name), total(BASELINE)
        figures = {
            "tokens_per_second": statistics.median(tokens / seconds for seconds in mine),
            "speedup": statistics.median(theirs / ours for theirs, ours in zip(plain, mine)),
        }
        if PLAIN_OUR_KERNELS in self.seconds:
            figures["equal_kernels"] = statistics.median(
                theirs / ours for theirs, ours in zip(total(PLAIN_OUR_KERNELS), mine)
            )
        if f"{name}@1" in self.seconds:
            figures["vs_batch_one"] = statistics.median(
                alone / ours for alone, ours in zip(total(f"{name}@1"), mine)
            )
        return figures

    def document(self) -> dict[str, Any]:
        categories: dict[str, list[int]] = {}
        for index, (category, _) in enumerate(self.batches):
            categories.setdefault(category, []).append(index)
        contenders = {}
        for contender in self.contenders:
            by_category = {category: self.figures(contender.name, indices) for category, indices in categories.items()}
            checks = self.checks[contender.name]
            contenders[contender.name] = {
                **self.figures(contender.name, range(len(self.batches))),
                "params_label": contender.params_label,
                "consistency": "identical" if all(c == "identical" for c in checks) else
                               "near-tie" if all(c != "divergent" for c in checks) else "divergent",
                "categories": by_category,
                "category_geomean": geometric_mean(figures["speedup"] for figures in by_category.values()),
            }
        return {"batches": len(self.batches), "tokens": sum(self.tokens), "contenders": contenders}


def measure_batches(
    model, tokenizer, prompts: Sequence[Prompt], contenders: Sequence[Contender], sizes: Sequence[int], *,
    max_new_tokens: int, repeats: int, progress: bool = True,
) -> dict[str, Any]:
    """Every batch size's figures, after one uncounted warm-up of each contender on the first
    batch of each size."""
    eos_ids = model.generation_config.eos_token_id
    eos = set(eos_ids if isinstance(eos_ids, (list, tuple)) else [] if eos_ids is None else [eos_ids])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {"max_new_tokens": max_new_tokens, "pad_token_id": pad}  # every contender says do_sample=False
    contenders = batch_contenders(contenders)
    sizes_figures = {}
    for size in sizes:
        batches = batches_of(prompts, size)
        runs = _Batches(model, tokenizer, contenders, batches, common, eos)
        first = encode_batch(tokenizer, batches[0][1])
        for contender in contenders:
            _decode(model, first, common, contender.generate_kwargs)
        steps = tqdm(total=repeats * len(batches), file=sys.stderr, disable=not progress, desc=f"batch size {size}")
        with steps:
            for repeat in range(repeats):
                for index in range(len(batches)):
                    runs.measure(repeat, index, size)
                    steps.update()
        sizes_figures[str(size)] = runs.document()
    return {"max_new_tokens": max_new_tokens, "repeats": repeats, "prompts": len(prompts), "sizes": sizes_figures}


def render_batches(results: dict[str, Any]) -> str:
    """The terminal table: per batch size, each contender's tokens per second over the batches,
    its speedup over plain batched `generate` (on its kernels and on ours, where measured) and
    over itself at batch one, and per category."""
    lines = []
    for size, figures in results["sizes"].items():
        lines += ["", f"batch size {size}: {figures['batches']} batches, {figures['tokens']} tokens", ""]
        lines.append(f"{'contender':<28} {'tok/s':>8} {'x plain batched':>16} {'x plain, our kernels':>21} "
                     f"{'x own at batch 1':>17}  consistent")
        for name, row in figures["contenders"].items():
            alone = f"{row['vs_batch_one']:.2f}x" if "vs_batch_one" in row else "-"
            equal = f"{row['equal_kernels']:.2f}x" if "equal_kernels" in row else "-"
            lines.append(f"{name:<28} {row['tokens_per_second']:>8.1f} {row['speedup']:>15.2f}x {equal:>21} "
                         f"{alone:>17}  {row['consistency']}")
        categories = sorted(next(iter(figures["contenders"].values()))["categories"])
        if len(categories) > 1:
            lines += ["", "x plain batched per category: " + ", ".join(categories) + ", geometric mean"]
            for name, row in figures["contenders"].items():
                cells = [f"{row['categories'][category]['speedup']:.2f}x" for category in categories]
                lines.append(f"{name:<28} " + " ".join(cells) + f" {row['category_geomean']:.2f}x")
    return "\n".join(lines)


def diverged_in_batches(results: dict[str, Any]) -> list[str]:
    return sorted({
        f"{name} at batch size {size}"
        for size, figures in results["sizes"].items()
        for name, row in figures["contenders"].items()
        if row["consistency"] == "divergent"
    })


def run_batches(model, tokenizer, prompts, contenders, args, command: dict) -> int:
    """`bench --batch-size`: measure, write `batches.json` into `--output`, print the table; the
    exit status is 1 where one of ours diverged from plain batched greedy decoding."""
    import json
    from pathlib import Path

    from .machine import machine_info

    results = measure_batches(model, tokenizer, prompts, contenders, args.batch_size,
                              max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    results.update(machine=machine_info(model), command=command)
    path = Path(args.output) / BATCHES_FILE
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(render_batches(results) + f"\n\nwrote {path}")
    inconsistent = diverged_in_batches(results)
    if inconsistent:
        print(f"hf-selfspec bench: {', '.join(inconsistent)} diverged from plain batched greedy decoding; "
              "that is a bug, please report it", file=sys.stderr)
    return 1 if inconsistent else 0
