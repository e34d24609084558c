"""Interleaved measurement: every contender on every prompt, in turn, repeat after repeat.

Running A B C A B C rather than A A A B B B B C C C spreads slow drift (thermal throttling, a
noisy neighbour, a background job) over all contenders alike, so it cancels in their ratios.

A run stopped part-way (Ctrl-C, or a job scheduler's SIGTERM that the command line turns into
the same interruption) can keep what it finished, as the bench asks: every prompt that each
contender has decoded in the first repeat, or every whole repeat after that. Minutes of timings
on a machine borrowed for a few are then not lost to the prompts that did not fit. A run given
the time it may take (a tuner's confirmation inside its budget) stops the same way, before a
prompt that the time left would not pay for.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from tqdm import tqdm

from ..measure import TimedRun, timed_generate
from ..narrow_linear import choose_layouts
from ..online_corpus import online_corpus
from ..prompts import Prompt, encode_prompt
from .contenders import BASELINE, PLAIN, Contender
from .sampling import Sampling


@dataclass
class Measurements:
    """Raw results: `runs[contender name][repeat][prompt index]`, warm-up excluded, and per prompt
    one untimed plain greedy decode with its logits, which every greedy contender is checked
    against (`hf_selfspec.consistency`). A sampled run (`sampling` set) has no references: there
    is no single right output to check against. Its contenders carry the sampling arguments."""

    prompts: list[Prompt]
    contenders: list[Contender]
    runs: dict[str, list[list[TimedRun]]]
    max_new_tokens: int
    repeats: int
    references: list[TimedRun]
    logit_dtype: torch.dtype
    sampling: Sampling | None = None
    # (prompts, repeats) the run was asked for, when an interruption or its time stopped it short
    planned: tuple[int, int] | None = None


def _checked_contenders(
    prompts: Sequence[Prompt], contenders: Sequence[Contender], repeats: int, sampling: Sampling | None
) -> list[Contender]:
    """`contenders`, each with `sampling`'s settings where given, once the run is known to make
    sense: names unique, the baseline among them, at least one prompt and one repeat."""
    names = [contender.name for contender in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contender names must be unique, got {names}")
    if BASELINE not in names:
        raise ValueError(f"the contenders must include the {BASELINE!r} one that others are compared with")
    if repeats < 1 or not prompts:
        raise ValueError(f"need at least one prompt and one repeat, got {len(prompts)} prompts, {repeats} repeats")
    if sampling is None:
        return list(contenders)
    return [
        replace(contender, generate_kwargs={**contender.generate_kwargs, **sampling.generate_kwargs()})
        for contender in contenders
    ]


def _timed_call(model, contender: Contender, inputs, common: dict, sampling: Sampling | None, repeat: int) -> TimedRun:
    """One timed decode by `contender`, seeded for `repeat` where it samples."""
    if sampling is not None:
        sampling.reseed(repeat)
    return timed_generate(model, inputs, **common, **contender.generate_kwargs)


def _empty_online_corpora(model, contenders: Sequence[Contender]) -> None:
    """Every contender's online corpus emptied: each stream, in each repeat, starts from nothing,
    as a service started afresh would, and the warm-up's call is forgotten."""
    for contender in contenders:
        key = contender.generate_kwargs.get("online_corpus")
        if isinstance(key, str):
            online_corpus(model, key).clear()


def _time_contenders(model, contenders, inputs, common, sampling, repeat, bar, where) -> list[TimedRun]:
    """Each contender's timed call on `inputs`, one after the other, the progress bar saying
    which runs and counting each as it ends."""
    runs = []
    for contender in contenders:
        bar.set_postfix_str(f"{where} {contender.name}")
        runs.append(_timed_call(model, contender, inputs, common, sampling, repeat))
        bar.update()
    return runs


def _kept(prompts, contenders, runs, references, repeats, finished_prompts, finished_repeats, **fields) -> Measurements:
    """What a run finished: every whole repeat, or, stopped in the first, every prompt that each
    contender decoded; `planned` says what was asked when that is less."""
    kept_prompts = len(prompts) if finished_repeats else finished_prompts
    kept_repeats = finished_repeats or 1
    return Measurements(
        prompts=list(prompts[:kept_prompts]),
        contenders=list(contenders),
        runs={name: [done[:kept_prompts] for done in per_repeat[:kept_repeats]] for name, per_repeat in runs.items()},
        repeats=kept_repeats,
        references=references[:kept_prompts],
        planned=None if (kept_prompts, kept_repeats) == (len(prompts), repeats) else (len(prompts), repeats),
        **fields,
    )


