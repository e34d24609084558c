"""Studies whose prompt lookup continues into a lookup corpus: the config finds and checks the
file, every trial looks up in it, and export carries it so the exported folder decodes alone."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
from optuna.trial import TrialState
from helpers.tuning import write_study_config

from hf_selfspec.files import adapter_files
from hf_selfspec.cli import main
from hf_selfspec.hub.package import bundled_profiles_for_repository, package
from hf_selfspec.loading import load_model_and_tokenizer
from hf_selfspec.lookup_corpus import save_lookup_corpus
from hf_selfspec.profiles import PROFILE_KEY
from hf_selfspec.tuning import TuningError
from hf_selfspec.tuning.studies.config import StudyConfigError, load_study_config
from hf_selfspec.tuning.studies.export import ExportError, export_profile
from hf_selfspec.tuning.tune import run_tune

N_TRIALS = 2


def _corpus_study_config(directory, model_dir, corpus, lookup_range="[2, 4]"):
    path = write_study_config(
        directory / "corpus.toml", model_dir, f"sqlite:///{directory / 'optuna.db'}",
        strategy="target_confidence_gated", n_prompts=1, max_new_tokens=12,
    )  # fmt: skip
    search = f'[search]\nlookup_corpus = "{corpus}"\nprompt_lookup_tokens = {lookup_range}\n'
    path.write_text(path.read_text().replace("[search]\n", search))
    return path


@pytest.fixture(scope="module")
def tuned(tiny_llama_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus-study")
    model, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir))
    # The model's own writing, so that its proposals are accepted now and then.
    texts = [
        model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=30, do_sample=False, strategy="plain")[0].tolist()
        for prompt in ("def add(a, b):", "class Stack:")
    ]
    save_lookup_corpus(texts, directory / "corpora" / "own-text", model.config.vocab_size, "the tiny model's")
    config = load_study_config(_corpus_study_config(directory, tiny_llama_dir, "corpora/own-text.safetensors"))
    outcome = run_tune(config, n_trials=N_TRIALS, show_progress=False)
    return SimpleNamespace(outcome=outcome, storage=f"sqlite:///{directory / 'optuna.db'}", directory=directory)


def test_the_config_finds_the_corpus_relative_to_itself(tuned, tiny_llama_dir):
    config = load_study_config(_corpus_study_config(tuned.directory, tiny_llama_dir, "corpora/own-text"))
    assert config.search.lookup_corpus == str(tuned.directory / "corpora" / "own-text.safetensors")


@pytest.mark.parametrize(
    "corpus, lookup_range, words",
    [
        ("corpora/absent", "[2, 4]", "lookup corpus file .*absent.safetensors is missing"),
        ("corpora/not-a-corpus", "[2, 4]", "not a lookup corpus description"),
        ("corpora/own-text", "[0, 4]", "extends prompt lookup: give search.prompt_lookup_tokens a range from 1 up"),
    ],
    ids=["missing", "not-a-corpus", "lookup-may-be-off"],
)
def test_a_bad_corpus_names_the_file_and_the_key(tuned, tiny_llama_dir, tmp_path, corpus, lookup_range, words):
    shutil.copytree(tuned.directory / "corpora", tmp_path / "corpora")
    (tmp_path / "corpora" / "not-a-corpus.safetensors").write_bytes(b"")
    (tmp_path / "corpora" / "not-a-corpus.json").write_text('{"format": "something else"}')
    path = _corpus_study_config(tmp_path, tiny_llama_dir, corpus, lookup_range)
    with pytest.raises(StudyConfigError, match=f"^{path}: search.lookup_corpus: .*{words}"):
        load_study_config(path)


def test_every_trial_looks_up_in_the_corpus(tuned):
    trials = [t for t in tuned.outcome.study.get_trials() if t.state.is_finished()]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * N_TRIALS  # lossless, none pruned
    assert all(t.params["prompt_lookup_tokens"] >= 2 for t in trials)
    assert tuned.outcome.study.user_attrs["lookup_corpus"] == str(tuned.directory / "corpora" / "own-text.safetensors")


def test_export_carries_the_corpus_and_the_folder_decodes_with_it(tuned, tiny_llama_dir, tmp_path, capsys):
    output = tmp_path / "exported"
    assert main(["export", "--study", tuned.outcome.study.study_name, "--storage", tuned.storage, "--output", str(output)]) == 0
    assert "Copied its lookup corpus, own-text.safetensors" in capsys.readouterr().out
    profile = json.loads((output / "generation_config.json").read_text())[PROFILE_KEY]["cpu/float32"]
    assert profile["params"]["lookup_corpus"] == "own-text.safetensors"
    for source in adapter_files(tuned.directory / "corpora" / "own-text"):
        assert (output / source.name).read_bytes() == source.read_bytes()

    moved = tmp_path / "moved"
    shutil.move(output, moved)
    model, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir), generation_config=moved / "generation_config.json")
    inputs = tokenizer("def add(a, b):", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
    assert output.strategy_stats.drafted_tokens > 0  # the model's own text, continued from its start
    assert output.sequences.tolist() == model.generate(**inputs, max_new_tokens=16, do_sample=False, strategy="plain").tolist()

    packaged = package(moved / "generation_config.json", tmp_path / "package")
    assert packaged.profile_files == ["own-text.safetensors"]
    assert (tmp_path / "package" / "own-text.json").is_file()
    bundled = bundled_profiles_for_repository(tmp_path / "package", "someone/tiny")
    assert "'lookup_corpus': 'hf://someone/tiny@main/own-text.safetensors'" in bundled


def test_a_rewritten_corpus_is_neither_resumed_into_the_study_nor_exported_as_measured(tuned, tiny_llama_dir, tmp_path):
    tokens, _ = adapter_files(tuned.directory / "corpora" / "own-text")
    measured = tokens.read_bytes()
    tokens.write_bytes(measured[:-1] + bytes([measured[-1] ^ 1]))
    try:
        config = load_study_config(_corpus_study_config(tuned.directory, tiny_llama_dir, "corpora/own-text"))
        with pytest.raises(TuningError, match="looked up in other text under the corpus name own-text.safetensors"):
            run_tune(config, n_trials=1, show_progress=False)
        with pytest.raises(ExportError, match=f"looks up in own-text.safetensors, but {tokens} now holds other contents"):
            export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    finally:
        tokens.write_bytes(measured)
