"""The tuner reads the strategy registry: each strategy's search space is the knobs it declares,
so a strategy registered outside the package is tuned by naming it in a study config; and the
commands that only read a config and run the model load without optuna."""

from __future__ import annotations

import subprocess
import sys

import optuna
import pytest
from optuna.trial import TrialState
from helpers.tuning import cli_env, make_tuned_looking_study

import hf_selfspec
from hf_selfspec.strategies import TargetConfidenceGated
from hf_selfspec.tuning import TuningError
from hf_selfspec.tuning.studies.config import SearchConfig, StudyConfigError, load_study_config
from hf_selfspec.tuning.studies.export import export_profile
from hf_selfspec.tuning.studies.knobs import strategy_knobs
from hf_selfspec.tuning.studies.space import SUB_LAYERS, skip_param_name, suggest_params
from hf_selfspec.tuning.tune import run_tune

# The knobs each built-in strategy's trials searched before the strategies declared them, in the
# order the sampler is asked for them (a seeded sampler draws in that order).
SHARED = (
    "max_draft_tokens", "draft_exit_threshold", "prompt_lookup_tokens", "prompt_lookup_min_ngram", "prompt_lookup_ngram",
    "prompt_lookup_max_tokens", "draft_source_probe_interval", "draft_vocab_size", "draft_alternatives",
    "backoff_probe_interval", "prompt_lookup_min_tokens",
)
# Declared by every strategy since, but asked for only in a trial that switches the online corpus
# on: a study that never does draws what it drew before.
ONLINE = ("online_corpus_min_prob", "online_corpus_max_tokens", "online_corpus_min_context")
# Declared by every strategy since, and asked for in every trial: fixed at its default unless a
# batched study gives it a range, where a single value draws nothing from a seeded sampler.
BATCH = ("batch_quorum",)
# Declared by every strategy since, asked for in every trial, fixed at its default (none) unless
# a study gives it a range.
BESIDE_LOOKUP = ("lookup_alternatives",)
BUILT_IN_KNOBS = {
    "self_speculative": SHARED + BATCH + BESIDE_LOOKUP,
    "adaptive_draft_exit": SHARED + BATCH + BESIDE_LOOKUP + ("target_acceptance", "threshold_step"),
    "target_confidence_gated": SHARED + BATCH + BESIDE_LOOKUP + ("target_confidence_threshold",),
    "kangaroo": SHARED + BATCH + BESIDE_LOOKUP,
}


def _declared(strategy: str) -> tuple[str, ...]:
    return SHARED + ONLINE + BUILT_IN_KNOBS[strategy][len(SHARED):]
# A user's strategy: the gated one, searching only its draft length and its confidence threshold.
USER_STRATEGY = "test_registry_short_gated"
USER_KNOBS = ("max_draft_tokens", "target_confidence_threshold")


@pytest.fixture(scope="module")
def user_strategy() -> str:
    @hf_selfspec.register_strategy(USER_STRATEGY)
    class ShortGated(TargetConfidenceGated):
        tunable_knobs = USER_KNOBS

    return USER_STRATEGY


def _study_config(path, model_dir, strategy: str, search: str = "", n_trials: int = 2):
    path.write_text(
        f'[model]\nname = "{model_dir}"\n[prompts]\nn_prompts = 1\nmax_new_tokens = 6\n'
        f'[search]\nstrategy = "{strategy}"\n{search}\n'
        f'[study]\nstorage = "sqlite:///{path.parent / "optuna.db"}"\nseed = 0\nsampler = "random"\npruner = "none"\nn_trials = {n_trials}\n',
        encoding="utf-8",
    )
    return path


@pytest.mark.parametrize("strategy", sorted(BUILT_IN_KNOBS))
def test_a_built_in_strategy_searches_the_knobs_it_always_did(strategy):
    assert strategy_knobs(strategy) == _declared(strategy)
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    suggest_params(trial, SearchConfig(strategy=strategy), num_layers=2)
    skips = [skip_param_name(sub_layer, layer) for layer in range(2) for sub_layer in SUB_LAYERS]
    assert list(trial.params) == skips + list(BUILT_IN_KNOBS[strategy])