def measure(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    contenders: Sequence[Contender],
    *,
    max_new_tokens: int,
    repeats: int,
    sampling: Sampling | None = None,
    progress: bool = True,
    keep_when_interrupted: bool = False,
    time_left: Callable[[], float] | None = None,
) -> Measurements:
    """Time each contender on each prompt `repeats` times, after one uncounted warm-up run per
    contender on the first prompt (lazy initialisation, allocator growth and, on GPUs, kernel
    selection would otherwise land on whichever contender happens to run first). Our kernels
    (our strategies' verifications, and a contender run with `narrow_kernels`) choose one per
    band of widths the first time they meet it, which one warm-up prompt does not reach: those
    choices are all made first (`choose_layouts`). In the first repeat each prompt is first
    decoded plainly, untimed, for reference. A contender with an online corpus starts each stream
    (prompts of one `stream` in a row) with it empty, and the corpus learns as the stream goes on.

    Interrupted (KeyboardInterrupt) after at least one prompt, with `keep_when_interrupted`, it
    returns what was finished, with `planned` set; otherwise it re-raises, as a caller that acts
    on the figures (the tuner choosing a winner) needs.

    With `time_left` (the seconds left, on the caller's clock), no prompt after the first starts
    when less time is left than the prompt before it took: the run returns what was finished,
    with `planned` set.

    With `sampling`, every contender samples with its settings, each timed call of repeat `r`
    starting from seed `sampling.seed + r`, and no reference is decoded."""
    contenders = _checked_contenders(prompts, contenders, repeats, sampling)
    names = [contender.name for contender in contenders]
    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    common = {"max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    runs: dict[str, list[list[TimedRun]]] = {name: [[] for _ in range(repeats)] for name in names}

    total = (len(prompts) if sampling is None else 0) + len(contenders) * (1 + repeats * len(prompts))
    references: list[TimedRun] = []
    finished_prompts = finished_repeats = 0  # measured for every contender
    last_prompt, out_of_time = 0.0, False  # the seconds the prompt before took, by `time_left`'s clock
    bar = tqdm(total=total, file=sys.stderr, disable=not progress, unit="run", desc="bench", dynamic_ncols=True)
    try:
        with bar:
            if any(contender.takes_our_kernels for contender in contenders):
                bar.set_postfix_str("timing the verifier's kernels")
                choose_layouts(model)
            _time_contenders(model, contenders, encoded[0], common, sampling, 0, bar, "warm-up")
            for repeat in range(repeats):
                for index, inputs in enumerate(encoded):
                    left = time_left() if time_left else math.inf
                    out_of_time = finished_prompts > 0 and left < last_prompt
                    if out_of_time:
                        break
                    if index == 0 or prompts[index].stream != prompts[index - 1].stream:
                        _empty_online_corpora(model, contenders)
                    if repeat == 0 and sampling is None:
                        bar.set_postfix_str(f"reference {index + 1}/{len(encoded)}")
                        references.append(
                            timed_generate(model, inputs, **common, strategy=PLAIN, do_sample=False, output_logits=True)
                        )
                        bar.update()
                    where = f"repeat {repeat + 1}/{repeats} prompt {index + 1}/{len(encoded)}"
                    timed = _time_contenders(model, contenders, inputs, common, sampling, repeat, bar, where)
                    for contender, run in zip(contenders, timed):
                        runs[contender.name][repeat].append(run)
                    finished_prompts = index + 1
                    last_prompt = left - time_left() if time_left else 0.0
                if out_of_time:
                    break
                finished_repeats = repeat + 1
    except KeyboardInterrupt:
        if not keep_when_interrupted or not (finished_repeats or finished_prompts):
            raise
    return _kept(
        prompts, contenders, runs, references, repeats, finished_prompts, finished_repeats,
        max_new_tokens=max_new_tokens, logit_dtype=model.dtype, sampling=sampling,
    )
