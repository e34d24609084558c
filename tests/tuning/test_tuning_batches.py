"""Tuning at a batch size: the study's prompts grouped into batches of one category, a trial's
speedup in the tokens of whole batches, every row held to plain batched greedy's, the batch size
kept with the study and its profile, and `batch_quorum` as a knob. Scripted decodes where the
arithmetic is the point; the tiny random Llama where the plumbing is."""

from __future__ import annotations

import json
from types import SimpleNamespace

import optuna
import pytest
import torch
from optuna.trial import TrialState

from hf_selfspec.measure import TimedRun, timed_generate
from hf_selfspec.prompts import Prompt
from hf_selfspec.stats import StrategyStats
from hf_selfspec.tuning import TuningError
from hf_selfspec.tuning.studies.config import (
    PromptConfig,
    SearchConfig,
    StudyConfig,
    StudyConfigError,
    StudySettings,
    load_study_config,
)
from hf_selfspec.tuning.studies.objective import (
    PRUNED_AFTER_PROMPTS,
    LosslessViolation,
    PreparedBatch,
    PreparedPrompt,
    SpeedupObjective,
    prepare_prompts,
)
from hf_selfspec.tuning.studies.space import suggest_params, warm_start_trials
from hf_selfspec.tuning.studies.study_prompts import batch_prompts

NUM_LAYERS = 4


def _prompt(prompt_id: str, category: str | None) -> Prompt:
    return Prompt(id=prompt_id, text=prompt_id, category=category)


def test_batches_hold_one_category_each_in_the_order_their_first_prompt_came():
    prompts = [_prompt(name, name[0]) for name in ("a0", "b0", "c0", "a1", "b1", "a2", "c1", "a3", "a4")]
    batches = batch_prompts(prompts, 2)
    assert [[p.id for p in batch] for batch in batches] == [
        ["a0", "a1"], ["b0", "b1"], ["c0", "c1"], ["a2", "a3"], ["a4"],
    ]  # fmt: skip
    # At size one every prompt is its own batch, in the order it was selected.
    assert [[p.id for p in batch] for batch in batch_prompts(prompts, 1)] == [[p.id] for p in prompts]


class _ScriptedBatchModel:
    """`generate` returns the given new tokens after the prompt, padding rows that ended early."""

    device = torch.device("cpu")
    generation_config = SimpleNamespace(eos_token_id=2)

    def __init__(self, new_tokens: list[list[int]]):
        self.new_tokens = torch.tensor(new_tokens)

    def generate(self, input_ids, **kwargs):
        logits = None
        if kwargs.get("output_logits"):
            steps = self.new_tokens.shape[1]
            logits = tuple(torch.full((len(input_ids), 10), float(step)) for step in range(steps))
        return SimpleNamespace(
            sequences=torch.cat([input_ids, self.new_tokens], dim=1), logits=logits, strategy_stats=None
        )


def test_a_batch_run_counts_each_row_up_to_its_end():
    # Row 0 ends at its EOS (2) and is padded with it after; row 1 runs to the limit.
    model = _ScriptedBatchModel([[5, 2, 2, 2], [7, 8, 9, 4]])
    run = timed_generate(model, {"input_ids": torch.tensor([[1, 1], [1, 1]])}, output_logits=True)
    assert run.rows == [[5, 2], [7, 8, 9, 4]]
    assert run.new_tokens == [5, 2, 2, 2]  # the first row as generated, as for one prompt
    assert len(run.row_logits) == 2 and run.row_logits[1].shape == (4, 10)
    assert torch.equal(run.logits, run.row_logits[0])
    # One prompt is a batch of one, whether timed or built by hand.
    single = timed_generate(_ScriptedBatchModel([[5, 6, 2]]), {"input_ids": torch.tensor([[1]])})
    assert single.rows == [[5, 6, 2]] and TimedRun([3, 4], 1.0, None).rows == [[3, 4]]


