"""`hf-selfspec dashboard` serves optuna-dashboard on our storage, notes included."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

from helpers import REPO_ROOT
from helpers.tuning import cli_command, cli_env, free_port, make_tuned_looking_study

import optuna

from hf_selfspec.tuning.studies.dashboard import describe_trial, write_study_note

STARTUP_SECONDS = 90


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def _wait_for_studies(base: str, server: subprocess.Popen) -> list[dict]:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"dashboard exited with {server.returncode}: {server.stderr.read()}")
        try:
            return _get_json(f"{base}/api/studies")["study_summaries"]
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.25)
    raise AssertionError(f"dashboard did not answer within {STARTUP_SECONDS} s")


def test_dashboard_lists_the_study_with_its_trials_and_note(tiny_llama_dir, tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = make_tuned_looking_study(storage, "tiny:self_speculative:cpu/float32:humaneval-2x8", tiny_llama_dir)
    write_study_note(study)
    port = free_port()
    server = subprocess.Popen(
        cli_command("dashboard", "--storage", storage, "--port", str(port)),
        env=cli_env(),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        summaries = _wait_for_studies(f"http://127.0.0.1:{port}", server)
        (summary,) = [s for s in summaries if s["study_name"] == study.study_name]
        detail = _get_json(f"http://127.0.0.1:{port}/api/studies/{summary['study_id']}")
        assert len(detail["trials"]) == 3
        assert [t["user_attrs"] for t in detail["trials"]][1]  # user attrs reach the UI
        assert "Plain greedy | 100.0 tokens/s" in detail["note"]["body"]
        assert "Best so far.** Trial 1 decodes 1.20x" in detail["note"]["body"]
    finally:
        server.terminate()
        server.wait(timeout=30)


def _trial_with_lookup(**lookup: int) -> optuna.trial.FrozenTrial:
    attrs = {"draft_adapter": "general-exit1", "tokens_per_second": 30.0, "baseline_tokens_per_second": 25.0,
             "acceptance_rate": 0.3, "mean_accepted_length": 0.7}
    return optuna.trial.create_trial(
        value=1.2,
        params=lookup,
        distributions={name: optuna.distributions.IntDistribution(0, 32) for name in lookup},
        user_attrs=attrs,
    )


def test_a_trial_is_described_with_its_lookup_length_and_how_it_adapts():
    fixed = describe_trial(_trial_with_lookup(prompt_lookup_tokens=10, prompt_lookup_max_tokens=0))
    assert "looks up to 10 tokens from 2- to 3-token matches" in fixed
    assert "growing" not in fixed
    adaptive = describe_trial(
        _trial_with_lookup(prompt_lookup_tokens=6, prompt_lookup_max_tokens=15, prompt_lookup_min_tokens=3)
    )
    assert "looks up 6 tokens at first" in adaptive
    assert "growing to 15 while lookups are taken whole" in adaptive
    assert "no fewer than 3 when they are cut short" in adaptive
    # a floor above the starting length is that length, as the lookup applies it
    above = describe_trial(
        _trial_with_lookup(prompt_lookup_tokens=4, prompt_lookup_max_tokens=15, prompt_lookup_min_tokens=9)
    )
    assert "no fewer than 4 when" in above
