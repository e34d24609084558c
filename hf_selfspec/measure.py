"""Timing on the model's device: one `generate` call, the unit that the bench and the tuner both
interleave, the forward passes the tuner's cost model is built from, and those inside a decode."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .stats import StrategyStats

T = TypeVar("T")


@dataclass
class TimedRun:
    new_tokens: list[int]
    seconds: float
    stats: StrategyStats | None
    # `[new tokens, vocab]` raw logits, kept only when asked for with `output_logits=True`: the
    # reference that reduced-precision consistency is judged against
    logits: torch.Tensor | None = None
    # Every row of a batch: its new tokens up to its end (its first EOS, included), and with
    # `output_logits=True` its `[steps, vocab]` logits. A run of one prompt is a batch of one, so
    # left out they are `new_tokens` and `logits`, and whoever reads rows reads any run alike.
    rows: list[list[int]] = field(default_factory=list)
    row_logits: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.rows:
            self.rows = [self.new_tokens]
        if not self.row_logits and self.logits is not None:
            self.row_logits = [self.logits]

    @property
    def tokens_per_second(self) -> float:
        return len(self.new_tokens) / self.seconds if self.seconds > 0 else 0.0


def timed(run: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """`run()`'s result and wall seconds. A GPU runs its queue behind Python's back, so the clock
    starts on an idle device and stops only once the work `run` queued has finished."""
    _synchronize(device)
    started = time.perf_counter()
    result = run()
    _synchronize(device)
    return result, time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, inputs: dict[str, torch.Tensor], **generate_kwargs: Any) -> TimedRun:
    """Run `model.generate` on one prompt, or on a left-padded batch of them, and time it end to
    end (prefill included). A batch's rows that stopped early are padded to its longest; each of
    `rows` ends where its own text did, so padding is never counted as generated."""
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    prompt_length = inputs["input_ids"].shape[1]
    output, seconds = timed(
        lambda: model.generate(**inputs, return_dict_in_generate=True, **generate_kwargs), model.device
    )
    logits = torch.stack(output.logits, dim=1) if output.logits is not None else None  # [rows, steps, vocab]
    new, eos = output.sequences[:, prompt_length:].tolist(), eos_ids(model, generate_kwargs)
    return TimedRun(
        new_tokens=new[0],
        seconds=seconds,
        stats=getattr(output, "strategy_stats", None),
        logits=logits[0] if logits is not None else None,
        rows=[until_end(row, eos) for row in new],
        row_logits=list(logits) if logits is not None else [],
    )


def eos_ids(model, generate_kwargs: dict[str, Any]) -> set[int]:
    """The tokens that end a text, as `generate` reads them: the call's, else the model's."""
    config = getattr(model, "generation_config", None)
    eos = generate_kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(token) for token in eos}


def until_end(tokens: list[int], eos: set[int]) -> list[int]:
    """`tokens` up to their first end token, included (all of them where none ends them)."""
    end = next((index + 1 for index, token in enumerate(tokens) if token in eos), len(tokens))
    return tokens[:end]


@contextmanager
def forward_timings(model) -> Iterator[list[tuple[int, float]]]:
    """While inside: `(input width, seconds)` of every forward pass of `model` itself, timed where
    it ran. A decode's time minus its forward passes' is what the loop around them spends, read
    under the load they all ran under, which no forward pass timed at another moment can give."""
    timings: list[tuple[int, float]] = []
    started: list[float] = []

    def before(module, args, kwargs) -> None:
        _synchronize(model.device)
        started.append(time.perf_counter())

    def after(module, args, kwargs, output) -> None:
        _synchronize(model.device)
        inputs = kwargs.get("input_ids", args[0] if args else None)
        inputs = kwargs["inputs_embeds"] if inputs is None else inputs
        timings.append((inputs.shape[1], time.perf_counter() - started.pop()))

    handles = (
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    )
    try:
        yield timings
    finally:
        for handle in handles:
            handle.remove()
