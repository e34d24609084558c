"""Timing on a machine shared with others: runs timed in interleaved rounds, and read by a
typical value that a burst of load on one round does not move."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hf_selfspec.tuner_api import timed

# Times one call of its argument, in seconds: the device's wall clock, or a test's simulation.
Timer = Callable[[Callable[[], Any]], float]


def device_timer(device: torch.device) -> Timer:
    return lambda run: timed(run, device)[1]


def interleaved_timings(runs: Mapping[Any, Callable[[], Any]], rounds: int, timer: Timer) -> dict[Any, list[float]]:
    """The seconds of each run in every round, timed in rounds that take every run once in turn.

    Timed one after another, a run that happens to share the machine's busy minute carries all
    of it while the others carry none, and the ratios between them, which are all an estimate
    reads, come out bent. In rounds, a burst of load lands on one round of every run alike.
    """
    timings: dict[Any, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            timings[name].append(timer(run))
    return timings


def interleaved_medians(runs: Mapping[Any, Callable[[], Any]], rounds: int, timer: Timer) -> dict[Any, float]:
    """The median seconds of each run timed in rounds (`interleaved_timings`): the median drops
    the round a burst of load fell on."""
    return {name: statistics.median(seconds) for name, seconds in interleaved_timings(runs, rounds, timer).items()}


def typical_seconds(seconds: Sequence[float]) -> float:
    """The mean of the middle two thirds of `seconds`: what a run costs in a decode that repeats it.

    A decode pays the mean of its forward passes. Where a neighbour keeps a core busy, each pass
    lands either on free cores or behind the neighbour, two modes far apart; where they are near
    even, the median falls in one mode or the other from one calibration to the next, while the
    mean of the middle follows their mix. Dropping the outer sixths keeps out a burst of load that
    fell on one round in seven."""
    ordered = sorted(seconds)
    cut = round(len(ordered) / 6)
    return statistics.fmean(ordered[cut : len(ordered) - cut] or ordered)
