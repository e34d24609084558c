"""Studies that may switch the online corpus on: the config checks the switch and its knobs, the
sampler searches the knobs only where the corpus is on, each trial starts from an empty corpus of
its own, and export ships what a trial's corpus learned so the exported folder starts from it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from optuna.trial import FixedTrial, TrialState
from helpers.tiny_models import tiny_model
from helpers.tuning import write_study_config

import hf_selfspec
from hf_selfspec.files import adapter_files
from hf_selfspec.hub.package import bundled_profiles_for_repository, package
from hf_selfspec.loading import load_model_and_tokenizer
from hf_selfspec.profiles import PROFILE_KEY
from hf_selfspec.tuning.studies.config import SearchConfig, StudyConfigError, load_study_config
from hf_selfspec.tuning.studies.export import export_profile
from hf_selfspec.tuning.studies.objective import fresh_corpus_key
from hf_selfspec.tuning.studies.space import ONLINE_CORPUS_PARAM, suggest_params, warm_start_trials
from hf_selfspec.tuning.studies.study_toml import study_toml
from hf_selfspec.tuning.tune import run_tune

N_TRIALS = 4
SEARCH = """[search]
online_corpus = {switch}
prompt_lookup_tokens = {lookup}
online_corpus_min_context = [1, 3]
online_corpus_min_prob = [0.0, 0.5]
"""


def _config(directory, model_dir, switch="[false, true]", lookup="[2, 2]"):
    path = write_study_config(directory / "online.toml", model_dir, f"sqlite:///{directory / 'optuna.db'}",
                              n_prompts=4, max_new_tokens=10, study="pruner = \"none\"")
    text = path.read_text().replace("[search]\n", SEARCH.format(switch=switch, lookup=lookup))
    path.write_text(text.replace("n_prompts = 4", 'source = "streams"\nper_category = 2'))
    return path


@pytest.fixture(scope="module")
def tuned(tiny_llama_dir, tmp_path_factory, one_thread):
    directory = tmp_path_factory.mktemp("online-study")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_SELFSPEC_CACHE", str(directory / "cache"))
        config = load_study_config(_config(directory, tiny_llama_dir))
        outcome = run_tune(config, n_trials=N_TRIALS, show_progress=False)
    return SimpleNamespace(outcome=outcome, config=config, storage=f"sqlite:///{directory / 'optuna.db'}",
                           directory=directory)


def test_trials_switch_the_corpus_and_read_its_knobs_only_where_it_is_on(tuned):
    trials = [t for t in tuned.outcome.study.get_trials() if t.state.is_finished()]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * N_TRIALS  # lossless with the corpus
    assert trials[0].params[ONLINE_CORPUS_PARAM] is True, "a study of repeating text starts with the corpus on"
    for trial in trials:
        online = {"online_corpus_min_context", "online_corpus_min_prob"} & set(trial.params)
        assert bool(online) == trial.params[ONLINE_CORPUS_PARAM], trial.params
    assert tuned.outcome.study.study_name.endswith(":online?")
    attrs = tuned.outcome.study.user_attrs
    assert attrs["online_corpus_choices"] == [False, True]
    assert attrs["online_corpus_file"].startswith(str(tuned.directory / "cache" / "online-corpora"))


def test_a_saved_study_config_keeps_the_switch(tuned, tmp_path):
    path = tmp_path / "again.toml"
    path.write_text(study_toml(tuned.config, path))
    assert load_study_config(path).search.online_corpus == (False, True)


def test_each_trial_starts_from_an_empty_corpus_of_its_own():
    model = tiny_model("llama")
    on, off = {ONLINE_CORPUS_PARAM: True}, {ONLINE_CORPUS_PARAM: False}
    key = fresh_corpus_key(model, on)
    hf_selfspec.online_corpus(model, key).add([1, 2, 3, 4])
    assert fresh_corpus_key(model, on) == key and hf_selfspec.online_corpus(model, key).texts == 0
    keys = {fresh_corpus_key(model, on, candidate, round_) for candidate in range(2) for round_ in range(2)}
    assert len(keys) == 4, "candidates measured together, and rounds of one prompt, never share a corpus"
    assert fresh_corpus_key(model, off) is None and fresh_corpus_key(model, {}) is None


def test_a_study_that_never_switches_it_on_asks_nothing_of_it():
    search = SearchConfig(ranges={"prompt_lookup_tokens": (1, 2)})
    starts = warm_start_trials(search, 4)
    assert all(ONLINE_CORPUS_PARAM not in values for values in starts)
    trial = FixedTrial(starts[0])
    params = suggest_params(trial, search, 4)
    assert ONLINE_CORPUS_PARAM not in trial.params and "online_corpus_min_prob" not in trial.params
    assert params["online_corpus_min_prob"] == hf_selfspec.SelfSpecParams().online_corpus_min_prob


@pytest.mark.parametrize(
    "switch, lookup, words",
    [
        ("3", "[2, 2]", "search.online_corpus: must be true, false or \\[false, true\\]"),
        ("true", "[0, 2]", "search.online_corpus: is a source of prompt lookup"),
        ("false", "[2, 2]", "search.online_corpus_min_prob: is read only with the online corpus on"),
    ],
    ids=["not-a-switch", "lookup-may-be-off", "knobs-without-the-corpus"],
)
def test_a_bad_switch_names_the_key(tiny_llama_dir, tmp_path, switch, lookup, words):
    path = _config(tmp_path, tiny_llama_dir, switch, lookup)
    with pytest.raises(StudyConfigError, match=f"^{path}: {words}"):
        load_study_config(path)


def test_export_ships_what_the_corpus_learned_and_the_folder_starts_from_it(tuned, tiny_llama_dir, tmp_path):
    study = tuned.outcome.study
    number = next(t.number for t in study.get_trials() if t.params.get(ONLINE_CORPUS_PARAM))
    result = export_profile(tuned.storage, study.study_name, tmp_path / "exported", trial_number=number)
    name = result.profile.params["online_corpus_file"]
    assert name.endswith(".safetensors") and "online" in name
    learned = adapter_files(study.user_attrs["online_corpus_file"])
    for source in learned:
        assert (tmp_path / "exported" / source.name).read_bytes() == source.read_bytes()
    texts = json.loads(learned[1].read_text())["texts"]
    assert texts == study.user_attrs["n_prompts"]

    model, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir),
                                                generation_config=tmp_path / "exported" / "generation_config.json")
    inputs = tokenizer("def add(a, b):", return_tensors="pt")
    plain = model.generate(**inputs, max_new_tokens=8, do_sample=False, strategy="plain")
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False), plain)
    assert hf_selfspec.online_corpus_keys(model) == [], "off unless asked, whatever the profile ships"
    assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False, online_corpus=True), plain)
    assert hf_selfspec.online_corpus(model).texts == texts + 1

    packaged = package(tmp_path / "exported" / "generation_config.json", tmp_path / "package")
    assert name in packaged.profile_files
    bundled = bundled_profiles_for_repository(tmp_path / "package", "someone/tiny")
    assert f"'online_corpus_file': 'hf://someone/tiny@main/{name}'" in bundled
