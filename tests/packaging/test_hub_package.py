"""`hf-selfspec package`: what the folder holds, that its code is the installed code and decodes
like it, and the errors. Decoding without hf_selfspec installed is in test_zero_install.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.greedy import ragged_batch
from helpers.tiny_models import tiny_model

import hf_selfspec
from hf_selfspec.cli import main
from hf_selfspec.hub import package as packaging
from hf_selfspec.hub.package import PackageError, core_modules, package
from hf_selfspec.profiles import PROFILE_KEY

pytestmark = pytest.mark.version_sensitive

CORE = Path(hf_selfspec.__file__).parent
PROFILE = {
    "strategy": "target_confidence_gated",
    "params": {
        "attn_skip_layers": [2],
        "mlp_skip_layers": [1, 2],
        "target_confidence_threshold": 0.3,
        "prompt_lookup_tokens": 4,
        "backoff_probe_interval": 0,
    },
    "measured": {"speedup": 1.23, "acceptance_rate": 0.45, "study": "tiny-study", "trial": 7},
}


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tuned" / "generation_config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"_from_model_config": True, "eos_token_id": 2, PROFILE_KEY: {"cpu/float32": PROFILE}}))
    return path


def test_cli_writes_the_folder_from_the_installed_modules(config_file, tmp_path, capsys):
    output = tmp_path / "out"
    assert main(["package", "--config", str(config_file), "--output", str(output)]) == 0
    assert f'custom_generate="{output}"' in capsys.readouterr().out

    written = json.loads((output / "generation_config.json").read_text())
    assert "_from_model_config" not in written  # it would make transformers drop the profiles
    assert written[PROFILE_KEY] == {"cpu/float32": PROFILE}

    code = output / "custom_generate"
    assert (code / "generate.py").read_bytes() == (CORE / "hub" / "generate_entry.py").read_bytes()
    copied = sorted(p.stem for p in code.glob("*.py") if p.stem not in ("generate", "bundled_profiles"))
    assert copied == core_modules()
    assert {"mixin", "decoding", "strategies", "verifier", "drafters", "profiles"} <= set(copied)
    for name in copied:
        assert (code / f"{name}.py").read_bytes() == (CORE / f"{name}.py").read_bytes(), name
    bundled: dict = {}
    exec((code / "bundled_profiles.py").read_text(), bundled)
    assert bundled["PROFILES"] == {"cpu/float32": PROFILE}
    assert (code / "requirements.txt").read_text().splitlines() == ["torch>=2.4", "transformers<5.25,>=5.23", "safetensors>=0.4"]

    card = (output / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "| `cpu/float32` | `target_confidence_gated` | 1.23x | 45% |" in card
    assert '"study": "tiny-study"' in card and "custom_generate=" in card


def test_packaged_code_decodes_like_the_installed_plugin(config_file, tmp_path):
    folder = str(package(config_file, tmp_path / "out").folder)
    model = tiny_model("llama", initializer_range=0.3)  # enabled by the installed hf_selfspec
    setattr(model.generation_config, PROFILE_KEY, {"cpu/float32": PROFILE})  # both start from the profile
    enabled_class = type(model)
    input_ids = torch.tensor([[5, 17, 42, 8, 9, 5, 17]])
    common = {"max_new_tokens": 24, "do_sample": False, "return_dict_in_generate": True}
    for kwargs in [
        {},  # the profile's strategy
        {"strategy": PROFILE["strategy"], **PROFILE["params"]},
        {"strategy": "adaptive_draft_exit", "attn_skip_layers": [1, 3], "backoff_probe_interval": 0},
    ]:
        installed = model.generate(input_ids, **common, **kwargs)
        packaged = model.generate(input_ids, **common, **kwargs, custom_generate=folder, trust_remote_code=True)
        assert packaged.sequences.tolist() == installed.sequences.tolist()
        assert type(packaged.strategy_stats).__module__.endswith("custom_generate.stats")  # not the installed one
        for name in ("strategy", "drafted_tokens", "accepted_tokens", "accepted_lengths", "plain_steps"):
            assert getattr(packaged.strategy_stats, name) == getattr(installed.strategy_stats, name), name
        assert packaged.strategy_stats.drafted_tokens > 0
        assert type(model) is enabled_class


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_packaged_code_decodes_a_batch_as_plain_batched_decoding(config_file, tmp_path, architecture):
    """`custom_generate` under a batch: left-padded rows of ragged lengths, some stopping at their
    EOS, each row what plain batched greedy decoding gives it."""
    folder = str(package(config_file, tmp_path / "out").folder)
    model = tiny_model(architecture, initializer_range=0.3)
    for rows in (2, 3, 8):
        input_ids, attention_mask = ragged_batch(96, rows)
        common = {"attention_mask": attention_mask, "max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
        plain = model.generate(input_ids, **common, strategy="plain")
        eos = int(plain[0, input_ids.shape[1] + 4])
        plain = model.generate(input_ids, **common, eos_token_id=eos, strategy="plain")
        packaged = model.generate(input_ids, **common, eos_token_id=eos, custom_generate=folder, trust_remote_code=True,
                                  return_dict_in_generate=True)
        assert packaged.sequences.tolist() == plain.tolist()
        assert packaged.strategy_stats.strategy == PROFILE["strategy"]


def test_a_model_config_without_profiles_uses_the_packaged_ones(config_file, tmp_path):
    folder = str(package(config_file, tmp_path / "out").folder)
    model = tiny_model("qwen3", initializer_range=0.3)
    assert PROFILE_KEY not in model.generation_config.to_dict()
    output = model.generate(
        torch.tensor([[3, 4, 5, 3, 4]]), max_new_tokens=16, return_dict_in_generate=True,
        custom_generate=folder, trust_remote_code=True,
    )  # fmt: skip
    assert output.strategy_stats.strategy == PROFILE["strategy"]
    assert PROFILE_KEY not in model.generation_config.to_dict()  # lent for the call only


def test_an_existing_card_keeps_everything_outside_our_section(config_file, tmp_path):
    output = tmp_path / "model"
    output.mkdir()
    (output / "README.md").write_text("# My model\n\nTrained on love.\n")
    package(config_file, output)
    first = (output / "README.md").read_text()
    assert first.startswith("# My model\n\nTrained on love.\n\n<!-- hf-selfspec:start -->")
    package(config_file, output)
    assert (output / "README.md").read_text() == first


def test_a_core_module_added_later_travels_without_a_list(tmp_path, monkeypatch):
    core = tmp_path / "core"
    shutil.copytree(CORE, core, ignore=shutil.ignore_patterns("__pycache__"))
    (core / "adapter_drafter.py").write_text("from .cache import DraftAwareCache\n")
    strategies = core / "strategies.py"
    strategies.write_text(strategies.read_text() + "\nfrom .adapter_drafter import DraftAwareCache as _Unused\n")
    monkeypatch.setattr(packaging, "CORE_DIR", core)
    assert "adapter_drafter" in core_modules()

    (core / "stats.py").write_text((core / "stats.py").read_text() + "\nimport optuna\n")
    with pytest.raises(PackageError, match=r"hf_selfspec/stats.py imports optuna; the packaged core may import only"):
        core_modules()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--config {config}: no such file"),
        ("{not json", "--config {config}: not valid JSON"),
        ('{"eos_token_id": 2}', "--config {config} holds no self_speculative profile"),
        ('{"self_speculative": {"cpu/float32": {"strategy": "x", "params": {"skip": 1}}}}', "unknown self-speculative"),
    ],
    ids=["missing", "not-json", "no-profile", "bad-profile"],
)
def test_a_bad_config_is_one_line_and_writes_nothing(tmp_path, capsys, content, message):
    config = tmp_path / "generation_config.json"
    if content is not None:
        config.write_text(content)
    assert main(["package", "--config", str(config), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-selfspec package: error: ") and message.format(config=config) in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_an_output_that_is_a_file_is_refused(config_file, tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("keep me")
    assert main(["package", "--config", str(config_file), "--output", str(target)]) == 2
    assert f"--output {target} is a file" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_help_says_what_is_written_and_how_to_use_it(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["package", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in ["--config", "--output", "custom_generate/", "README.md", "trust_remote_code=True"]:
        assert needle in text
