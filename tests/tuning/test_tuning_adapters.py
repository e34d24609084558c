"""Studies that choose among trained draft adapters, and exports that carry the chosen one: the
config checks, a real tune of the tiny model over two random adapters, export, load, generate."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import optuna
import pytest
import torch
from optuna.trial import TrialState
from helpers.adapters import assert_profile_drafts_losslessly, random_adapter
from helpers.tiny_models import tiny_model
from helpers.tuning import write_study_config

from hf_selfspec.cli import main
from hf_selfspec.files import adapter_files
from hf_selfspec.hub.package import PackageError, package
from hf_selfspec.loading import load_model_and_tokenizer
from hf_selfspec.profiles import PROFILE_KEY
from hf_selfspec.tuning import TuningError
from hf_selfspec.tuning.studies.config import StudyConfigError, load_study_config
from hf_selfspec.tuning.studies.export import ExportError, export_profile
from hf_selfspec.tuning.studies.space import ADAPTER_PARAM, decode_params, suggest_params, warm_start_trials
from hf_selfspec.tuning.tune import format_summary, run_tune

N_TRIALS = 3


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Two random adapters for the tiny Llama, exiting after layer 1 and after layer 2, in a
    folder beside where the study configs go."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    directory = tmp_path_factory.mktemp("study")
    for exit_layer in (1, 2):
        random_adapter(model, exit_layer, directory / "adapters")
    return directory


def _adapter_study_config(directory, model_dir, listed, *, strategy="kangaroo", study=""):
    path = write_study_config(
        directory / "adapters.toml", model_dir, f"sqlite:///{directory / 'optuna.db'}",
        strategy=strategy, n_prompts=1, study=study,
    )  # fmt: skip
    text = path.read_text().replace("[search]\n", f"[search]\ndraft_adapters = {json.dumps(listed)}\n")
    path.write_text(text)
    return path


def test_the_config_finds_the_adapters_relative_to_itself(adapters, tiny_llama_dir):
    path = _adapter_study_config(
        adapters, tiny_llama_dir, ["adapters/adapter-1-1", "adapters/adapter-2-1.safetensors"]
    )
    search = load_study_config(path).search
    assert search.strategy == "kangaroo"
    assert search.draft_adapters == {
        "adapter-1-1": str(adapters / "adapters" / "adapter-1-1.safetensors"),
        "adapter-2-1": str(adapters / "adapters" / "adapter-2-1.safetensors"),
    }


@pytest.mark.parametrize(
    "listed, strategy, words",
    [
        (["adapters/absent"], "kangaroo", "absent.safetensors is missing"),
        (["adapters/not-an-adapter"], "kangaroo", "not a draft adapter description"),
        ([], "kangaroo", "strategy 'kangaroo' drafts only with a trained adapter"),
        ("adapters/adapter-1-1", "kangaroo", "must be a list of adapter files"),
        (["adapters/adapter-1-1", "adapter-1-1"], "self_speculative", "two adapters are named 'adapter-1-1'"),
    ],
    ids=["missing", "not-an-adapter", "none-for-kangaroo", "not-a-list", "same-name"],
)
def test_a_bad_adapter_list_names_the_file_and_the_key(adapters, tiny_llama_dir, tmp_path, listed, strategy, words):
    shutil.copytree(adapters / "adapters", tmp_path / "adapters")
    shutil.copy(tmp_path / "adapters" / "adapter-1-1.safetensors", tmp_path / "adapter-1-1.safetensors")
    shutil.copy(tmp_path / "adapters" / "adapter-1-1.json", tmp_path / "adapter-1-1.json")
    (tmp_path / "adapters" / "not-an-adapter.safetensors").write_bytes(b"")
    (tmp_path / "adapters" / "not-an-adapter.json").write_text('{"layers": 3}')
    path = _adapter_study_config(tmp_path, tiny_llama_dir, listed, strategy=strategy)
    with pytest.raises(StudyConfigError) as error:
        load_study_config(path)
    assert str(error.value).startswith(f"{path}: search.draft_adapters:"), error.value
    assert words in str(error.value)


def test_an_adapter_study_chooses_the_adapter_instead_of_a_skip_set(adapters, tiny_llama_dir):
    search = load_study_config(
        _adapter_study_config(adapters, tiny_llama_dir, ["adapters/adapter-1-1", "adapters/adapter-2-1"])
    ).search
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    chosen = set()
    for _ in range(12):
        trial = study.ask()
        params = suggest_params(trial, search, num_layers=4)
        assert not any(name.startswith("skip_") for name in trial.params)
        assert params["draft_adapter"] == search.draft_adapters[trial.params[ADAPTER_PARAM]]
        assert params["attn_skip_layers"] == params["mlp_skip_layers"] == []
        profile_params = decode_params(trial.params, search.strategy, 4)
        assert profile_params["draft_adapter"] == f"{trial.params[ADAPTER_PARAM]}.safetensors"
        chosen.add(trial.params[ADAPTER_PARAM])
        study.tell(trial, 1.0)
    assert chosen == {"adapter-1-1", "adapter-2-1"}
    assert [t[ADAPTER_PARAM] for t in warm_start_trials(search, num_layers=4)] == ["adapter-1-1", "adapter-2-1"]


def test_an_estimated_adapter_study_confirms_its_best_estimate_by_real_decoding(adapters, tiny_llama_dir, tmp_path):
    shutil.copytree(adapters / "adapters", tmp_path / "adapters")
    config = load_study_config(_adapter_study_config(
        tmp_path, tiny_llama_dir, ["adapters/adapter-1-1", "adapters/adapter-2-1"],
        study='objective = "estimated"\nconfirm_top = 1',
    ))  # fmt: skip
    outcome = run_tune(config, n_trials=N_TRIALS, show_progress=False)
    estimated = outcome.study.get_trials(states=(TrialState.COMPLETE,))
    assert len(estimated) == N_TRIALS and {t.params[ADAPTER_PARAM] for t in estimated} == {"adapter-1-1", "adapter-2-1"}
    assert all(t.user_attrs["objective"] == "estimated" and t.user_attrs["draft_adapter"] == t.params[ADAPTER_PARAM]
               for t in estimated)  # fmt: skip
    best = max(estimated, key=lambda trial: trial.value)
    confirmed = outcome.confirmed.get_trials(states=(TrialState.COMPLETE,))
    assert [trial.params for trial in confirmed] == [best.params]
    assert confirmed[0].user_attrs["estimated_speedup"] == best.value


@pytest.fixture(scope="module")
def tuned(adapters, tiny_llama_dir):
    config = load_study_config(
        _adapter_study_config(adapters, tiny_llama_dir, ["adapters/adapter-1-1", "adapters/adapter-2-1"])
    )
    outcome = run_tune(config, n_trials=N_TRIALS, show_progress=False)
    return SimpleNamespace(outcome=outcome, storage=f"sqlite:///{adapters / 'optuna.db'}", directory=adapters)


def test_tune_measures_trials_that_choose_among_the_adapters(tuned):
    trials = tuned.outcome.study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * N_TRIALS  # lossless, none pruned
    assert {t.params[ADAPTER_PARAM] for t in trials} == {"adapter-1-1", "adapter-2-1"}
    for trial in trials:
        assert trial.user_attrs["draft_adapter"] == trial.params[ADAPTER_PARAM]
        assert "skip_ratio" not in trial.user_attrs
    assert "draft adapter" in format_summary(tuned.outcome)


def test_export_carries_the_chosen_adapter_and_the_folder_decodes_with_it(tuned, tiny_llama_dir, tmp_path, capsys):
    output = tmp_path / "exported"
    study = tuned.outcome.study.study_name
    assert main(["export", "--study", study, "--storage", tuned.storage, "--output", str(output)]) == 0
    best = tuned.outcome.best.params[ADAPTER_PARAM]
    assert f"Copied its draft adapter {best}.safetensors" in capsys.readouterr().out
    profile = json.loads((output / "generation_config.json").read_text())[PROFILE_KEY]["cpu/float32"]
    assert profile["strategy"] == "kangaroo"
    assert profile["params"]["draft_adapter"] == f"{best}.safetensors"  # by file name: the folder travels whole
    for source in adapter_files(tuned.directory / "adapters" / best):
        assert (output / source.name).read_bytes() == source.read_bytes()

    moved = tmp_path / "moved"
    shutil.move(output, moved)
    assert_profile_drafts_losslessly(tiny_llama_dir, moved / "generation_config.json", "def fib(n):")

    packaged = package(moved / "generation_config.json", tmp_path / "package")
    assert packaged.profile_files == [f"{best}.safetensors"]
    assert (tmp_path / "package" / f"{best}.safetensors").is_file() and (tmp_path / "package" / f"{best}.json").is_file()


def test_an_adapter_that_no_longer_fits_is_a_clear_error_when_decoding(tuned, tiny_llama_dir, tmp_path):
    export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path)
    best = tuned.outcome.best.params[ADAPTER_PARAM]
    random_adapter(tiny_model("qwen3"), 1, tmp_path)  # written as adapter-1-1: rename it over the exported one
    for written, exported in zip(adapter_files(tmp_path / "adapter-1-1"), adapter_files(tmp_path / best)):
        written.replace(exported)
    model, tokenizer = load_model_and_tokenizer(str(tiny_llama_dir), generation_config=tmp_path / "generation_config.json")
    with pytest.raises(ValueError, match=f"{best}.json: the adapter was trained for model_type 'qwen3'"):
        model.generate(**tokenizer("def f():", return_tensors="pt"), max_new_tokens=4)


def test_export_refuses_when_the_chosen_adapter_is_gone(tuned, tmp_path):
    best = tuned.outcome.best.params[ADAPTER_PARAM]
    weights, _ = adapter_files(tuned.directory / "adapters" / best)
    hidden = weights.rename(tmp_path / weights.name)
    try:
        with pytest.raises(ExportError, match=f"drafts with {best}.safetensors, but draft adapter file {weights} is missing"):
            export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path / "out")
    finally:
        hidden.rename(weights)
    assert not (tmp_path / "out").exists()


def test_package_refuses_a_config_whose_adapter_is_missing(tuned, tmp_path):
    result = export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path / "exported")
    adapter_files(tmp_path / "exported" / result.profile.params["draft_adapter"])[1].unlink()
    with pytest.raises(PackageError, match=r"names draft_adapter 'adapter-\d-1.safetensors', but draft adapter file .*\.json is missing"):
        package(result.path, tmp_path / "package")
    assert not (tmp_path / "package").exists()


def test_export_and_package_never_replace_a_different_adapter_of_the_same_name(tuned, tmp_path):
    """A profile already in DIR may draft with the file that an export would overwrite."""
    best = tuned.outcome.best.params[ADAPTER_PARAM]
    output = tmp_path / "exported"
    export_profile(tuned.storage, tuned.outcome.study.study_name, output)
    weights, _ = adapter_files(output / best)
    export_profile(tuned.storage, tuned.outcome.study.study_name, output)  # the same file again is fine
    config_before = (output / "generation_config.json").read_bytes()
    different = weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 1])
    weights.write_bytes(different)
    with pytest.raises(ExportError, match=f"{weights} already exists and differs from .*not overwritten"):
        export_profile(tuned.storage, tuned.outcome.study.study_name, output)
    assert weights.read_bytes() == different and (output / "generation_config.json").read_bytes() == config_before

    package_dir = tmp_path / "package"
    package_dir.mkdir()
    (package_dir / weights.name).write_bytes(b"another adapter")
    clean = export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path / "clean").path
    with pytest.raises(PackageError, match=f"{package_dir / weights.name} already exists and differs"):
        package(clean, package_dir)
    assert sorted(p.name for p in package_dir.iterdir()) == [weights.name]  # nothing written


def test_a_retrained_adapter_is_neither_resumed_into_the_study_nor_exported_as_measured(tuned, tiny_llama_dir, tmp_path):
    """Retraining keeps an adapter's file name: the study tells the weights apart by digest."""
    best = tuned.outcome.best.params[ADAPTER_PARAM]
    weights, _ = adapter_files(tuned.directory / "adapters" / best)
    measured = weights.read_bytes()
    weights.write_bytes(measured[:-1] + bytes([measured[-1] ^ 1]))  # one weight's lowest bits
    try:
        config = load_study_config(
            _adapter_study_config(tuned.directory, tiny_llama_dir, ["adapters/adapter-1-1", "adapters/adapter-2-1"])
        )
        with pytest.raises(TuningError, match="tuned with other weights under the adapter names adapter-1-1, adapter-2-1"):
            run_tune(config, n_trials=1, show_progress=False)
        assert len(tuned.outcome.study.get_trials()) == N_TRIALS
        with pytest.raises(ExportError, match=f"drafts with {best}.safetensors, but {weights} now holds other contents"):
            export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    finally:
        weights.write_bytes(measured)
    assert export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path / "out").path.is_file()


