"""Crash safety: SIGKILL a real `tune` process mid-trial, then resume the study."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import optuna
from optuna.trial import TrialState
from helpers import REPO_ROOT
from helpers.tuning import cli_command, cli_env, run_cli, write_study_config

KILL_WITHIN_SECONDS = 150


def _trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    names = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=names[0], storage=storage).get_trials() if names else []


def _mid_trial(trials: list[optuna.trial.FrozenTrial]) -> bool:
    """At least one trial done, and one running that has measured its first prompt of four."""
    complete = any(t.state == TrialState.COMPLETE for t in trials)
    return complete and any(t.state == TrialState.RUNNING and len(t.intermediate_values) == 1 for t in trials)


def test_killed_tune_loses_nothing_and_the_next_run_fails_its_stale_trial(tiny_llama_dir, tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    # Four prompts make a trial long enough to be caught between two of them; heartbeats every
    # second let the next run declare the killed trial dead two seconds after its last beat.
    config = write_study_config(
        tmp_path / "study.toml",
        tiny_llama_dir,
        storage,
        n_prompts=4,
        max_new_tokens=16,
        study='pruner = "none"\nn_trials = 1000\nheartbeat_interval = 1\ngrace_period = 2',
    )
    worker = subprocess.Popen(
        cli_command("tune", config, "--no-progress"),
        env=cli_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + KILL_WITHIN_SECONDS
        while not _mid_trial(_trials(storage)):
            assert worker.poll() is None, f"tune exited early: {worker.stderr.read()}"
            assert time.monotonic() < deadline, "no trial completed in time"
            time.sleep(0.05)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.stderr.close()

    before = _trials(storage)
    completed_before = {t.number: t.value for t in before if t.state == TrialState.COMPLETE}
    (stale,) = [t.number for t in before if t.state == TrialState.RUNNING]

    resumed = run_cli("tune", config, "--n-trials", "2", "--no-progress", env=cli_env())
    assert resumed.returncode == 0, resumed.stderr

    after = {t.number: t for t in _trials(storage)}
    assert after[stale].state == TrialState.FAIL
    assert "stopped sending heartbeats" in resumed.stderr
    for number, value in completed_before.items():
        assert after[number].state == TrialState.COMPLETE and after[number].value == value
    new = [t for n, t in after.items() if n > stale and t.state == TrialState.COMPLETE]
    assert len(new) == 2
    assert "this run" in resumed.stdout and "best speedup" in resumed.stdout