def test_a_registered_strategy_is_read_with_ranges_for_the_knobs_it_declares(user_strategy, tiny_llama_dir, tmp_path):
    config = load_study_config(
        _study_config(tmp_path / "study.toml", tiny_llama_dir, user_strategy, "target_confidence_threshold = [0.2, 0.8]")
    )
    assert config.search.strategy == user_strategy
    assert config.search.ranges == {"target_confidence_threshold": (0.2, 0.8)}
    # A knob its parent strategy searches, but it does not declare, takes no range.
    undeclared = _study_config(tmp_path / "other.toml", tiny_llama_dir, user_strategy, "draft_exit_threshold = [0.2, 0.8]")
    with pytest.raises(StudyConfigError, match=f"search.draft_exit_threshold: strategy '{user_strategy}' does not read it"):
        load_study_config(undeclared)


def test_a_registered_strategy_is_tuned_and_exported(user_strategy, tiny_llama_dir, tmp_path):
    config = load_study_config(
        _study_config(tmp_path / "study.toml", tiny_llama_dir, user_strategy, "target_confidence_threshold = [0.2, 0.8]")
    )
    outcome = run_tune(config, show_progress=False)
    study = outcome.study
    assert f":{user_strategy}:" in study.study_name
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(trials) == 2
    skips = {skip_param_name(sub_layer, layer) for layer in range(4) for sub_layer in SUB_LAYERS}
    for trial in trials:
        assert set(trial.params) == skips | set(USER_KNOBS)
        assert 0.2 <= trial.params["target_confidence_threshold"] <= 0.8
    result = export_profile(outcome.storage_url, study.study_name, tmp_path / "profile")
    best = outcome.best
    assert result.profile.strategy == user_strategy
    assert result.profile.params["target_confidence_threshold"] == best.params["target_confidence_threshold"]
    assert result.profile.params["max_draft_tokens"] == best.params["max_draft_tokens"]
    # What it does not search stays at generate's default.
    assert result.profile.params["draft_exit_threshold"] == hf_selfspec.SelfSpecParams().draft_exit_threshold


def test_an_unregistered_strategy_is_refused_with_how_to_register_one(tiny_llama_dir, tmp_path):
    path = _study_config(tmp_path / "study.toml", tiny_llama_dir, "test_registry_never_registered")
    with pytest.raises(StudyConfigError) as refused:
        load_study_config(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: search.strategy: must be one of ")
    assert "self_speculative" in message and "'test_registry_never_registered'" in message
    assert "hf_selfspec.register_strategy" in message and "\n" not in message


def test_exporting_a_study_of_a_strategy_this_process_has_not_registered_says_to_register_it(tiny_llama_dir, tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    make_tuned_looking_study(storage, "elsewhere", tiny_llama_dir, strategy="test_registry_registered_elsewhere")
    with pytest.raises(TuningError, match="unknown strategy 'test_registry_registered_elsewhere'.*must be registered"):
        export_profile(storage, "elsewhere", tmp_path / "profile")


def test_a_strategy_declaring_a_knob_the_tuner_cannot_search_is_refused(tiny_llama_dir, tmp_path):
    @hf_selfspec.register_strategy("test_registry_smoothing")
    class Smoothing(hf_selfspec.Strategy):
        tunable_knobs = ("max_draft_tokens", "acceptance_ema")

    path = _study_config(tmp_path / "study.toml", tiny_llama_dir, "test_registry_smoothing")
    with pytest.raises(StudyConfigError, match="declares tunable knob 'acceptance_ema', which the tuner has no range for"):
        load_study_config(path)


def test_registering_a_strategy_with_an_unknown_knob_fails():
    with pytest.raises(ValueError, match="tunable_knobs names 'draft_lenght', which is no SelfSpecParams field"):
        hf_selfspec.register_strategy("test_registry_typo")(
            type("Typo", (hf_selfspec.Strategy,), {"tunable_knobs": ("draft_lenght",)})
        )
    assert "test_registry_typo" not in hf_selfspec.available_strategies()


# Runs the CLI in a fresh interpreter and reports whether optuna was imported.
_RUN_WITHOUT_OPTUNA = """
import sys
from hf_selfspec.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit:
    status = exit.code
print(status, 'optuna' in sys.modules)
"""


@pytest.mark.parametrize("command", ["train-adapter", "write-lookup-corpus"])
@pytest.mark.parametrize("argument", ["--help", "missing.toml"])
def test_config_only_commands_do_not_import_optuna(command, argument, tmp_path):
    """`--help`, and a run that reads its config (here a missing one) and stops, both import
    everything the command needs before its model loads."""
    result = subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT_OPTUNA, command, argument],
        env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    status, optuna_imported = result.stdout.split()[-2:]
    assert status == ("0" if argument == "--help" else "2"), result.stderr
    assert optuna_imported == "False"
