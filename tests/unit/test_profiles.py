"""Tuned profiles in generation_config: format, validation, selection by device."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from hf_selfspec import profiles as profiles_module
from hf_selfspec.embedded import TUNED_CONFIG
from hf_selfspec.profile_files import files_named_by
from hf_selfspec.profiles import (
    PROFILE_KEY,
    TunedProfile,
    device_profile_key,
    device_profile_keys,
    matching_profile,
    parse_profile,
    read_profiles,
    read_profiles_file,
    write_profile,
)
from hf_selfspec.strategies import resolve_strategy
from helpers.tiny_models import tiny_model

# Every generation_config.json that ships, the embedded model's and those beside it to compare with.
SHIPPED_CONFIGS = sorted(Path(str(TUNED_CONFIG)).parents[1].glob("*/*generation_config.json"))
PROMPT = torch.tensor([[7, 8, 9, 10, 11]])
CPU_PROFILE = TunedProfile(
    strategy="adaptive_draft_exit",
    params={"attn_skip_layers": [2], "mlp_skip_layers": [1, 3], "max_draft_tokens": 4, "draft_exit_threshold": 0.0},
    measured={"speedup": 1.2},
)


@pytest.fixture
def amx(monkeypatch):
    """Whether this CPU has AMX, as the profile keys see it: set per test, whatever CPU runs it."""

    def set_amx(present: bool) -> None:
        monkeypatch.setattr(profiles_module, "cpu_has_amx", lambda: present)

    return set_amx


def test_device_key(amx):
    amx(False)
    assert device_profile_key("cpu", torch.float32) == "cpu/float32"
    assert device_profile_key(torch.device("cpu"), torch.bfloat16) == "cpu/bfloat16"
    assert device_profile_keys("cpu", torch.bfloat16) == ("cpu/bfloat16",)
    amx(True)
    assert device_profile_keys("cpu", torch.bfloat16) == ("cpu/amx/bfloat16", "cpu/bfloat16")
    assert device_profile_key("cpu", torch.bfloat16) == "cpu/amx/bfloat16"  # where a tune on it writes
    assert device_profile_keys("cpu", torch.float32) == ("cpu/float32",)  # AMX multiplies no float32


def test_a_cpu_with_amx_prefers_its_own_profile_and_falls_back_to_the_general_one(amx):
    general = TunedProfile("kangaroo", {"prompt_lookup_tokens": 6})
    amx_profile = TunedProfile("kangaroo", {"prompt_lookup_tokens": 10})
    both = {"cpu/bfloat16": general, "cpu/amx/bfloat16": amx_profile}
    amx(True)
    assert matching_profile(both, "cpu", torch.bfloat16) == ("cpu/amx/bfloat16", amx_profile)
    assert matching_profile({"cpu/bfloat16": general}, "cpu", torch.bfloat16) == ("cpu/bfloat16", general)
    assert matching_profile({"cpu/float32": general}, "cpu", torch.bfloat16) == ("cpu/amx/bfloat16", None)
    amx(False)
    assert matching_profile(both, "cpu", torch.bfloat16) == ("cpu/bfloat16", general)
    assert matching_profile({"cpu/amx/bfloat16": amx_profile}, "cpu", torch.bfloat16) == ("cpu/bfloat16", None)


def test_generate_on_a_cpu_with_amx_decodes_with_its_own_profile(amx, caplog):
    model = tiny_model("llama", initializer_range=0.3).to(torch.bfloat16)
    write_profile(model.generation_config, "cpu/bfloat16", CPU_PROFILE)
    write_profile(model.generation_config, "cpu/amx/bfloat16", TunedProfile("self_speculative", {"max_draft_tokens": 2}))
    amx(True)
    on_amx = model.generate(PROMPT, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    assert on_amx.strategy_stats.strategy == "self_speculative"
    assert max(on_amx.strategy_stats.accepted_lengths) <= 2
    amx(False)
    elsewhere = model.generate(PROMPT, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    assert elsewhere.strategy_stats.strategy == "adaptive_draft_exit"
    amx(True)
    only_elsewhere = tiny_model("llama").to(torch.bfloat16)
    write_profile(only_elsewhere.generation_config, "cpu/float32", CPU_PROFILE)
    with caplog.at_level(logging.WARNING, logger="hf_selfspec.profiles"):
        assert only_elsewhere.generate(PROMPT, max_new_tokens=5, do_sample=False, return_dict_in_generate=True).get(
            "strategy_stats") is None
    assert any("but not for cpu/amx/bfloat16 or cpu/bfloat16" in r.getMessage() for r in caplog.records)


def test_profiles_round_trip_and_merge_keeps_other_devices(tmp_path):
    config = GenerationConfig(max_new_tokens=10)
    write_profile(config, "cuda/NVIDIA H100 80GB HBM3/bfloat16", TunedProfile("self_speculative", {"max_draft_tokens": 3}))
    write_profile(config, "cpu/float32", CPU_PROFILE)
    config.save_pretrained(tmp_path)
    loaded = read_profiles(GenerationConfig.from_pretrained(tmp_path))
    assert set(loaded) == {"cpu/float32", "cuda/NVIDIA H100 80GB HBM3/bfloat16"}
    assert loaded["cpu/float32"] == CPU_PROFILE


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"strategy": "self_speculative", "speed": 2}, "unknown profile key 'speed'"),
        ({"params": {}}, "strategy: must be a strategy name"),
        ({"strategy": "self_speculative", "params": {"skip": [1]}}, "unknown self-speculative parameter 'skip'"),
        ({"strategy": "self_speculative", "params": {"max_draft_tokens": "4"}}, "max_draft_tokens must be an int"),
    ],
)
def test_bad_profiles_name_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_profile(raw, "profile")
    with pytest.raises(ValueError, match=message):
        read_profiles({PROFILE_KEY: {"cpu/float32": raw}})


def test_enabled_model_uses_the_profile_for_its_device():
    model = tiny_model("llama", initializer_range=0.3)
    plain = model.generate(PROMPT, max_new_tokens=20, do_sample=False)
    assert not hasattr(plain, "strategy_stats")
    write_profile(model.generation_config, "cpu/float32", CPU_PROFILE)
    tuned = model.generate(PROMPT, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    assert tuned.strategy_stats.strategy == "adaptive_draft_exit"
    assert tuned.strategy_stats.drafted_tokens > 0
    assert tuned.sequences.tolist() == plain.tolist()
    forced_plain = model.generate(PROMPT, max_new_tokens=20, do_sample=False, strategy="plain",
                                  return_dict_in_generate=True)
    assert not hasattr(forced_plain, "strategy_stats") or forced_plain.get("strategy_stats") is None
    # An explicit setting beats the profile's.
    override = model.generate(PROMPT, max_new_tokens=20, do_sample=False, return_dict_in_generate=True,
                              strategy="self_speculative", max_draft_tokens=1)
    assert max(override.strategy_stats.accepted_lengths) <= 1


def test_profile_falls_back_to_plain_where_a_strategy_cannot_run():
    model = tiny_model("llama")
    write_profile(model.generation_config, "cpu/float32", CPU_PROFILE)
    beams = model.generate(PROMPT, max_new_tokens=5, num_beams=2, do_sample=False, return_dict_in_generate=True)
    assert beams.get("strategy_stats") is None
    # A prompt holding the pad token, which transformers masks when no attention_mask is passed
    model.generation_config.pad_token_id = 9
    padded = model.generate(PROMPT, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert padded.get("strategy_stats") is None
    assert padded.sequences.tolist() == model.generate(PROMPT, max_new_tokens=5, do_sample=False,
                                                       strategy="plain").tolist()


def test_profile_for_another_device_warns_once_and_stays_plain(caplog):
    model = tiny_model("llama")
    write_profile(model.generation_config, "cuda/NVIDIA H100 80GB HBM3/bfloat16", CPU_PROFILE)
    with caplog.at_level(logging.WARNING, logger="hf_selfspec.profiles"):
        for _ in range(3):
            output = model.generate(PROMPT, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
            assert output.get("strategy_stats") is None
    warnings = [r for r in caplog.records if "but not for cpu/float32" in r.getMessage()]
    assert len(warnings) == 1


def test_invalid_profile_in_config_is_reported_on_generate():
    model = tiny_model("llama")
    model.generation_config.self_speculative = {"cpu/float32": {"strategy": "self_speculative", "params": {"s1": 1}}}
    with pytest.raises(ValueError, match="unknown self-speculative parameter 's1'"):
        model.generate(PROMPT, max_new_tokens=5, do_sample=False)


def test_a_profiled_model_serves_plainly_as_transformers_own_early_exit_assistant():
    # transformers' early exit calls generate on this same model, as its assistant, with a
    # confidence stopping rule; the profile must not take that inner call over.
    model = tiny_model("llama", initializer_range=0.3)
    write_profile(model.generation_config, "cpu/float32", CPU_PROFILE)
    model.generation_config.assistant_confidence_threshold = 0.4
    plain = model.generate(PROMPT, max_new_tokens=20, do_sample=False, strategy="plain")
    early_exit = model.generate(PROMPT, max_new_tokens=20, do_sample=False, strategy="plain", assistant_early_exit=2)
    assert early_exit.tolist() == plain.tolist()
    as_assistant = model.generate(PROMPT, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                                  output_scores=True, is_assistant=True)
    assert as_assistant.get("strategy_stats") is None
    assert model.generate(PROMPT, max_new_tokens=5, do_sample=False, return_dict_in_generate=True).strategy_stats


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_shipped_profile_reads_and_has_its_files_beside_it(path):
    """The docs pass these files to `--compare-config` and `load_embedded(generation_config=...)`:
    each must read as a model would read it, name known strategies, and carry the adapters and
    corpora it names (a file renamed or retired under a profile that still names it fails here)."""
    profiles = read_profiles_file(path)
    assert profiles
    for profile in profiles.values():
        resolve_strategy(profile.strategy)
    files_named_by(profiles, path.parent)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_shipped_profile_file_serves_a_float32_and_a_bfloat16_cpu(path):
    """A shipped file with a profile for one dtype only leaves a model in the other decoding
    plainly: each serves both dtypes a CPU runs the embedded model in."""
    keys = set(read_profiles_file(path))
    assert "cpu/float32" in keys
    assert keys & {"cpu/bfloat16", "cpu/amx/bfloat16"}
