"""Every bad input to the command line answers in one line on stderr, with exit status 2, before a
model loads or a tune runs, and writes nothing on the way (issue 35)."""

from __future__ import annotations

import json
import socket

import optuna
import pytest
import torch
from helpers.tuning import write_study_config

from hf_selfspec.cli import main
from hf_selfspec.tuning import TuningError
from hf_selfspec.tuning import quickstart as quickstart_module
from hf_selfspec.tuning.studies.config import load_study_config
from hf_selfspec.tuning.studies.export import export_profile
from hf_selfspec.tuning.studies.space import warm_start_trials
from hf_selfspec.tuning.studies.storage import derive_study_name
from hf_selfspec.tuning.tune import run_tune


def _files_under(directory):
    return sorted(path.relative_to(directory) for path in directory.rglob("*"))


def _fails_in_one_line(capsys, argv, *phrases):
    status = main([str(arg) for arg in argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for phrase in phrases:
        assert phrase in err
    return err


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A directory holding a missing name, a directory, a binary file and a valid study config,
    made the working directory so that any stray write shows up in it."""
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "binary.bin").write_bytes(bytes(range(255, -1, -1)) * 4)
    (tmp_path / "study.toml").write_text('[model]\ndtype = "float32"\n')
    monkeypatch.chdir(tmp_path)

    def no_model_load(*args, **kwargs):
        raise AssertionError("a model loaded before the bad input was refused")

    monkeypatch.setattr("hf_selfspec.loading.load_model_and_tokenizer", no_model_load)
    monkeypatch.setattr("hf_selfspec.tuning.studies.toml_reader.load_model_and_tokenizer", no_model_load)
    return tmp_path


# Each subcommand, with the place in its arguments where a file (or a storage) goes.
FILE_COMMANDS = {
    "bench --config": ["bench", "--config", "{}"],
    "bench --compare-config": ["bench", "--compare-config", "{}"],
    "bench --prompts": ["bench", "--prompts", "{}"],
    "bench --draft-adapter": ["bench", "--draft-adapter", "{}"],
    "package": ["package", "--config", "{}", "--output", "out"],
    "tune": ["tune", "{}"],
    "train-adapter": ["train-adapter", "{}"],
    "write-lookup-corpus": ["write-lookup-corpus", "{}"],
    "push --config": ["push", "--config", "{}", "--repo", "org/name"],
    "push --folder": ["push", "--folder", "{}", "--repo", "org/name"],
}
STORAGE_COMMANDS = {
    "tune --storage": ["tune", "study.toml", "--storage", "{}"],
    "export": ["export", "--study", "s", "--output", "out", "--storage", "{}"],
    "dashboard": ["dashboard", "--storage", "{}"],
    "quickstart": ["quickstart", "--output", "out", "--storage", "{}"],
    "optimize": ["optimize", "--model", "embedded", "--output", "out", "--storage", "{}"],
}
BAD_FILES = {"missing": "no-such-file.json", "directory": "a-directory", "binary": "binary.bin"}
BAD_STORAGES = {
    "missing": "sqlite:///no-such.db",  # refused only where a command reads studies
    "directory": "sqlite:///a-directory",
    "binary": "sqlite:///binary.bin",
    "bad URL": "foo://studies",
}


@pytest.mark.parametrize("kind", BAD_FILES)
@pytest.mark.parametrize("command", FILE_COMMANDS)
def test_every_command_refuses_a_bad_file_in_one_line(workspace, capsys, command, kind):
    before = _files_under(workspace)
    argv = [arg.format(BAD_FILES[kind]) for arg in FILE_COMMANDS[command]]
    _fails_in_one_line(capsys, argv, BAD_FILES[kind])
    assert _files_under(workspace) == before


@pytest.mark.parametrize("kind", BAD_STORAGES)
@pytest.mark.parametrize("command", STORAGE_COMMANDS)
def test_every_command_refuses_a_bad_storage_in_one_line(workspace, capsys, command, kind):
    if kind == "missing" and command in ("tune --storage", "quickstart", "optimize"):
        pytest.skip("tune, quickstart and optimize create their storage")
    before = _files_under(workspace)
    argv = [arg.format(BAD_STORAGES[kind]) for arg in STORAGE_COMMANDS[command]]
    _fails_in_one_line(capsys, argv, "storage")
    assert _files_under(workspace) == before  # no empty database at a mistyped path


def test_a_storage_whose_directory_cannot_be_made_is_one_line(workspace, capsys):
    _fails_in_one_line(
        capsys, ["quickstart", "--storage", "sqlite:///binary.bin/sub/optuna.db"], "cannot create its directory"
    )


@pytest.mark.parametrize("port", ["70000", "0"])
def test_dashboard_refuses_a_port_out_of_range(workspace, capsys, port):
    _fails_in_one_line(capsys, ["dashboard", "--port", port], f"--port {port}: not a port number")


def test_dashboard_refuses_a_port_in_use(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    optuna.create_study(storage=storage, study_name="s")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _fails_in_one_line(capsys, ["dashboard", "--storage", storage, "--port", port], f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize(
    "model, message",
    [
        ('name = "./no-such-model"', "model.name: ./no-such-model: no such directory"),
        pytest.param(
            'device = "cuda"',
            "model.device: cuda: CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here"),
        ),
    ],
)
@pytest.mark.parametrize("command", ["tune", "train-adapter", "write-lookup-corpus"])
def test_a_bad_model_section_is_refused_before_loading(workspace, capsys, command, model, message):
    corpus = "[corpus]\ngenerated_tokens = 8\nhumaneval_from = 160\n" if command == "write-lookup-corpus" else ""
    (workspace / "config.toml").write_text(f"[model]\n{model}\n{corpus}")
    _fails_in_one_line(capsys, [command, "config.toml"], message)


def test_write_lookup_corpus_refuses_a_config_with_no_prompts(workspace, capsys):
    (workspace / "corpus.toml").write_text("[corpus]\ngenerated_tokens = 8\n")
    before = _files_under(workspace)
    _fails_in_one_line(capsys, ["write-lookup-corpus", "corpus.toml"], "gives the model no prompts to continue")
    assert _files_under(workspace) == before


@pytest.mark.parametrize(
    "section, message",
    [
        ("[training]\nvocab_size = -5", "training.vocab_size: must be 0 (the whole vocabulary) or positive, got -5"),
        ('[adapter]\nname = "../../escaped{exit_layer}"', "adapter.name: must be a file name without a directory"),
    ],
)
def test_train_adapter_refuses_nonsense(workspace, capsys, section, message):
    (workspace / "train.toml").write_text(section + "\n")
    _fails_in_one_line(capsys, ["train-adapter", "train.toml"], message)


def test_bench_refuses_a_corrupt_draft_adapter_before_loading(workspace, capsys):
    (workspace / "adapter.json").write_text(
        json.dumps({"format": "hf-selfspec-draft-adapter/1", "model_type": "llama", "num_layers": 30,
                    "hidden_size": 576, "exit_layer": 4, "mlp": True})
    )  # fmt: skip
    (workspace / "adapter.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    _fails_in_one_line(capsys, ["bench", "--draft-adapter", "adapter.safetensors"], "not a safetensors file")


def test_quickstart_refuses_an_output_file_before_tuning(workspace, capsys, monkeypatch):
    monkeypatch.setattr(quickstart_module, "run_tune", lambda *a, **k: pytest.fail("the tune ran"))
    before = _files_under(workspace)
    _fails_in_one_line(capsys, ["quickstart", "--output", "binary.bin"], "--output binary.bin: is a file")
    assert _files_under(workspace) == before


def test_a_study_left_without_warm_start_or_context_is_repaired(tiny_llama_dir, tmp_path):
    """A worker killed right after creating the study left it empty: export says so, and the next
    tune enqueues the warm-start trials and saves the context, as at creation."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    config = load_study_config(write_study_config(tmp_path / "study.toml", tiny_llama_dir, storage, n_prompts=1))
    name = derive_study_name(config, "cpu/float32", 1)
    optuna.create_study(storage=storage, study_name=name, direction="maximize")
    with pytest.raises(TuningError, match="has no trials: its tune stopped before the first"):
        export_profile(storage, name, tmp_path / "out")

    run_tune(config, n_trials=0, show_progress=False)  # n_trials=0: set the study up, run nothing
    study = optuna.load_study(storage=storage, study_name=name)
    assert study.user_attrs["strategy"] == "self_speculative" and study.user_attrs["baseline_tokens_per_second"] > 0
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"] for t in waiting] == warm_start_trials(config.search, num_layers=4)

    run_tune(config, n_trials=0, show_progress=False)  # a second run enqueues nothing twice
    assert len(optuna.load_study(storage=storage, study_name=name).get_trials()) == len(waiting)
