"""Study config parsing and the search space: fast, no model."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from helpers import REPO_ROOT

from hf_selfspec.cli import main
from hf_selfspec.params import PARAM_NAMES, default_skip_layers, resolve_params
from hf_selfspec.tuning.studies.config import SearchConfig, StudyConfigError, load_study_config
from hf_selfspec.tuning.studies.space import (
    ADAPTER_PARAM,
    decode_params,
    evenly_spread_layers,
    skip_param_name,
    suggest_params,
    warm_start_trials,
)


def test_shipped_configs_load_and_target_the_embedded_model_on_cpu():
    config = load_study_config(REPO_ROOT / "studies" / "smollm2-135m.toml")
    assert (config.model.name, config.model.device, config.model.dtype) == ("embedded", "cpu", "float32")
    assert config.search.strategy == "adaptive_draft_exit"
    chat = load_study_config(REPO_ROOT / "studies" / "smollm2-135m-chat.toml")
    assert chat.prompts.source.endswith("chat_prompts.jsonl")  # resolved next to the config


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "studies").glob("*.toml")), ids=lambda path: path.name)
def test_every_shipped_study_config_loads(path):
    """A study the docs tell users to run must not stop at its first line: loading reads every
    key and finds every adapter and lookup corpus it names (an adapter retired from the package's
    hf_selfspec/data/tuned/ while a study still lists it fails here)."""
    config = load_study_config(path)
    assert (config.model.name, config.model.device) == ("embedded", "cpu")
    for name, weights in config.search.draft_adapters.items():
        assert Path(weights).parent.parent == (REPO_ROOT / "hf_selfspec" / "data" / "tuned").resolve(), name


SHIPPED_PROFILES = REPO_ROOT / "hf_selfspec" / "data" / "tuned" / "smollm2-135m-instruct"


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "studies" / SHIPPED_PROFILES.name).glob("*.toml")), ids=lambda path: path.name)
def test_every_shipped_recipe_writes_over_the_file_the_package_ships(path):
    """The recipes that made the shipped adapters and lookup corpora live in studies/, their
    output in the package: rerunning one must replace the shipped file, not leave a stray copy."""
    from hf_selfspec.tuning.training.train_adapter import load_train_config
    from hf_selfspec.tuning.training.write_lookup_corpus import load_lookup_corpus_config

    if "[adapter]" in path.read_text(encoding="utf-8"):
        config = load_train_config(path)
        outputs = [config.adapter_path(exit_layer) for exit_layer in config.exit_layers]
        outputs += [config.heads_path] if config.adapter.draft_heads else []
    else:
        outputs = [load_lookup_corpus_config(path).corpus_path]
    for output in outputs:
        assert output.parent == SHIPPED_PROFILES.resolve()
        assert output.is_file(), output


@pytest.mark.parametrize(
    "body, key, words",
    [
        ("[prompts]\nn_prompt = 3\n", "prompts.n_prompt", "unknown key"),
        ("[promts]\nn_prompts = 3\n", "promts", "unknown section"),
        ('[prompts]\nn_prompts = "eight"\n', "prompts.n_prompts", "must be an integer"),
        ("[prompts]\nmax_new_tokens = true\n", "prompts.max_new_tokens", "must be an integer"),
        ("[prompts]\nn_prompts = 0\n", "prompts.n_prompts", "at least 1"),
        ('[model]\ndtype = "int8"\n', "model.dtype", "unknown dtype"),
        ('[model]\ndevice = "gpu"\n', "model.device", "not a device torch knows"),
        ('[prompts]\nsource = "missing.jsonl"\n', "prompts.source", "neither"),
        ('[search]\nstrategy = "fastest"\n', "search.strategy", "must be one of"),
        ("[search]\ntarget_acceptance = [0.5, 0.9]\n", "search.target_acceptance", "does not read it"),
        ("[search]\ndraft_exit_threshold = [0.5, 1.5]\n", "search.draft_exit_threshold", "allowed range"),
        ("[search]\nmax_draft_tokens = [2.5, 8]\n", "search.max_draft_tokens", "pair of integers"),
        ("[search]\nmax_draft_tokens = [8, 2]\n", "search.max_draft_tokens", "above high"),
        ('[search]\nstrategy = "adaptive_draft_exit"\nthreshold_step = [0, 0.1]\n', "search.threshold_step", "log"),
        ("[search]\nwarm_start_skip_ratios = [0.5, 1.5]\n", "search.warm_start_skip_ratios", "between 0 and 1"),
        ("[search]\nprompt_lookup_min_ngram = [1, 4]\n", "search.prompt_lookup_min_ngram", "above the shortest prompt_lookup_ngram searched (3)"),
        ("[search]\nprompt_lookup_ngram = [2, 6]\nprompt_lookup_min_ngram = [2, 3]\n", "search.prompt_lookup_min_ngram", "reaches 3"),
        ("[search]\nprompt_lookup_ngram = [0, 6]\n", "search.prompt_lookup_ngram", "allowed range"),
        ("[study]\nheartbeat_interval = 30\ngrace_period = 30\n", "study.grace_period", "exceed"),
        ('[study]\nsampler = "grid"\n', "study.sampler", "must be one of"),
        ("study = 3\n", "study", "table"),
        ('[prompts]\nsource = "workload"\nsplit = "held_out"\n', "prompts.split", "never tunes on the 'held_out' split"),
        ('[prompts]\nsplit = "train"\n', "prompts.split", "must be 'tune'"),
        ('[prompts]\nsplit = "tune"\n', "prompts.split", "'humaneval' has no splits"),
        ("[prompts]\nper_category = 2\n", "prompts.per_category", "all one category"),
        ('[prompts]\nsource = "workload"\nper_category = 0\n', "prompts.per_category", "at least 1"),
        ('[prompts]\nsource = "workload"\noffset = 3\n', "prompts.offset", "per category"),
        ("[study]\ncategory_floor = 0\n", "study.category_floor", "above 0"),
        ('[study]\ncategory_floor = "plain"\n', "study.category_floor", "must be an integer or a number"),
    ],
)
def test_bad_config_names_the_file_and_the_key(tmp_path, body, key, words):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(StudyConfigError) as error:
        load_study_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}: {key}:"), message
    assert words in message


def test_tune_command_reports_a_bad_config_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[prompts]\nn_prompt = 3\n")
    assert main(["tune", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: prompts.n_prompt: unknown key" in err
    assert "Traceback" not in err


def test_tune_dtype_and_device_flags_replace_the_study_model_section(monkeypatch, capsys):
    """`tune STUDY.toml --dtype float32` tunes the study in float32 (a study of its own, as its
    name carries the device key); without the flags the study's own [model] holds."""
    import hf_selfspec.tuning.tune as tune_module

    ran = []
    monkeypatch.setattr(tune_module, "run_tune", lambda config, *args, **kwargs: ran.append(config.model) or None)
    monkeypatch.setattr(tune_module, "format_summary", lambda outcome: "")
    study = str(REPO_ROOT / "studies" / "smollm2-135m-bf16.toml")
    assert main(["tune", study, "--dtype", "float32"]) == 0
    assert main(["tune", study]) == 0
    assert [(model.dtype, model.device) for model in ran] == [("float32", "cpu"), ("bfloat16", "cpu")]
    assert main(["tune", study, "--gguf-file", "other.gguf"]) == 2
    assert "--gguf-file goes with --model" in capsys.readouterr().err