def _row(prompt_id: str, tokens: list[int], category: str = "A") -> PreparedPrompt:
    logits = torch.nn.functional.one_hot(torch.tensor(tokens), 10).float()
    return PreparedPrompt(prompt_id, {"input_ids": torch.tensor([[5, 6]])}, tokens, logits, category)


def _run_scripted(monkeypatch, batches, plain, candidate, pruner=None):
    """One warm-start trial over `batches`, each decode answered by `plain` or `candidate`
    (functions of the batch's prompt ids)."""

    def scripted(model, inputs, strategy=None, **kwargs):
        return (plain if strategy == "plain" else candidate)(inputs["ids"])

    monkeypatch.setattr("hf_selfspec.tuning.studies.objective.timed_generate", scripted)
    objective = SpeedupObjective(SimpleNamespace(dtype=torch.float32), batches, SearchConfig(), NUM_LAYERS, {}, "t")
    study = optuna.create_study(direction="maximize", pruner=pruner or optuna.pruners.NopPruner())
    study.enqueue_trial(warm_start_trials(SearchConfig(), NUM_LAYERS)[0])
    study.optimize(objective, n_trials=1, catch=(LosslessViolation,))
    return study.trials[0]


def _batch(*rows: PreparedPrompt) -> PreparedBatch:
    return PreparedBatch(rows, {"input_ids": torch.zeros((len(rows), 2), dtype=torch.long),
                                "ids": tuple(row.id for row in rows)})  # fmt: skip


def test_a_batch_is_timed_whole_in_the_tokens_of_all_its_rows(monkeypatch):
    # Plain: 6 tokens over both rows in 3 s; the candidate: the same 6 in 1 s.
    batch = _batch(_row("p", [1, 2]), _row("q", [3, 4, 5, 6]))
    stats = StrategyStats(drafted_tokens=4, accepted_tokens=3)
    trial = _run_scripted(
        monkeypatch, [batch],
        plain=lambda ids: TimedRun([1, 2, 0, 0], 3.0, None, rows=[[1, 2], [3, 4, 5, 6]]),
        candidate=lambda ids: TimedRun([1, 2, 0, 0], 1.0, stats, rows=[[1, 2], [3, 4, 5, 6]]),
    )  # fmt: skip
    assert trial.state == TrialState.COMPLETE
    assert trial.value == pytest.approx(3.0)
    assert trial.user_attrs["baseline_tokens_per_second"] == pytest.approx(2.0)
    assert trial.user_attrs["tokens_per_second"] == pytest.approx(6.0)
    assert trial.user_attrs["prompts_measured"] == 2


def test_a_row_that_differs_from_plain_batched_greedy_fails_the_trial(monkeypatch):
    batch = _batch(_row("p", [1, 2]), _row("q", [3, 4, 5]))
    trial = _run_scripted(
        monkeypatch, [batch],
        plain=lambda ids: TimedRun([1, 2, 0], 1.0, None, rows=[[1, 2], [3, 4, 5]]),
        candidate=lambda ids: TimedRun([1, 2, 0], 1.0, StrategyStats(), rows=[[1, 2], [3, 7, 5]]),
    )  # fmt: skip
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["lossless_violation"] == {"prompt": "q", "position": 1, "expected": 4, "actual": 7}


def _write_study(tmp_path, model_dir, batch_size: int, objective: str = "measured", search: str = "") -> StudyConfig:
    """Two categories of two prompts each, of different lengths, so a batch is left-padded."""
    texts = {
        "prose": ["Once upon a time there was", "The weather today"],
        "code": ["def add(a, b):\n    return", "import os\nfor name in os.listdir('.'):\n    print("],
    }
    rows = [
        {"id": f"{category}/{index}", "prompt": text, "category": category}
        for category, pair in texts.items() for index, text in enumerate(pair)
    ]  # fmt: skip
    (tmp_path / "kinds.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    (tmp_path / "study.toml").write_text(
        f'[model]\nname = "{model_dir}"\n'
        f'[prompts]\nsource = "kinds.jsonl"\nper_category = 2\nmax_new_tokens = 6\nbatch_size = {batch_size}\n'
        f"[search]\n{search}\n"
        f'[study]\nstorage = "{storage}"\nseed = 0\npruner = "none"\nobjective = "{objective}"\n',
        encoding="utf-8",
    )
    return load_study_config(tmp_path / "study.toml")


