"""`hf-selfspec export` on studies made without running a model: merging, errors, provenance."""

from __future__ import annotations

import json

import optuna
import pytest
from helpers.tuning import make_tuned_looking_study

from hf_selfspec.cli import main
from hf_selfspec.profiles import PROFILE_KEY
from hf_selfspec.tuning.studies.export import ExportError, export_profile


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'optuna.db'}"


def test_export_writes_the_best_trial_over_the_models_own_config(storage, tiny_llama_dir, tmp_path, capsys):
    make_tuned_looking_study(storage, "s", tiny_llama_dir, speedups=(0.8, 1.3, 1.1))
    output = tmp_path / "out"
    assert main(["export", "--study", "s", "--storage", storage, "--output", str(output)]) == 0
    written = json.loads((output / "generation_config.json").read_text())
    model_config = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    assert written["eos_token_id"] == model_config["eos_token_id"]
    profile = written[PROFILE_KEY]["cpu/float32"]
    assert profile["measured"]["trial"] == 1 and profile["measured"]["speedup"] == 1.3
    assert profile["measured"]["study"] == "s"
    assert profile["measured"]["prompts"] == {"source": "humaneval", "n_prompts": 2, "offset": 0, "max_new_tokens": 8}
    assert "speedup" not in profile["params"] and "attn_skip_layers" in profile["params"]
    assert "1.30x" in capsys.readouterr().out
    assert (output / "generation_config.json").stat().st_mode & 0o777 == 0o644  # readable like any model file


def test_export_custom_generate_packages_what_it_exported(storage, tiny_llama_dir, tmp_path, capsys):
    make_tuned_looking_study(storage, "s", tiny_llama_dir)
    output = tmp_path / "out"
    argv = ["export", "--study", "s", "--storage", storage, "--output", str(output), "--custom-generate"]
    assert main(argv) == 0
    assert (output / "custom_generate" / "generate.py").is_file()
    exported = json.loads((output / "generation_config.json").read_text())[PROFILE_KEY]
    bundled: dict = {}
    exec((output / "custom_generate" / "bundled_profiles.py").read_text(), bundled)
    assert bundled["PROFILES"] == exported
    assert "| `cpu/float32` |" in (output / "README.md").read_text()
    assert f'custom_generate="{output}"' in capsys.readouterr().out


def test_export_replaces_this_devices_profile_and_keeps_the_others(storage, tiny_llama_dir, tmp_path):
    make_tuned_looking_study(storage, "s", tiny_llama_dir)
    other = {"strategy": "self_speculative", "params": {"max_draft_tokens": 4}, "measured": {}}
    stale = {"strategy": "self_speculative", "params": {"max_draft_tokens": 1}, "measured": {"trial": -1}}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({PROFILE_KEY: {"cuda/NVIDIA L4/float16": other, "cpu/float32": stale}})
    )
    export_profile(storage, "s", tmp_path)
    profiles = json.loads((tmp_path / "generation_config.json").read_text())[PROFILE_KEY]
    assert profiles["cuda/NVIDIA L4/float16"] == other
    assert profiles["cpu/float32"]["measured"]["trial"] == 1


def test_a_bad_existing_config_names_the_key_and_is_left_alone(storage, tiny_llama_dir, tmp_path, capsys):
    make_tuned_looking_study(storage, "s", tiny_llama_dir)
    bad = json.dumps({PROFILE_KEY: {"cpu/float32": {"strategy": "self_speculative", "params": {"bogus_knob": 1}}}})
    (tmp_path / "generation_config.json").write_text(bad)
    assert main(["export", "--study", "s", "--storage", storage, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bogus_knob" in err and str(tmp_path / "generation_config.json") in err
    assert (tmp_path / "generation_config.json").read_text() == bad


def test_a_study_without_a_completed_trial_gives_a_clear_error(storage, tiny_llama_dir, tmp_path):
    study = make_tuned_looking_study(storage, "s", tiny_llama_dir, speedups=())
    study.tell(study.ask(), state=optuna.trial.TrialState.PRUNED)
    with pytest.raises(ExportError, match="no completed trial yet .*1 pruned"):
        export_profile(storage, "s", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unknown_study_lists_the_ones_there(storage, tiny_llama_dir, tmp_path, capsys):
    make_tuned_looking_study(storage, "present", tiny_llama_dir)
    assert main(["export", "--study", "absent", "--storage", storage, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no study 'absent'" in err and "present" in err


CATEGORIES = {
    "category_speedups": {"translation": 2.4, "conversation": 1.05},
    "category_acceptance": {"translation": 0.8, "conversation": 0.3},
    "category_prompts": {"translation": 2, "conversation": 2},
    "speedup_kind": "category_geometric_mean",
}


def test_a_workload_profile_records_its_categories_and_what_its_speedup_is(storage, tiny_llama_dir, tmp_path):
    make_tuned_looking_study(
        storage, "s", tiny_llama_dir, speedups=(0.8, 1.59), attrs=({}, CATEGORIES),
        prompt_source="workload", n_prompts=4, prompt_split="tune", prompts_per_category=2, category_floor=1.0,
    )  # fmt: skip
    measured = export_profile(storage, "s", tmp_path).profile.measured
    assert measured["trial"] == 1 and measured["speedup_kind"] == "category_geometric_mean"
    assert measured["categories"] == {
        "translation": {"speedup": 2.4, "acceptance_rate": 0.8, "prompts": 2},
        "conversation": {"speedup": 1.05, "acceptance_rate": 0.3, "prompts": 2},
    }
    assert measured["prompts"] == {
        "source": "workload", "n_prompts": 4, "offset": 0, "max_new_tokens": 8, "split": "tune", "per_category": 2,
    }  # fmt: skip
    assert measured["category_floor"] == 1.0


def test_a_trial_below_the_category_floor_is_never_exported(storage, tiny_llama_dir, tmp_path, capsys):
    """Trial 1 is fastest overall but below the floor in one category: trial 2 is exported."""
    make_tuned_looking_study(
        storage, "s", tiny_llama_dir, speedups=(0.8, 1.6, 1.2),
        constraints=({"category_floor": 0.2}, {"category_floor": 0.1}, {"category_floor": -0.05}),
        category_floor=1.0,
    )  # fmt: skip
    assert main(["export", "--study", "s", "--storage", storage, "--output", str(tmp_path)]) == 0
    profile = json.loads((tmp_path / "generation_config.json").read_text())[PROFILE_KEY]["cpu/float32"]
    assert profile["measured"]["trial"] == 2
    assert "Passed over trials below the study's category floor: 0, 1" in capsys.readouterr().out


def test_a_study_with_no_trial_above_its_floor_exports_nothing(storage, tiny_llama_dir, tmp_path):
    make_tuned_looking_study(
        storage, "s", tiny_llama_dir, speedups=(1.3, 1.6), constraints=({"category_floor": 0.2},) * 2,
        category_floor=1.0,
    )  # fmt: skip
    with pytest.raises(ExportError, match="no trial that meets its category floor: all 2 complete trials"):
        export_profile(storage, "s", tmp_path / "out")
    assert not (tmp_path / "out").exists()