def test_jsonl_prompt_source_is_relative_to_the_config(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def f():"}\n')
    path = tmp_path / "study.toml"
    path.write_text('[prompts]\nsource = "prompts.jsonl"\n')
    assert load_study_config(path).prompts.source == str((tmp_path / "prompts.jsonl").resolve())


def test_a_workload_study_reads_the_tune_split_per_category_with_a_floor(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text('[prompts]\nsource = "workload"\nper_category = 2\n[study]\ncategory_floor = 1\n')
    config = load_study_config(path)
    assert (config.prompts.source, config.prompts.split, config.prompts.per_category) == ("workload", "tune", 2)
    assert config.prompts.n_prompts is None and config.study.category_floor == 1.0
    # `split = "tune"` may be spelt out; a JSONL file keeps every prompt unless it says so.
    path.write_text('[prompts]\nsource = "workload"\nsplit = "tune"\n')
    assert load_study_config(path).prompts.split == "tune"
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def f():"}\n')
    path.write_text('[prompts]\nsource = "prompts.jsonl"\n')
    assert load_study_config(path).prompts.split is None


def test_overrides_replace_the_prompt_set_only():
    config = load_study_config(REPO_ROOT / "studies" / "smollm2-135m.toml")
    changed = config.with_overrides(n_prompts=2, max_new_tokens=16)
    assert (changed.prompts.n_prompts, changed.prompts.max_new_tokens) == (2, 16)
    assert changed.search == config.search and changed.study == config.study


@pytest.mark.parametrize("strategy", ["self_speculative", "adaptive_draft_exit", "target_confidence_gated"])
def test_a_suggested_trial_is_a_complete_valid_parameter_set(strategy):
    search = SearchConfig(strategy=strategy, ranges={"max_draft_tokens": (3, 5)})
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(5):
        params = suggest_params(study.ask(), search, num_layers=6)
        assert set(params) == PARAM_NAMES
        assert 3 <= params["max_draft_tokens"] <= 5
        assert all(0 <= layer < 6 for layer in params["attn_skip_layers"] + params["mlp_skip_layers"])


def test_warm_starts_cover_default_spread_and_no_skips():
    search = SearchConfig(warm_start_skip_ratios=(0.25, 0.5))
    trials = warm_start_trials(search, num_layers=30)
    decoded = [decode_params(t, search.strategy, 30) for t in trials]
    assert tuple(decoded[0]["attn_skip_layers"]) == default_skip_layers(30)[0]
    assert decoded[-1]["attn_skip_layers"] == [] and decoded[-1]["mlp_skip_layers"] == []
    assert len(decoded[2]["attn_skip_layers"]) == 15
    assert len({tuple(d["attn_skip_layers"]) for d in decoded}) == len(decoded) == 4
    for params in decoded:
        resolve_params(30, params)  # generate would accept every one of them


def test_a_range_that_admits_no_model_draft_adds_a_lookup_alone_warm_start():
    """Only where the study lets `max_draft_tokens` be 0: the first trial (the default skip set,
    or the first adapter) once more, with the model never drafting."""
    narrow = warm_start_trials(SearchConfig(warm_start_skip_ratios=(0.5,)), num_layers=30)
    search = SearchConfig(warm_start_skip_ratios=(0.5,), ranges={"max_draft_tokens": (0, 6)})
    trials = warm_start_trials(search, num_layers=30)
    assert len(trials) == len(narrow) + 1
    assert [trial["max_draft_tokens"] for trial in trials] == [6] * len(narrow) + [0]
    assert {**trials[-1], "max_draft_tokens": 6} == trials[0]
    assert resolve_params(30, decode_params(trials[-1], search.strategy, 30)).max_draft_tokens == 0
    adapters = SearchConfig(strategy="kangaroo", draft_adapters={"a": "a.safetensors", "b": "b.safetensors"},
                            ranges={"max_draft_tokens": (0, 6)})
    trials = warm_start_trials(adapters, num_layers=30)
    assert [(trial[ADAPTER_PARAM], trial["max_draft_tokens"]) for trial in trials] == [("a", 6), ("b", 6), ("a", 0)]


def test_even_spread_keeps_the_first_and_last_layer():
    layers = evenly_spread_layers(30, 0.5)
    assert len(layers) == 15 and min(layers) >= 1 and max(layers) <= 28
    assert evenly_spread_layers(4, 0.9) == (1, 2)
    assert evenly_spread_layers(2, 0.5) == ()


def test_warm_starts_collapse_duplicates_on_a_shallow_model():
    trials = warm_start_trials(SearchConfig(warm_start_skip_ratios=(0.4, 0.5)), num_layers=4)
    skip_sets = [tuple(layer for layer in range(4) if t[skip_param_name("attn", layer)]) for t in trials]
    assert len(set(skip_sets)) == len(skip_sets)