def test_the_estimated_objective_refuses_a_batch(tmp_path, tiny_llama_dir):
    with pytest.raises(StudyConfigError, match=r"prompts\.batch_size: the estimated objective prices a decode of one prompt"):
        _write_study(tmp_path, tiny_llama_dir, batch_size=2, objective="estimated")
    # A config built in Python is refused too, in one line, before any model loads.
    config = StudyConfig(
        prompts=PromptConfig(batch_size=3), study=StudySettings(objective="estimated", storage="sqlite:///:memory:")
    )
    from hf_selfspec.tuning.tune import run_tune

    with pytest.raises(TuningError, match=r"^prompts\.batch_size = 3: the estimated objective") as error:
        run_tune(config, n_trials=1, show_progress=False)
    assert "\n" not in str(error.value)


def test_batch_size_defaults_to_one_and_must_be_positive(tmp_path, tiny_llama_dir):
    assert PromptConfig().batch_size == 1
    assert _write_study(tmp_path, tiny_llama_dir, batch_size=1).prompts.batch_size == 1
    with pytest.raises(StudyConfigError, match=r"prompts\.batch_size: must be at least 1, got 0"):
        _write_study(tmp_path, tiny_llama_dir, batch_size=0)


def test_batch_quorum_is_searched_in_the_range_a_batched_study_gives(tmp_path, tiny_llama_dir):
    config = _write_study(tmp_path, tiny_llama_dir, batch_size=2, search="batch_quorum = [0.1, 0.6]")
    assert config.search.ranges["batch_quorum"] == (0.1, 0.6)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(5):
        trial = study.ask()
        params = suggest_params(trial, config.search, NUM_LAYERS)
        assert 0.1 <= trial.params["batch_quorum"] <= 0.6
        assert params["batch_quorum"] == trial.params["batch_quorum"]
    # Without a range it is still a parameter of every trial, fixed at generate's default, as
    # every knob a study leaves alone.
    trial = optuna.create_study().ask()
    assert suggest_params(trial, SearchConfig(), NUM_LAYERS)["batch_quorum"] == 0.25
    assert trial.params["batch_quorum"] == 0.25


@pytest.mark.parametrize(
    "batch_size, search, problem",
    [
        (1, "batch_quorum = [0.1, 0.6]", "is read only in a batch"),
        (2, "batch_quorum = [0.5, 1.5]", r"\[0\.5, 1\.5\] leaves the allowed range"),
    ],
)
def test_a_batch_quorum_range_that_cannot_be_searched_is_refused(tmp_path, tiny_llama_dir, batch_size, search, problem):
    with pytest.raises(StudyConfigError, match=rf"search\.batch_quorum: {problem}"):
        _write_study(tmp_path, tiny_llama_dir, batch_size, search=search)


def test_a_row_that_leaves_its_plain_batched_row_is_a_lossless_violation(tmp_path, tiny_llama_dir, monkeypatch):
    """On the tiny model: the candidate's real batched decode, with one token of its second row
    changed, fails the trial and names that row's prompt."""
    config = _write_study(tmp_path, tiny_llama_dir, batch_size=2)
    model, tokenizer = config.model.load()
    from hf_selfspec.tuning.studies.study_prompts import select_study_prompts

    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    batches, _ = prepare_prompts(model, tokenizer, batch_prompts(select_study_prompts(config.prompts), 2), kwargs)
    assert [len(batch.prompts) for batch in batches] == [2, 2]
    real = timed_generate

    def second_row_changed(model, inputs, strategy=None, **generate_kwargs):
        run = real(model, inputs, strategy=strategy, **generate_kwargs)
        if strategy != "plain":
            run.rows[1][0] = (run.rows[1][0] + 1) % model.config.vocab_size
        return run

    monkeypatch.setattr("hf_selfspec.tuning.studies.objective.timed_generate", second_row_changed)
    objective = SpeedupObjective(model, batches, config.search, NUM_LAYERS, kwargs, "t")
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial(warm_start_trials(config.search, NUM_LAYERS)[0])
    study.optimize(objective, n_trials=1, catch=(LosslessViolation,))
    (trial,) = study.trials
    assert trial.state == TrialState.FAIL
    violation = trial.user_attrs["lossless_violation"]
    assert violation["prompt"] == batches[0].prompts[1].id and violation["position"] == 0


