"""Timing one `generate` call, the unit that the bench and the tuner both interleave."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .stats import StrategyStats


@dataclass
class TimedRun:
    new_tokens: list[int]
    seconds: float
    stats: StrategyStats | None
    # `[new tokens, vocab]` raw logits, kept only when asked for with `output_logits=True`: the
    # reference that reduced-precision consistency is judged against
    logits: torch.Tensor | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.new_tokens) / self.seconds if self.seconds > 0 else 0.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, inputs: dict[str, torch.Tensor], **generate_kwargs: Any) -> TimedRun:
    """Run `model.generate` on one prompt and time it end to end (prefill included)."""
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    prompt_length = inputs["input_ids"].shape[1]
    _synchronize(model.device)
    start = time.perf_counter()
    output = model.generate(**inputs, return_dict_in_generate=True, **generate_kwargs)
    _synchronize(model.device)
    seconds = time.perf_counter() - start
    return TimedRun(
        new_tokens=output.sequences[0, prompt_length:].tolist(),
        seconds=seconds,
        stats=getattr(output, "strategy_stats", None),
        logits=torch.cat(output.logits) if output.logits is not None else None,
    )
