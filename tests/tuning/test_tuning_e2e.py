"""Tune the tiny model for real, export the best trial, load it back and generate with it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import optuna
import pytest
import torch
from optuna.trial import TrialState
from helpers.tuning import write_study_config

from hf_selfspec.loading import load_model_and_tokenizer
from hf_selfspec.profiles import PROFILE_KEY, read_profiles_file
from hf_selfspec.prompts import encode_prompt, load_prompts
from hf_selfspec.tuning.studies.config import SearchConfig, load_study_config
from hf_selfspec.tuning.studies.dashboard import study_note
from hf_selfspec.tuning.studies.export import export_profile
from hf_selfspec.tuning.studies.objective import LosslessViolation, PreparedPrompt, SpeedupObjective
from hf_selfspec.tuning.tune import format_summary, run_tune

N_TRIALS = 4
N_PROMPTS = 2



@pytest.fixture(scope="module")
def tuned(tiny_llama_dir, tmp_path_factory, one_thread):
    directory = tmp_path_factory.mktemp("tune")
    storage = f"sqlite:///{directory / 'optuna.db'}"
    config_path = write_study_config(
        directory / "study.toml",
        tiny_llama_dir,
        storage,
        strategy="adaptive_draft_exit",
        n_prompts=N_PROMPTS,
        max_new_tokens=12,
    )
    outcome = run_tune(load_study_config(config_path), n_trials=N_TRIALS, show_progress=False)
    return SimpleNamespace(outcome=outcome, storage=storage, model_dir=tiny_llama_dir, directory=directory)


def test_tune_records_every_trial_with_its_measurements(tuned):
    study = tuned.outcome.study
    assert study.study_name == f"{tuned.model_dir.name}:adaptive_draft_exit:cpu/float32:humaneval-{N_PROMPTS}x12"
    trials = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
    assert len(trials) == N_TRIALS
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert complete, "no trial completed"
    for trial in complete:
        for key in (
            "acceptance_rate",
            "mean_accepted_length",
            "tokens_per_second",
            "baseline_tokens_per_second",
            "speedup",
            "skip_ratio",
            "worker",
        ):
            assert key in trial.user_attrs, key
        assert trial.value == pytest.approx(trial.user_attrs["speedup"])
        assert sorted(trial.intermediate_values) == list(range(N_PROMPTS))  # reported after each prompt
    # The first trial is the warm start with the documented default skip set.
    assert trials[0].user_attrs["attn_skip_layers"] == [2]
    summary = format_summary(tuned.outcome)
    assert "best speedup" in summary and "acceptance rate" in summary and "skip ratio" in summary
    assert f"{'ran':<12}{N_TRIALS:>10}{N_TRIALS:>10}" in summary


def test_study_note_describes_the_measurement_and_best_trial(tuned):
    from optuna_dashboard import get_note

    note = get_note(tuned.outcome.study)
    assert note == study_note(tuned.outcome.study)
    best = tuned.outcome.best
    assert "cpu/float32" in note and "humaneval" in note and "tokens/s" in note
    assert f"**Best so far.** Trial {best.number} decodes {best.value:.2f}x" in note


def test_exported_profile_is_picked_up_and_lossless(tuned, tmp_path):
    result = export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path)
    best = tuned.outcome.best
    assert result.key == "cpu/float32"
    assert result.profile.measured["trial"] == best.number
    assert result.profile.measured["speedup"] == pytest.approx(best.value)
    assert set(result.profile.measured["versions"]) >= {"transformers", "torch", "optuna"}
    assert list(read_profiles_file(result.path)) == ["cpu/float32"]

    model, tokenizer = load_model_and_tokenizer(str(tuned.model_dir), generation_config=result.path)
    inputs = encode_prompt(tokenizer, load_prompts("humaneval", 1, offset=5)[0])
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
    tuned_output = model.generate(**inputs, **kwargs)
    plain_output = model.generate(**inputs, strategy="plain", **kwargs)
    assert tuned_output.strategy_stats is not None, "the exported profile was not applied"
    assert tuned_output.strategy_stats.strategy == "adaptive_draft_exit"
    assert torch.equal(tuned_output.sequences, plain_output.sequences)


def test_export_into_a_model_directory_keeps_other_devices_and_files(tuned, tmp_path):
    other_key = "cuda/NVIDIA H100 80GB HBM3/bfloat16"
    other = {"strategy": "self_speculative", "params": {"attn_skip_layers": [1]}, "measured": {"speedup": 1.9}}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.7, "_from_model_config": True, PROFILE_KEY: {other_key: other}})
    )
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written[PROFILE_KEY][other_key] == other
    assert set(written[PROFILE_KEY]) == {other_key, "cpu/float32"}
    assert written["temperature"] == 0.7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generation_config.json", "model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"
    assert set(read_profiles_file(tmp_path / "generation_config.json")) == {other_key, "cpu/float32"}


def test_optuna_cli_reads_our_storage(tuned):
    listing = subprocess.run(
        # The `optuna` console script's own entry point, run by this interpreter.
        [
            sys.executable,
            "-c",
            "import sys; from optuna.cli import main; sys.exit(main())",
            "studies",
            "--storage",
            tuned.storage,
            "-f",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr
    assert tuned.outcome.study.study_name in {row["name"] for row in json.loads(listing.stdout)}


class _WrongTokensModel:
    """Plain decoding appends 1, 2, 3...; any strategy gets one token wrong at position 2."""

    device = torch.device("cpu")
    dtype = torch.float32

    def generate(self, input_ids, attention_mask=None, strategy=None, max_new_tokens=4, **_kwargs):
        new = list(range(1, max_new_tokens + 1))
        if strategy != "plain":
            new[2] = 99
        return SimpleNamespace(
            sequences=torch.cat([input_ids, torch.tensor([new])], dim=1), strategy_stats=None, logits=None
        )


def test_lossless_violation_fails_the_trial_loudly_and_the_study_goes_on(caplog):
    model = _WrongTokensModel()
    plain_logits = torch.nn.functional.one_hot(torch.tensor([1, 2, 3, 4]), 100).float()
    prompt = PreparedPrompt("HumanEval/7", {"input_ids": torch.tensor([[5, 6]])}, reference_tokens=[1, 2, 3, 4],
                            reference_logits=plain_logits)
    objective = SpeedupObjective(
        model, [prompt], SearchConfig(), num_layers=4, generate_kwargs={"max_new_tokens": 4}, worker="test"
    )
    study = optuna.create_study(direction="maximize")
    with caplog.at_level(logging.ERROR, logger="hf_selfspec.tuning"):
        study.optimize(objective, n_trials=3, catch=(LosslessViolation,))
    states = [t.state for t in study.trials]
    assert states.count(TrialState.FAIL) + states.count(TrialState.PRUNED) == 3
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert failed, "every trial was pruned as invalid; the violation was never exercised"
    assert failed[0].user_attrs["lossless_violation"] == {
        "prompt": "HumanEval/7",
        "position": 2,
        "expected": 3,
        "actual": 99,
    }
    assert "LOSSLESS VIOLATION" in caplog.text and "HumanEval/7" in caplog.text and "new token 2" in caplog.text