def test_a_batched_study_tunes_whole_batches_end_to_end(tmp_path, tiny_llama_dir, monkeypatch):
    """For real on the tiny model: every decode a trial times is a whole batch of one category,
    every trial completes (its rows plain batched greedy's), and the batch size is kept with the
    study and its exported profile."""
    from hf_selfspec.tuning.studies import objective as objective_module
    from hf_selfspec.tuning.studies.export import export_profile
    from hf_selfspec.tuning.studies.storage import StudyContext
    from hf_selfspec.tuning.tune import run_tune

    widths: list[tuple[str | None, int]] = []
    real = objective_module.timed_generate

    def recording(model, inputs, strategy=None, **kwargs):
        widths.append((strategy, inputs["input_ids"].shape[0]))
        return real(model, inputs, strategy=strategy, **kwargs)

    monkeypatch.setattr(objective_module, "timed_generate", recording)
    config = _write_study(tmp_path, tiny_llama_dir, batch_size=2, search="batch_quorum = [0.0, 1.0]")
    outcome = run_tune(config, n_trials=2, show_progress=False)
    assert outcome.study.study_name.split(":")[3] == "kinds-2each-4x6-batch2"
    assert StudyContext.load(outcome.study).batch_size == 2
    trials = [trial for trial in outcome.study.trials if trial.state != TrialState.WAITING]  # warm starts left
    assert [trial.state for trial in trials] == [TrialState.COMPLETE] * 2
    for trial in trials:
        assert set(trial.user_attrs["category_speedups"]) == {"prose", "code"}
        assert trial.user_attrs["category_prompts"] == {"prose": 2, "code": 2}
        assert trial.user_attrs["prompts_measured"] == 4
        assert 0.0 <= trial.params["batch_quorum"] <= 1.0
    # The reference pass and every trial's decodes, plain and candidate: whole batches of two.
    assert {rows for _, rows in widths} == {2}
    assert {strategy for strategy, _ in widths} == {"plain", config.search.strategy}
    assert len(widths) == 2 + 2 * 2 * 2  # reference per batch, then plain and candidate per batch per trial

    result = export_profile(outcome.storage_url, outcome.study.study_name, tmp_path / "out")
    assert result.profile.measured["prompts"]["batch_size"] == 2
    assert result.profile.measured["prompts"]["n_prompts"] == 4


class _PruneAtOnce(optuna.pruners.BasePruner):
    def prune(self, study, trial) -> bool:
        return True


def test_a_trial_pruned_in_a_batched_study_says_how_many_prompts_it_decoded(monkeypatch):
    """Its steps are batches: the per-trial line counts the prompts of the batches it decoded."""
    from hf_selfspec.tuning.tune import trial_line

    batches = [_batch(_row("p", [1, 2]), _row("q", [3, 4])), _batch(_row("r", [1, 2]), _row("s", [3, 4]))]
    run = lambda ids: TimedRun([1, 2, 3, 4], 1.0, StrategyStats(), rows=[[1, 2], [3, 4]])  # noqa: E731
    trial = _run_scripted(monkeypatch, batches, plain=run, candidate=run, pruner=_PruneAtOnce())
    assert trial.state == TrialState.PRUNED
    assert trial.user_attrs[PRUNED_AFTER_PROMPTS] == 2
    assert "pruned after 2 prompt(s)" in trial_line(trial)
