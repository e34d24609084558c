"""Progress lines that never fall silent: while the tuner works, a line at least every `INTERVAL`
seconds says what it is doing, how far it got and, where the work is counted or planned, how
long is left.

A bar (tqdm) moves only when a unit of its work ends, and on a model of a billion parameters
one unit (a batch of sampled requests, a round of the cost model's timing) can take minutes;
where stderr is not a terminal it draws nothing at all. So work runs inside `task`s, and a
background thread prints the innermost task's state whenever no line has been printed for
`INTERVAL` seconds; `advance` counts the task's units as they end.

Every stage reads time from `clock`, one source for the progress lines and for the budget, which
a test may replace with a simulated one (and drive the lines with `beat`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")

# A line is due once this long has passed without one; the thread looks a few times as often,
# so no gap reaches the 30 seconds the commands promise.
INTERVAL = 20.0
_LOOK_EVERY = INTERVAL / 4
_INDENT = "     "

clock = time.monotonic


@dataclass
class _Task:
    label: str
    total: int | None
    unit: str
    planned_seconds: float | None
    started: float = field(default_factory=lambda: clock())
    done: int = 0

    def line(self, now: float) -> str:
        elapsed = now - self.started
        parts = [f"{_INDENT}{self.label}:"]
        if self.total:
            parts.append(f"{self.done}/{self.total} {self.unit},")
        parts.append(f"{minutes(elapsed)} so far")
        left = self.seconds_left(elapsed)
        if left is not None:
            parts[-1] += ","
            parts.append(f"about {minutes(left)} left")
        return " ".join(parts)

    def seconds_left(self, elapsed: float) -> float | None:
        """From the units done so far where some are, else from the plan; None where neither says."""
        if self.total and self.done:
            return elapsed / self.done * max(self.total - self.done, 0)
        if self.planned_seconds is not None:
            return max(self.planned_seconds - elapsed, 0.0)
        return None


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


_tasks: list[_Task] = []
_lock = threading.Lock()
_last_line = [0.0]
_thread: list[threading.Thread] = []


def _print(line: str) -> None:
    """`line` on standard output, around any bar drawn on a terminal rather than through it."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def say(line: str) -> None:
    """Print `line` now; it counts as the latest line, so the next beat waits a whole interval."""
    with _lock:
        _print(line)
        _last_line[0] = clock()


def beat() -> None:
    """Print the innermost task's state if no line was printed for `INTERVAL` seconds."""
    with _lock:
        now = clock()
        if _tasks and now - _last_line[0] >= INTERVAL:
            _print(_tasks[-1].line(now))
            _last_line[0] = now


def advance(units: int = 1) -> None:
    """Count `units` more of the innermost task's work as done."""
    if _tasks:
        _tasks[-1].done += units
    beat()


@contextmanager
def task(label: str, total: int | None = None, unit: str = "", planned_seconds: float | None = None) -> Iterator[None]:
    """Work that `beat` reports while it runs: counted in `total` `unit`s (`advance`), or planned
    to take `planned_seconds`, or neither (then the lines say only how long it has run)."""
    entry = _Task(label, total, unit, planned_seconds)
    with _lock:
        if not _tasks:
            _last_line[0] = entry.started
            _start_thread()
        _tasks.append(entry)
    try:
        yield
    finally:
        with _lock:
            _tasks.remove(entry)


def counting(items: Sequence[T], label: str, unit: str) -> Iterator[T]:
    """`items` one by one, inside a task that counts them as each is done with."""
    with task(label, total=len(items), unit=unit):
        for item in items:
            yield item
            advance()


def counted(timer: Callable[[Callable[[], Any]], float]) -> Callable[[Callable[[], Any]], float]:
    """`timer`, counting each run it times in the innermost task."""

    def timing(run: Callable[[], Any]) -> float:
        seconds = timer(run)
        advance()
        return seconds

    return timing


def _start_thread() -> None:
    """The thread that beats (a beat without a task prints nothing), started with the first task
    and kept for the life of the process."""
    if _thread:
        return

    def run() -> None:
        while True:
            time.sleep(_LOOK_EVERY)
            beat()

    _thread.append(threading.Thread(target=run, name="hf-selfspec-progress", daemon=True))
    _thread[0].start()
