"""Crash safety: SIGKILL a real `tune` process mid-trial, then resume the study; join a study
whose creator has not yet enqueued its warm starts, or died before it did."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import optuna
from optuna.trial import TrialState
from helpers import REPO_ROOT
from helpers.tuning import cli_command, cli_env, run_cli, write_study_config

from hf_selfspec.tuning import tune
from hf_selfspec.tuning.studies.config import StudyConfig
from hf_selfspec.tuning.studies.space import warm_start_trials
from hf_selfspec.tuning.studies.storage import StudyContext

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


NUM_LAYERS = 4


def _context() -> StudyContext:
    return StudyContext(
        model="tiny", gguf_file=None, dtype="float32", device_key="cpu/float32", strategy="self_speculative",
        num_layers=NUM_LAYERS, prompt_source="humaneval", n_prompts=2, prompt_offset=0, max_new_tokens=8,
        baseline_tokens_per_second=0.0, versions={},
    )  # fmt: skip


def _enqueued(study: optuna.Study) -> list[dict]:
    return [trial.system_attrs["fixed_params"] for trial in study.get_trials()]


def test_a_worker_joining_while_the_creator_enqueues_adds_no_warm_start_of_its_own(tmp_path):
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'optuna.db'}")
    config, context = StudyConfig(), _context()
    warm_starts = warm_start_trials(config.search, NUM_LAYERS)
    creator = optuna.create_study(storage=storage, study_name="s", direction="maximize")

    def finish_creating():
        # The creator checked for duplicates before the joiner could have written any: were the
        # joiner to enqueue too, every warm start would run twice.
        time.sleep(0.5)
        context.save(creator)
        for params in warm_starts:
            creator.enqueue_trial(params)

    filling = threading.Thread(target=finish_creating)
    filling.start()
    joined = tune._open_study(storage, "s", config, context, NUM_LAYERS)
    filling.join()
    assert _enqueued(joined) == warm_starts


def test_a_study_its_creator_left_without_trials_gets_its_warm_starts_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "CREATOR_GRACE_S", 0.3)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'optuna.db'}")
    config = StudyConfig()
    optuna.create_study(storage=storage, study_name="s", direction="maximize")  # then killed
    resumed = tune._open_study(storage, "s", config, _context(), NUM_LAYERS)
    assert _enqueued(resumed) == warm_start_trials(config.search, NUM_LAYERS)
    assert StudyContext.load(resumed).num_layers == NUM_LAYERS
