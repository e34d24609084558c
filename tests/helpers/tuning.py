"""Shared by the tuner's tests: study configs for the tiny model, the CLI as a real subprocess,
and a study that looks tuned without running a model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import optuna

from hf_selfspec.tuning.studies.config import SearchConfig
from hf_selfspec.tuning.studies.space import skip_ratio, suggest_params, warm_start_trials
from hf_selfspec.tuning.studies.storage import StudyContext

from helpers import REPO_ROOT

# `optimize --budget` minutes for the tiny model: enough for every stage to do some work, and for
# the held-out confirmation to pay for a prompt after the study on a busy machine (fixed costs, a
# model load among them, are a large share of each stage on a model this small).
OPTIMIZE_BUDGET = "2"


def write_study_config(
    path: Path,
    model_dir: Path,
    storage: str,
    *,
    strategy: str = "self_speculative",
    n_prompts: int = 2,
    max_new_tokens: int = 8,
    study: str = "",
) -> Path:
    """A study config for the tiny model; `study` adds lines to its [study] table."""
    path.write_text(
        f"""
[model]
name = "{model_dir}"

[prompts]
n_prompts = {n_prompts}
max_new_tokens = {max_new_tokens}

[search]
strategy = "{strategy}"

[study]
storage = "{storage}"
seed = 0
{study}
""",
        encoding="utf-8",
    )
    return path


def cli_env(**overrides: str | None) -> dict[str, str]:
    """The environment for a CLI subprocess: offline, importing this checkout, one torch thread
    (tests may run two workers at once on two cores; oversubscribed threads crawl)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hf_selfspec.cli", *map(str, args)]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_command(*args), env=env or cli_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


def sigkill_when(command: list[str], env: dict[str, str], ready: Callable[[], bool], timeout: float = 120) -> int:
    """Start `command` and SIGKILL it as soon as `ready()` holds (as a power cut would, mid-work);
    its return code, which is -SIGKILL unless it ended first."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not ready() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    return process.wait()


def kill_once_written(command: list[str], env: dict[str, str], directory: Path, pattern: str) -> list[Path]:
    """`sigkill_when` a file matching `pattern` appears under `directory`; the files that had
    appeared, none if it ended first."""
    written: list[Path] = []

    def appeared() -> bool:
        written[:] = directory.glob(pattern)
        return bool(written)

    sigkill_when(command, env, appeared)
    return written


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def make_tuned_looking_study(
    storage_url: str,
    name: str,
    model_dir: Path,
    num_layers: int = 4,
    speedups=(0.8, 1.2, 1.1),
    attrs=(),
    constraints=(),
    **context,
) -> optuna.Study:
    """A study shaped like `tune` leaves one (context, user attrs, warm-start parameters), with
    made-up measurements: for tests of export and the dashboard that need no model run. `attrs`
    and `constraints` add, trial by trial, user attributes and Optuna constraints; `context`
    replaces fields of the study's context."""
    search = SearchConfig()
    study = optuna.create_study(storage=storage_url, study_name=name, direction="maximize")
    fields = dict(
        model=str(model_dir),
        gguf_file=None,
        dtype="float32",
        device_key="cpu/float32",
        strategy=search.strategy,
        num_layers=num_layers,
        prompt_source="humaneval",
        n_prompts=2,
        prompt_offset=0,
        max_new_tokens=8,
        baseline_tokens_per_second=100.0,
        versions={"optuna": optuna.__version__},
    )
    StudyContext(**{**fields, **context}).save(study)
    for number, (params, speedup) in enumerate(zip(warm_start_trials(search, num_layers), speedups, strict=False)):
        study.enqueue_trial(params)
        trial = study.ask()
        decoded = suggest_params(trial, search, num_layers)  # takes the enqueued values
        measured = {
            "speedup": speedup,
            "acceptance_rate": 0.5,
            "mean_accepted_length": 1.5,
            "tokens_per_second": 100.0 * speedup,
            "baseline_tokens_per_second": 100.0,
            "skip_ratio": skip_ratio(decoded, num_layers),
            "attn_skip_layers": decoded["attn_skip_layers"],
            "mlp_skip_layers": decoded["mlp_skip_layers"],
            **(attrs[number] if number < len(attrs) else {}),
        }
        for key, value in measured.items():
            trial.set_user_attr(key, value)
        for key, value in (constraints[number] if number < len(constraints) else {}).items():
            trial.set_constraint(key, value)
        study.tell(trial, speedup)
    return study


class ScriptedConfirmation:
    """Stands in for `SpeedupObjective` when confirming estimates: every trial takes its
    estimate's parameters and measures `speedup`, or, `killed`, the run is interrupted first."""

    batches = ()

    def __init__(self, num_layers: int, speedup: float = 1.2, killed: bool = False):
        self.num_layers, self.speedup, self.killed = num_layers, speedup, killed
        self.measured: list[dict] = []  # the parameters of each trial measured

    def measure_side_by_side(self, trials, on_prompt, rounds):
        if self.killed:
            raise KeyboardInterrupt
        for trial in trials:
            self.measured.append(suggest_params(trial, SearchConfig(), self.num_layers))
            figures = {"acceptance_rate": 0.5, "mean_accepted_length": 1.5, "skip_ratio": 0.1,
                       "tokens_per_second": 100.0 * self.speedup, "baseline_tokens_per_second": 100.0}  # fmt: skip
            for key, value in figures.items():
                trial.set_user_attr(key, value)
        return [self.speedup] * len(trials)
