"""`optimize` killed by SIGKILL in each of its stages (no handler runs, as in a power cut), then
run again: it keeps every stage recorded before the kill, finishes the rest, and counts the
seconds the cut stage had spent against the budget. (Killed while tuning: test_optimize.py.)"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from helpers import REPO_ROOT
from helpers.tuning import OPTIMIZE_BUDGET, cli_command, cli_env, sigkill_when

from hf_selfspec.tuning import progress
from hf_selfspec.tuning.optimize import STAGES
from hf_selfspec.tuning.optimize_state import STATE_FILE, WORK_DIR, OptimizeRequest, Run, load_state
from hf_selfspec.tuning.studies.toml_reader import ModelConfig


def _recorded(output) -> dict:
    path = output / WORK_DIR / STATE_FILE
    return json.loads(path.read_text())["stages"] if path.is_file() else {}  # replaced whole, never half-written


@pytest.mark.parametrize("stage", ["measure", "corpus", "adapter", "confirm"])
def test_a_run_killed_in_a_stage_resumes_there(stage, tiny_llama_dir, tmp_path):
    output, env = tmp_path / "out", cli_env(HF_SELFSPEC_CACHE=str(tmp_path / "cache"))
    command = cli_command("optimize", "--model", tiny_llama_dir, "--output", output, "--budget", OPTIMIZE_BUDGET, "--no-progress")
    before = list(STAGES[: STAGES.index(stage)])

    def in_the_stage() -> bool:  # the stages before it recorded, it not yet
        return (output / WORK_DIR).is_dir() and list(_recorded(output)) == before

    assert sigkill_when(command, env, in_the_stage, timeout=300) == -signal.SIGKILL, "it ended before the kill"
    recorded = _recorded(output)
    assert list(recorded) == before

    resumed = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.count("done in an earlier run") == len(before)
    after = _recorded(output)
    assert list(after) == list(STAGES)
    assert {name: after[name] for name in recorded} == recorded
    assert (output / "generation_config.json").is_file()


def test_the_seconds_of_a_stage_cut_short_count_against_the_budget(tmp_path, monkeypatch):
    """What a killed run had spent in its unfinished stage, written while it ran, is spent for the next."""
    now = [100.0]
    monkeypatch.setattr(progress, "clock", lambda: now[0])
    request = OptimizeRequest(ModelConfig("a-model"), tmp_path, budget_seconds=600)
    run = Run(request, load_state(request))
    now[0] += 50
    run.finish("measure", {})
    now[0] += 70
    run.record_time()  # then the kill: the stage never finishes
    resumed = Run(request, load_state(request))
    assert resumed.state["spent_seconds"] == pytest.approx(120)
    assert resumed.remaining() == pytest.approx(480)
    now[0] += 30
    resumed.finish("corpus", {})
    assert load_state(request)["spent_seconds"] == pytest.approx(150)  # the cut seconds counted once
