"""An `optimize` run's state: what it was asked, each finished stage's record, and the time spent
across runs, in `OUTPUT/work/optimize.json`.

The budget is wall time across runs, kills included: while a stage runs, the seconds it has
taken are written every `_LEDGER_SECONDS`, so a run killed mid-stage (SIGKILL runs no handler)
leaves them behind, and the next run counts them as spent instead of granting that stage's
time again.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import TuningError, progress
from .budget import SHARES
from .studies.study_toml import model_entries
from .studies.toml_reader import ModelConfig

STATE_FILE = "optimize.json"
WORK_DIR = "work"
_LEDGER_SECONDS = 15.0


@dataclass(frozen=True)
class OptimizeRequest:
    model: ModelConfig
    output: Path
    budget_seconds: float
    prompts: str | None = None  # a JSONL file to tune on instead of the workload
    storage: str | None = None
    show_progress: bool = True

    @property
    def work(self) -> Path:
        return self.output / WORK_DIR


@dataclass
class Run:
    """The state file's contents, and the clock of this run."""

    request: OptimizeRequest
    state: dict[str, Any]
    started: float = field(default_factory=lambda: progress.clock())
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def stages(self) -> dict[str, Any]:
        return self.state["stages"]

    def remaining(self) -> float:
        return self.request.budget_seconds - self.state["spent_seconds"] - (progress.clock() - self.started)

    def share(self, stage: str) -> float:
        return min(SHARES[stage] * self.request.budget_seconds, max(self.remaining(), 0.0))

    def finish(self, stage: str, result: dict[str, Any]) -> None:
        with self.lock:
            now = progress.clock()
            self.state["spent_seconds"] += now - self.started
            self.state.pop("unfinished_seconds", None)
            self.started = now
            self.stages[stage] = result
            _write_json(self.request.work / STATE_FILE, self.state)

    def record_time(self) -> None:
        """Write the seconds spent in the stage that runs now, which a kill would otherwise lose."""
        with self.lock:
            self.state["unfinished_seconds"] = progress.clock() - self.started
            _write_json(self.request.work / STATE_FILE, self.state)

    @contextmanager
    def keeping_time(self) -> Iterator[None]:
        """Inside: the stage's seconds written every `_LEDGER_SECONDS`, by a thread of its own."""
        stop = threading.Event()

        def keep() -> None:
            while not stop.wait(_LEDGER_SECONDS):
                self.record_time()

        thread = threading.Thread(target=keep, name="hf-selfspec-optimize-ledger", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    temporary.replace(path)  # a kill never leaves half a state file


def load_state(request: OptimizeRequest) -> dict[str, Any]:
    """The state of an earlier run into `request.output`, the seconds its cut stage spent counted
    as spent; or a fresh one."""
    path = request.work / STATE_FILE
    recipe = {**model_entries(request.model), "prompts": request.prompts}
    if not path.is_file():
        request.work.mkdir(parents=True, exist_ok=True)
        return {"recipe": recipe, "spent_seconds": 0.0, "stages": {}}
    state = json.loads(path.read_text(encoding="utf-8"))
    if state["recipe"] != recipe:
        raise TuningError(
            f"--output {request.output} holds an optimize run of another model or prompts ({state['recipe']}); "
            "give another --output, or delete it to start over"
        )
    state["spent_seconds"] += state.pop("unfinished_seconds", 0.0)
    return state