def test_an_adapter_for_another_model_stops_the_study_before_any_trial(adapters, tiny_llama_dir, tmp_path):
    random_adapter(tiny_model("qwen3"), 1, tmp_path / "adapters")
    config = load_study_config(_adapter_study_config(tmp_path, tiny_llama_dir, ["adapters/adapter-1-1"]))
    with pytest.raises(StudyConfigError, match="search.draft_adapters: 'adapter-1-1' does not fit the model: .*model_type 'qwen3'"):
        run_tune(config, n_trials=1, show_progress=False)
    assert not (tmp_path / "optuna.db").exists() or not optuna.get_all_study_names(f"sqlite:///{tmp_path / 'optuna.db'}")


def test_a_package_in_the_models_directory_drafts_with_its_adapter_through_transformers(tuned, tiny_llama_dir, tmp_path):
    """transformers copies only Python files into its module cache; the adapter is found beside
    the model's own config, where `package` put it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    package(export_profile(tuned.storage, tuned.outcome.study.study_name, tmp_path / "exported").path, model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # transformers' own class, not enabled
    inputs = AutoTokenizer.from_pretrained(model_dir)("def fib(n):", return_tensors="pt")
    common = {"max_new_tokens": 12, "do_sample": False}
    output = model.generate(
        **inputs, **common, custom_generate=str(model_dir), trust_remote_code=True, return_dict_in_generate=True
    )
    assert output.strategy_stats.strategy == "kangaroo" and output.strategy_stats.drafted_tokens > 0
    assert output.sequences.tolist() == model.generate(**inputs, **common).tolist()
