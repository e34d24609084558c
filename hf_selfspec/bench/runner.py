"""Interleaved measurement: every contender on every prompt, in turn, repeat after repeat.

Running A B C A B C rather than A A A B B B B C C C spreads slow drift (thermal throttling, a
noisy neighbour, a background job) over all contenders alike, so it cancels in their ratios.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from tqdm import tqdm

from ..measure import TimedRun, timed_generate
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
) -> Measurements:
    """Decode each prompt plainly once for reference, then time each contender on each prompt
    `repeats` times, after one uncounted warm-up run per contender on the first prompt (lazy
    initialisation, allocator growth and, on GPUs, kernel selection would otherwise land on
    whichever contender happens to run first).

    With `sampling`, every contender samples with its settings, each timed call of repeat `r`
    starting from seed `sampling.seed + r`, and no reference is decoded."""
    names = [contender.name for contender in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contender names must be unique, got {names}")
    if BASELINE not in names:
        raise ValueError(f"the contenders must include the {BASELINE!r} one that others are compared with")
    if repeats < 1 or not prompts:
        raise ValueError(f"need at least one prompt and one repeat, got {len(prompts)} prompts, {repeats} repeats")
    if sampling is not None:
        contenders = [
            replace(contender, generate_kwargs={**contender.generate_kwargs, **sampling.generate_kwargs()})
            for contender in contenders
        ]
    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    common = {"max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    runs: dict[str, list[list[TimedRun]]] = {name: [[] for _ in range(repeats)] for name in names}
    reference_prompts = encoded if sampling is None else []

    def run(contender: Contender, inputs, repeat: int) -> TimedRun:
        if sampling is not None:
            sampling.reseed(repeat)
        return timed_generate(model, inputs, **common, **contender.generate_kwargs)

    total = len(reference_prompts) + len(contenders) * (1 + repeats * len(prompts))
    with tqdm(total=total, file=sys.stderr, disable=not progress, unit="run", desc="bench", dynamic_ncols=True) as bar:
        references = []
        for index, inputs in enumerate(reference_prompts):
            bar.set_postfix_str(f"reference {index + 1}/{len(encoded)}")
            references.append(
                timed_generate(model, inputs, **common, strategy=PLAIN, do_sample=False, output_logits=True)
            )
            bar.update()
        for contender in contenders:
            bar.set_postfix_str(f"warm-up {contender.name}")
            run(contender, encoded[0], 0)
            bar.update()
        for repeat in range(repeats):
            for index, inputs in enumerate(encoded):
                for contender in contenders:
                    bar.set_postfix_str(
                        f"repeat {repeat + 1}/{repeats} prompt {index + 1}/{len(encoded)} {contender.name}"
                    )
                    runs[contender.name][repeat].append(run(contender, inputs, repeat))
                    bar.update()
    return Measurements(
        prompts=list(prompts),
        contenders=list(contenders),
        runs=runs,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        references=references,
        logit_dtype=model.dtype,
        sampling=sampling,
    )
