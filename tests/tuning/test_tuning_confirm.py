"""Confirming an estimated study's best trials by real decoding: the trials decoded side by side
beside one plain decode of each prompt (scripted timings, no model), and the measured study
written only with whole measurements, so a killed confirmation is simply run again."""

from __future__ import annotations

from types import SimpleNamespace

import optuna
import pytest
import torch
from optuna.trial import TrialState
from helpers.tuning import ScriptedConfirmation, make_tuned_looking_study

from hf_selfspec.measure import TimedRun
from hf_selfspec.stats import StrategyStats
from hf_selfspec.tuning.studies.categories import rotation_offsets
from hf_selfspec.tuning.studies.config import SearchConfig, StudyConfig, StudySettings
from hf_selfspec.tuning.studies.objective import LosslessViolation, PreparedPrompt, SpeedupObjective
from hf_selfspec.tuning.studies.space import warm_start_trials
from hf_selfspec.tuning.studies.storage import StudyContext
from hf_selfspec.tuning.tune import confirm_estimates

NUM_LAYERS = 4
TOKENS = [1, 2, 3]


def test_every_category_puts_each_contender_in_every_place():
    categories = ["a", "b", "c"] * 3
    offsets = rotation_offsets(categories, 3)
    for category in "abc":
        assert sorted(o for name, o in zip(categories, offsets) if name == category) == [0, 1, 2], category
    assert rotation_offsets(["code"] * 4, 3) == [0, 1, 2, 0]


def _prompt(prompt_id: str, category: str) -> PreparedPrompt:
    logits = torch.nn.functional.one_hot(torch.tensor(TOKENS), 10).float()
    return PreparedPrompt(prompt_id, {"input_ids": torch.tensor([[5, 6]]), "prompt_id": prompt_id}, TOKENS, logits,
                          category)  # fmt: skip


def _trials() -> list[optuna.trial.FixedTrial]:
    """Two fixed trials told apart by their draft length: 8 (the warm start) and 4."""
    first = warm_start_trials(SearchConfig(), NUM_LAYERS)[0]
    return [optuna.trial.FixedTrial(first), optuna.trial.FixedTrial({**first, "max_draft_tokens": 4})]


def test_trials_measured_side_by_side_share_one_plain_decode_of_each_prompt(monkeypatch):
    """Plain takes 2 s a prompt; the 8-token trial 1 s, the 4-token trial 4 s except on b1. The
    4-token trial leaves plain's tokens on b1, so it is decoded no further and comes back as the
    violation, while the other is still measured on every prompt."""
    calls: list[tuple[str, str]] = []

    def scripted(model, inputs, strategy=None, **kwargs):
        who = "plain" if strategy == "plain" else f"draft{kwargs['max_draft_tokens']}"
        calls.append((inputs["prompt_id"], who))
        if who == "plain":
            return TimedRun(TOKENS, 2.0, None)
        if who == "draft4":
            tokens = [1, 9, 3] if inputs["prompt_id"] == "b1" else TOKENS
            return TimedRun(tokens, 4.0, StrategyStats(drafted_tokens=4, accepted_tokens=1))
        return TimedRun(TOKENS, 1.0, StrategyStats(drafted_tokens=4, accepted_tokens=3))

    monkeypatch.setattr("hf_selfspec.tuning.studies.objective.timed_generate", scripted)
    prompts = [_prompt("a1", "A"), _prompt("b1", "B"), _prompt("a2", "A"), _prompt("b2", "B")]
    objective = SpeedupObjective(SimpleNamespace(dtype=torch.float32), prompts, SearchConfig(), NUM_LAYERS, {}, "t")
    trials = _trials()
    seen: list[int] = []
    outcomes = objective.measure_side_by_side(trials, lambda: seen.append(len(calls)))

    assert seen == [3, 6, 8, 10]  # called after each prompt; two decodes a prompt once one trial is out
    by_prompt = {prompt.id: [who for prompt_id, who in calls if prompt_id == prompt.id] for prompt in prompts}
    assert by_prompt["a1"] == ["plain", "draft8", "draft4"]  # one plain decode a prompt, the order rotated
    assert by_prompt["b1"] == ["draft8", "draft4", "plain"]
    assert by_prompt["a2"] == ["draft8", "plain"]  # the 4-token trial is out
    assert by_prompt["b2"] == ["plain", "draft8"]
    assert outcomes[0] == pytest.approx(2.0)
    assert trials[0].user_attrs["category_speedups"] == pytest.approx({"A": 2.0, "B": 2.0})
    assert trials[0].user_attrs["acceptance_rate"] == pytest.approx(0.75)
    assert isinstance(outcomes[1], LosslessViolation) and "prompt b1 at new token 1" in str(outcomes[1])
    assert trials[1].user_attrs["lossless_violation"]["prompt"] == "b1"


