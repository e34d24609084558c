"""Tuning on several kinds of text: the study's prompt selection, a trial's value as the geometric
mean of its per-category speedups (scripted timings, no model), and the per-category floor."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import optuna
import pytest
import torch
from optuna.trial import TrialState
from helpers.tuning import ScriptedConfirmation, make_tuned_looking_study

from hf_selfspec.measure import TimedRun
from hf_selfspec.prompts import TUNE_SPLIT, WORKLOAD, WORKLOAD_CATEGORIES
from hf_selfspec.stats import StrategyStats, geometric_mean
from hf_selfspec.tuning.studies.categories import (
    CATEGORY_GEOMETRIC_MEAN,
    FLOOR_CONSTRAINT,
    POOLED,
    alternating_order,
)
from hf_selfspec.tuning.studies.config import PromptConfig, SearchConfig, StudyConfig, StudySettings
from hf_selfspec.tuning.costmodel.estimated import EstimatedSpeedupObjective
from hf_selfspec.tuning.costmodel.prices import CostModel
from hf_selfspec.tuning.studies.objective import PreparedPrompt, SpeedupObjective
from hf_selfspec.tuning.studies.space import warm_start_trials
from hf_selfspec.tuning.studies.storage import StudyContext, derive_study_name
from hf_selfspec.tuning.studies.study_prompts import select_study_prompts
from hf_selfspec.tuning.tune import TuneOutcome, confirm_estimates, format_summary

NUM_LAYERS = 4


def test_geometric_mean_by_hand():
    assert geometric_mean([2.0, 0.5]) == pytest.approx(1.0)
    assert geometric_mean([1.0, 2.0, 4.0]) == pytest.approx(2.0)
    assert geometric_mean([3.0]) == pytest.approx(3.0)
    assert geometric_mean([1.5, 0.0]) == 0.0
    assert geometric_mean([3.0, 12.0]) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="no values"):
        geometric_mean([])
    with pytest.raises(ValueError, match="finite number >= 0"):
        geometric_mean([2.0, -1.0])


def test_each_category_decodes_first_as_often_as_second():
    # One category: prompt by prompt, as before categories.
    assert alternating_order(["code"] * 4) == [False, True, False, True]
    # Round-robin over an even number of categories: by position alone, every prompt of a
    # category would take the same side.
    categories = ["a", "b", "c", "d"] * 2
    order = alternating_order(categories)
    for category in "abcd":
        sides = [first for name, first in zip(categories, order) if name == category]
        assert sorted(sides) == [False, True], category


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def three_kinds(tmp_path):
    """Three categories, tune and held-out prompts mixed, one category listed twice as long."""
    rows = []
    for category, count in (("chat", 3), ("math", 2), ("code", 2)):
        for index in range(count):
            rows.append({"id": f"{category}/{index}", "prompt": f"{category} {index}", "category": category,
                         "split": TUNE_SPLIT})
            rows.append({"id": f"{category}/held{index}", "prompt": "x", "category": category, "split": "held_out"})
    return _write_jsonl(tmp_path / "kinds.jsonl", rows)


def test_per_category_takes_the_first_of_each_category_round_robin(three_kinds):
    selected = select_study_prompts(PromptConfig(source=three_kinds, split=TUNE_SPLIT, per_category=2))
    assert [p.id for p in selected] == ["chat/0", "math/0", "code/0", "chat/1", "math/1", "code/1"]
    # n_prompts keeps the first of that order.
    capped = select_study_prompts(PromptConfig(source=three_kinds, split=TUNE_SPLIT, per_category=2, n_prompts=4))
    assert [p.id for p in capped] == ["chat/0", "math/0", "code/0", "chat/1"]


def test_without_per_category_a_prompt_file_is_the_slice_it_always_was(three_kinds):
    sliced = select_study_prompts(PromptConfig(source=three_kinds, split=TUNE_SPLIT, offset=1, n_prompts=3))
    assert [p.id for p in sliced] == ["chat/1", "chat/2", "math/0"]


def test_per_category_asking_for_more_than_a_category_has_names_it(three_kinds):
    with pytest.raises(ValueError, match=r"per_category = 3.*math: 2, code: 2"):
        select_study_prompts(PromptConfig(source=three_kinds, split=TUNE_SPLIT, per_category=3))


def test_the_workload_source_reads_only_its_tune_split_one_category_at_a_time():
    selected = select_study_prompts(PromptConfig(source=WORKLOAD, split=TUNE_SPLIT, per_category=1))
    assert [p.category for p in selected] == list(dict.fromkeys(p.category for p in selected))
    assert sorted(p.category for p in selected) == sorted(WORKLOAD_CATEGORIES)
    assert {p.split for p in selected} == {TUNE_SPLIT}


def test_the_study_name_says_it_tuned_on_the_workload():
    config = StudyConfig(prompts=PromptConfig(source=WORKLOAD, split=TUNE_SPLIT, per_category=2, max_new_tokens=64))
    assert derive_study_name(config, "cpu/float32", 16).endswith(":cpu/float32:workload-tune-2each-16x64")
    humaneval = StudyConfig(prompts=PromptConfig(n_prompts=8))
    assert derive_study_name(humaneval, "cpu/float32", 8).endswith(":cpu/float32:humaneval-8x64")


# Scripted timings: (plain seconds, candidate seconds, drafted, accepted) per prompt. Category A
# pools to 8/4 = 2.0x (though its prompts' own ratios average 3.33x), B to 0.5x: the geometric
# mean is 1.0x, where pooling all seconds would say 9/6 = 1.5x.
SCRIPT = {"a1": (6.0, 1.0, 4, 2), "b1": (1.0, 2.0, 4, 1), "a2": (2.0, 3.0, 4, 4)}
CATEGORY = {"a1": "A", "b1": "B", "a2": "A"}


def _prepared(prompt_id: str, category: str | None) -> PreparedPrompt:
    tokens = [1, 2, 3]
    logits = torch.nn.functional.one_hot(torch.tensor(tokens), 10).float()
    return PreparedPrompt(prompt_id, {"input_ids": torch.tensor([[5, 6]])}, tokens, logits, category)


def _scripted_timed_generate(model, inputs, strategy=None, **kwargs):
    prompt_id = inputs["prompt_id"]
    plain, candidate, drafted, accepted = SCRIPT[prompt_id]
    if strategy == "plain":
        return TimedRun([1, 2, 3], plain, None)
    return TimedRun([1, 2, 3], candidate, StrategyStats(drafted_tokens=drafted, accepted_tokens=accepted))


def _run_measured(monkeypatch, categories: dict[str, str | None], floor: float | None):
    monkeypatch.setattr("hf_selfspec.tuning.studies.objective.timed_generate", _scripted_timed_generate)
    prompts = []
    for prompt_id, category in categories.items():
        prompt = _prepared(prompt_id, category)
        prompt.inputs["prompt_id"] = prompt_id
        prompts.append(prompt)
    model = SimpleNamespace(dtype=torch.float32)
    objective = SpeedupObjective(model, prompts, SearchConfig(), NUM_LAYERS, {}, "test", category_floor=floor)
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    study.enqueue_trial(warm_start_trials(SearchConfig(), NUM_LAYERS)[0])
    study.optimize(objective, n_trials=1)
    (trial,) = study.trials
    assert trial.state == TrialState.COMPLETE
    return trial


def test_a_trial_is_the_geometric_mean_of_its_category_speedups(monkeypatch):
    trial = _run_measured(monkeypatch, CATEGORY, floor=None)
    assert trial.value == pytest.approx(1.0)
    attrs = trial.user_attrs
    assert attrs["speedup"] == pytest.approx(1.0) and attrs["speedup_kind"] == CATEGORY_GEOMETRIC_MEAN
    assert attrs["category_speedups"] == pytest.approx({"A": 2.0, "B": 0.5})
    assert attrs["category_acceptance"] == pytest.approx({"A": 6 / 8, "B": 1 / 4})
    assert attrs["category_prompts"] == {"A": 2, "B": 1}
    assert attrs["acceptance_rate"] == pytest.approx(7 / 12)
    # After each prompt, the geometric mean of the categories measured so far.
    reports = [trial.intermediate_values[step] for step in range(3)]
    assert reports == pytest.approx([6.0, math.sqrt(6.0 * 0.5), 1.0])
    assert trial.constraints == {}  # no floor, nothing to be infeasible against


def test_one_category_is_the_pooled_speedup_as_before(monkeypatch):
    trial = _run_measured(monkeypatch, {"a1": "code", "b1": "code", "a2": "code"}, floor=None)
    assert trial.value == pytest.approx(9.0 / 6.0)
    assert trial.user_attrs["speedup_kind"] == POOLED
    assert "category_speedups" not in trial.user_attrs


def test_a_near_tie_that_ends_sooner_is_not_credited_as_speed(monkeypatch):
    """In bfloat16 a candidate may take a near-tie's other side and end its answer sooner: the
    trial divides seconds per generated token, not total seconds."""
    tokens = [3, 4, 7, 7]
    logits = torch.nn.functional.one_hot(torch.tensor(tokens), 10).float() * 20.0
    logits[1, 5] = 20.0 - 0.25  # two bfloat16 ulps below plain's choice at the second step
    prompt = PreparedPrompt("p", {"input_ids": torch.tensor([[5, 6]])}, tokens, logits, "A")

    def scripted(model, inputs, strategy=None, **kwargs):
        if strategy == "plain":
            return TimedRun(tokens, 2.0, None)  # 4 tokens in 2 s
        return TimedRun([3, 5], 0.5, StrategyStats(drafted_tokens=2, accepted_tokens=1))  # 2 tokens in 0.5 s

    monkeypatch.setattr("hf_selfspec.tuning.studies.objective.timed_generate", scripted)
    objective = SpeedupObjective(SimpleNamespace(dtype=torch.bfloat16), [prompt], SearchConfig(), NUM_LAYERS, {}, "test")
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.NopPruner())
    study.enqueue_trial(warm_start_trials(SearchConfig(), NUM_LAYERS)[0])
    study.optimize(objective, n_trials=1)
    (trial,) = study.trials
    assert trial.user_attrs["near_tie_prompts"] == ["p"]
    assert trial.value == pytest.approx(2.0)  # 0.25 s per token against 0.5; total seconds would say 4
    assert trial.user_attrs["tokens_per_second"] == pytest.approx(4.0)
    assert trial.user_attrs["baseline_tokens_per_second"] == pytest.approx(2.0)


@pytest.mark.parametrize("floor, shortfall", [(1.0, 0.5), (0.4, -0.1)])
def test_a_category_below_the_floor_makes_the_trial_infeasible(monkeypatch, floor, shortfall):
    trial = _run_measured(monkeypatch, CATEGORY, floor=floor)
    assert trial.constraints == {FLOOR_CONSTRAINT: pytest.approx(shortfall)}
    assert trial.user_attrs["below_category_floor"] == ({"B": 0.5} if shortfall > 0 else {})


def test_the_estimated_objective_is_per_category_too(monkeypatch):
    """The estimate's seconds stand in for the measured ones, category by category."""
    monkeypatch.setattr("hf_selfspec.tuning.costmodel.estimated.draft_predictions", lambda model, data, params: None)
    monkeypatch.setattr(
        "hf_selfspec.tuning.costmodel.estimated.estimate_decode",
        lambda model, data, params, strategy, draft, cost, corpus: (
            SCRIPT[data.prompt.id][1],
            StrategyStats(drafted_tokens=SCRIPT[data.prompt.id][2], accepted_tokens=SCRIPT[data.prompt.id][3]),
        ),
    )
    monkeypatch.setattr("hf_selfspec.tuning.costmodel.estimated.plain_seconds", lambda data, cost: SCRIPT[data.prompt.id][0])
    forced = [SimpleNamespace(prompt=_prepared(prompt_id, category), reference=[1, 2, 3])
              for prompt_id, category in CATEGORY.items()]
    cost = CostModel(NUM_LAYERS, (0.0,) * 16, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    objective = EstimatedSpeedupObjective(None, forced, cost, SearchConfig(), "test", category_floor=1.0)
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial(warm_start_trials(SearchConfig(), NUM_LAYERS)[0])
    study.optimize(objective, n_trials=1)
    (trial,) = study.trials
    assert trial.value == pytest.approx(1.0)
    assert trial.user_attrs["category_speedups"] == pytest.approx({"A": 2.0, "B": 0.5})
    assert trial.user_attrs["objective"] == "estimated"
    assert trial.constraints == {FLOOR_CONSTRAINT: pytest.approx(0.5)}


def _context(model_dir) -> StudyContext:
    return StudyContext(
        model=str(model_dir), gguf_file=None, dtype="float32", device_key="cpu/float32",
        strategy="self_speculative", num_layers=NUM_LAYERS, prompt_source="humaneval", n_prompts=2,
        prompt_offset=0, max_new_tokens=8, baseline_tokens_per_second=100.0, versions={}, category_floor=1.0,
    )  # fmt: skip


def test_only_feasible_estimates_are_confirmed_and_the_summary_names_the_rest(tmp_path, tiny_llama_dir):
    storage_url = f"sqlite:///{tmp_path / 'optuna.db'}"
    # Trial 1 has the best estimate but a category below the floor.
    below = {"below_category_floor": {"math": 0.8}}
    above = {"category_speedups": {"math": 1.05, "chat": 1.6}}
    estimated = make_tuned_looking_study(
        storage_url, "s:estimated", tiny_llama_dir, speedups=(1.1, 1.5, 1.3), attrs=({}, below, above),
        constraints=({FLOOR_CONSTRAINT: -0.1}, {FLOOR_CONSTRAINT: 0.2}, {FLOOR_CONSTRAINT: -0.05}),
    )  # fmt: skip
    config = StudyConfig(study=StudySettings(confirm_top=1, category_floor=1.0))

    measuring = ScriptedConfirmation(NUM_LAYERS)
    storage = optuna.storages.RDBStorage(storage_url)
    confirmed = confirm_estimates(storage, "s", estimated, _context(tiny_llama_dir), config, measuring, False)
    assert [t.user_attrs["estimated_trial"] for t in confirmed.trials] == [2]
    summary = format_summary(TuneOutcome(estimated, storage_url, {}, confirmed))
    assert "Below the category floor in s:estimated" in summary
    assert "trial 1: 1.50x, math 0.80x below the category floor" in summary
    assert "best estimate     1.30x  (trial 2)\nby category       math 1.05x, chat 1.60x" in summary



@pytest.mark.parametrize("objective", ["measured", "estimated"])
def test_a_study_on_categorised_prompts_tunes_their_geometric_mean_under_a_floor(tmp_path, tiny_llama_dir, objective):
    """For real on the tiny model: one tune prompt of each category (never a held-out one), each
    trial's value the geometric mean of what it recorded per category; under a floor no random
    model reaches, every trial is infeasible, the summary says so and nothing is exported."""
    rows = [
        {"id": f"{category}/{split}", "prompt": text, "category": category, "split": split}
        for category, text in (("prose", "Once upon a time there was"), ("code", "def add(a, b):\n    return"))
        for split in ("held_out", TUNE_SPLIT)
    ]
    _write_jsonl(tmp_path / "kinds.jsonl", rows)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    (tmp_path / "study.toml").write_text(
        f'[model]\nname = "{tiny_llama_dir}"\n'
        '[prompts]\nsource = "kinds.jsonl"\nsplit = "tune"\nper_category = 1\nmax_new_tokens = 6\n'
        f'[study]\nstorage = "{storage}"\nseed = 0\npruner = "none"\nobjective = "{objective}"\n'
        "confirm_top = 1\ncategory_floor = 1000\n",
        encoding="utf-8",
    )
    from hf_selfspec.tuning.studies.config import load_study_config
    from hf_selfspec.tuning.studies.export import ExportError, export_profile
    from hf_selfspec.tuning.tune import run_tune

    outcome = run_tune(load_study_config(tmp_path / "study.toml"), n_trials=2, show_progress=False)
    assert outcome.study.study_name.split(":")[3] == "kinds-tune-1each-2x6"
    trials = outcome.study.get_trials(states=(TrialState.COMPLETE,))
    assert trials, "no trial completed"
    for trial in trials:
        speedups = trial.user_attrs["category_speedups"]
        assert list(speedups) == ["prose", "code"]
        assert trial.value == pytest.approx(geometric_mean(speedups.values()))
        assert trial.constraints[FLOOR_CONSTRAINT] == pytest.approx(1000 - min(speedups.values()))
        assert trial.user_attrs["prompts_measured"] == 2
    assert outcome.best is None
    if outcome.confirmed is not None:
        assert not outcome.confirmed.trials  # no feasible estimate to confirm
    assert f"Below the category floor in {outcome.study.study_name}" in format_summary(outcome)
    with pytest.raises(ExportError, match="category floor"):
        export_profile(storage, outcome.study.study_name, tmp_path / "out")