def test_each_round_decodes_every_contender_again_in_the_next_order_and_pools_the_seconds(monkeypatch):
    """Two rounds: a1's first plain decode is slowed to 6 s by a burst, every other plain decode
    takes 2 s and every draft8 decode 1 s, so A's speedup is (6 + 2) / (1 + 1), the burst weighed
    against a second decode, and B's 2. draft4 matches plain on its first decode of a1 and leaves
    it on its second: every decode is checked, and it is decoded no further."""
    calls: list[tuple[str, str]] = []

    def scripted(model, inputs, strategy=None, **kwargs):
        who = "plain" if strategy == "plain" else f"draft{kwargs['max_draft_tokens']}"
        calls.append((inputs["prompt_id"], who))
        if who == "plain":
            return TimedRun(TOKENS, 6.0 if calls == [("a1", "plain")] else 2.0, None)
        if who == "draft4":
            second = calls.count(("a1", "draft4")) == 2
            return TimedRun([1, 9, 3] if second else TOKENS, 1.0, StrategyStats(drafted_tokens=4, accepted_tokens=1))
        return TimedRun(TOKENS, 1.0, StrategyStats(drafted_tokens=4, accepted_tokens=3))

    monkeypatch.setattr("hf_selfspec.tuning.studies.objective.timed_generate", scripted)
    prompts = [_prompt("a1", "A"), _prompt("b1", "B")]
    objective = SpeedupObjective(SimpleNamespace(dtype=torch.float32), prompts, SearchConfig(), NUM_LAYERS, {}, "t")
    trials = _trials()
    seen: list[int] = []
    outcomes = objective.measure_side_by_side(trials, lambda: seen.append(len(calls)), rounds=2)

    assert seen == [6, 10]  # after each prompt, every round of it done
    assert [who for prompt_id, who in calls if prompt_id == "a1"] == [
        "plain", "draft8", "draft4", "draft8", "draft4", "plain"
    ]  # the second round rotated one place on
    assert [who for prompt_id, who in calls if prompt_id == "b1"] == ["draft8", "plain", "plain", "draft8"]
    assert outcomes[0] == pytest.approx((4.0 * 2.0) ** 0.5)
    assert trials[0].user_attrs["category_speedups"] == pytest.approx({"A": 4.0, "B": 2.0})
    assert trials[0].user_attrs["category_prompts"] == {"A": 1, "B": 1}  # prompts, not decodes
    assert trials[0].user_attrs["acceptance_rate"] == pytest.approx(0.75)
    assert isinstance(outcomes[1], LosslessViolation) and "prompt a1 at new token 1" in str(outcomes[1])


def _context(model_dir) -> StudyContext:
    return StudyContext(
        model=str(model_dir), gguf_file=None, dtype="float32", device_key="cpu/float32",
        strategy="self_speculative", num_layers=NUM_LAYERS, prompt_source="humaneval", n_prompts=2,
        prompt_offset=0, max_new_tokens=8, baseline_tokens_per_second=100.0, versions={},
    )  # fmt: skip


def test_a_killed_confirmation_leaves_nothing_and_the_next_run_measures_only_what_is_missing(
    tmp_path, tiny_llama_dir
):
    storage_url = f"sqlite:///{tmp_path / 'optuna.db'}"
    estimated = make_tuned_looking_study(storage_url, "s:estimated", tiny_llama_dir, speedups=(1.1, 1.5, 1.3))
    storage = optuna.storages.RDBStorage(storage_url)
    context, top_two = _context(tiny_llama_dir), StudyConfig(study=StudySettings(confirm_top=2))

    with pytest.raises(KeyboardInterrupt):
        killed = ScriptedConfirmation(NUM_LAYERS, killed=True)
        confirm_estimates(storage, "s", estimated, context, top_two, killed, False)
    assert optuna.load_study(study_name="s", storage=storage).trials == []  # nothing half-written

    measuring = ScriptedConfirmation(NUM_LAYERS)
    confirmed = confirm_estimates(storage, "s", estimated, context, top_two, measuring, False)
    assert [trial.user_attrs["estimated_trial"] for trial in confirmed.trials] == [1, 2]
    assert [trial.state for trial in confirmed.trials] == [TrialState.COMPLETE] * 2
    assert [trial.value for trial in confirmed.trials] == [1.2, 1.2]
    assert confirmed.trials[0].params == estimated.trials[1].params
    assert confirmed.trials[0].user_attrs["estimated_speedup"] == 1.5

    again = ScriptedConfirmation(NUM_LAYERS, killed=True)  # would raise if asked to measure anything
    confirm_estimates(storage, "s", estimated, context, top_two, again, False)
    top_three = StudyConfig(study=StudySettings(confirm_top=3))
    third = ScriptedConfirmation(NUM_LAYERS)
    assert len(confirm_estimates(storage, "s", estimated, context, top_three, third, False).trials) == 3
    assert len(third.measured) == 1  # only the estimate not confirmed before



def test_the_confirmed_trials_are_chosen_and_shown_at_the_prices_of_the_confirmation(tmp_path, tiny_llama_dir):
    """Trials 1 and 2 were priced at 1.5 and 1.3 when they ran, by a cost model that has since
    been re-timed; at today's prices they come to 1.0 and 1.25. The two best of the study are
    priced again and the better of them now, trial 2, is the one confirmed, with its estimate
    now beside the measurement and the study's kept for reference. Trial 0 is not even priced."""
    storage_url = f"sqlite:///{tmp_path / 'optuna.db'}"
    estimated = make_tuned_looking_study(storage_url, "s:estimated", tiny_llama_dir, speedups=(1.1, 1.5, 1.3))
    storage = optuna.storages.RDBStorage(storage_url)
    today = {1: 1.0, 2: 1.25}
    priced = []

    def reprice(trial):
        priced.append(trial.number)
        return today[trial.number]

    top_one = StudyConfig(study=StudySettings(confirm_top=1))
    confirmed = confirm_estimates(
        storage, "s", estimated, _context(tiny_llama_dir), top_one, ScriptedConfirmation(NUM_LAYERS), False, reprice
    )
    assert sorted(priced) == [1, 2]
    [trial] = confirmed.trials
    assert trial.user_attrs["estimated_trial"] == 2 and trial.params == estimated.trials[2].params
    assert trial.user_attrs["estimated_speedup"] == 1.25
    assert trial.user_attrs["estimated_speedup_in_study"] == 1.3
