"""The shallow-exit draft with a trained adapter (`strategy="kangaroo"`): lossless on every
tiny architecture with a random adapter, and clear errors for adapters that do not fit."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig

import hf_selfspec
from hf_selfspec.adapter import AdapterShape, DraftAdapter, read_adapter, save_adapter
from hf_selfspec.files import adapter_files
from hf_selfspec.profiles import TunedProfile, device_profile_key, write_profile
from helpers.adapters import assert_profile_drafts_losslessly, assert_trained_draft_matches_plain_greedy, random_adapter
from helpers.greedy import assert_same_greedy, random_prompts
from helpers.sampling import exact_joint, goodness_of_fit, sample_counts, sampling_model
from helpers.tiny_models import ARCHITECTURES, NUM_LAYERS, tiny_model

pytestmark = pytest.mark.version_sensitive

KNOBS = [
    {"draft_exit_threshold": 0.0},
    {},
    {"draft_exit_threshold": 0.0, "draft_vocab_size": 24},
]


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
@pytest.mark.parametrize("exit_layer", [1, NUM_LAYERS - 1])
def test_kangaroo_matches_plain_greedy(architecture, exit_layer, tmp_path):
    assert_trained_draft_matches_plain_greedy(
        architecture, lambda model: random_adapter(model, exit_layer, tmp_path, mlp=exit_layer == 1), KNOBS
    )


def test_an_unchanged_copy_of_the_last_layer_is_the_full_model(tmp_path):
    """Exiting before the last layer with an untrained copy of it makes the draft the full model,
    so every drafted token must be accepted: the adapter's own KV (fed from what the verifier
    computed) lines up with the committed text position by position."""
    model = tiny_model("llama", initializer_range=0.3)
    path = save_adapter(DraftAdapter(model, AdapterShape.for_model(model, NUM_LAYERS - 1)), tmp_path / "exact")
    for prompt in random_prompts(96):
        output = assert_same_greedy(model, prompt, strategy="kangaroo", draft_adapter=str(path),
                                    draft_exit_threshold=0.0, max_draft_tokens=4, backoff_probe_interval=0)
        assert output.strategy_stats.drafted_tokens > 0
        assert output.strategy_stats.acceptance_rate == 1.0


@pytest.mark.parametrize(
    "composition",
    [
        dict(strategy="kangaroo", prompt_lookup_tokens=3, prompt_lookup_min_ngram=1),
        dict(strategy="target_confidence_gated", target_confidence_threshold=0.05, prompt_lookup_tokens=3),
        dict(strategy="adaptive_draft_exit"),
        dict(strategy="kangaroo", backoff_probe_interval=2),
    ],
    ids=["lookup", "gate_and_lookup", "adaptive_exit", "backoff"],
)
@pytest.mark.parametrize("architecture", ["gemma2", "qwen2"])
def test_the_adapter_draft_composes_with_lookup_gate_and_backoff(architecture, composition, tmp_path):
    model = tiny_model(architecture, initializer_range=0.3)
    adapter = random_adapter(model, 2, tmp_path)
    for prompt in random_prompts(96):
        assert_same_greedy(model, prompt, draft_adapter=adapter, draft_exit_threshold=0.0, **composition)


def test_sampling_keeps_the_distribution(tmp_path):
    model = sampling_model()
    adapter = random_adapter(model, 1, tmp_path)
    counts = sample_counts(model, seed=2024, strategy="kangaroo", draft_adapter=adapter, draft_exit_threshold=0.0)
    assert goodness_of_fit(counts, exact_joint(model)) > 1e-3


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("qwen3")
    adapter = DraftAdapter(model, AdapterShape.for_model(model, 2, mlp=False))
    path = save_adapter(adapter, tmp_path / "a.safetensors")
    assert adapter_files(path) == (tmp_path / "a.safetensors", tmp_path / "a.json")
    loaded = read_adapter(model, path)
    assert loaded.shape == adapter.shape
    for name, tensor in adapter.trained_state().items():
        torch.testing.assert_close(loaded.trained_state()[name], tensor)
    assert not any(name.startswith("block.mlp.") for name in loaded.trained_state())


def test_a_profile_names_its_adapter_relative_to_its_config(tiny_llama_dir, tmp_path):
    """A profile refers to the adapter by file name; it travels with its generation_config.json."""
    from hf_selfspec.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(tiny_llama_dir))
    save_adapter(DraftAdapter(model, AdapterShape.for_model(model, 2)), tmp_path / "draft.safetensors")
    config = GenerationConfig(eos_token_id=model.config.eos_token_id)
    write_profile(config, device_profile_key("cpu", torch.float32),
                  TunedProfile("kangaroo", {"draft_adapter": "draft.safetensors", "draft_exit_threshold": 0.0}))
    config.save_pretrained(tmp_path)
    model, inputs = assert_profile_drafts_losslessly(tiny_llama_dir, tmp_path / "generation_config.json")

    (tmp_path / "draft.safetensors").unlink()
    with pytest.raises(ValueError, match="draft.safetensors is missing"):
        model.generate(**inputs, max_new_tokens=4)


def _generate_with(model, adapter):
    return model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, strategy="kangaroo", draft_adapter=str(adapter))


def test_an_adapter_for_another_hidden_size_is_refused(tmp_path):
    model = tiny_model("llama")
    path = save_adapter(DraftAdapter(model, AdapterShape.for_model(model, 1)), tmp_path / "a")
    shape = json.loads(adapter_files(path)[1].read_text())
    shape["hidden_size"] = 32
    adapter_files(path)[1].write_text(json.dumps(shape))
    with pytest.raises(ValueError, match="hidden_size 32.*model has 64"):
        _generate_with(model, path)


def test_weights_that_do_not_fit_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    path = save_adapter(DraftAdapter(model, AdapterShape.for_model(model, 1)), tmp_path / "a")
    tensors = load_file(str(path))
    name = next(iter(tensors))
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=f"{name} has shape \\(3, 3\\)"):
        _generate_with(model, path)


@pytest.mark.parametrize("exit_layer", [0, NUM_LAYERS, NUM_LAYERS + 3])
def test_an_exit_layer_out_of_range_is_refused(exit_layer, tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=f"exit layer {exit_layer} is out of range 1..{NUM_LAYERS - 1}"):
        AdapterShape.for_model(model, exit_layer).check_fits(model, "here")
    path = save_adapter(DraftAdapter(model, AdapterShape.for_model(model, 1)), tmp_path / "a")
    shape = json.loads(adapter_files(path)[1].read_text())
    shape["exit_layer"] = exit_layer
    adapter_files(path)[1].write_text(json.dumps(shape))
    with pytest.raises(ValueError, match="out of range"):
        _generate_with(model, path)


def test_kangaroo_needs_an_adapter_and_a_readable_one(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs draft_adapter"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, strategy="kangaroo")
    with pytest.raises(ValueError, match="missing"):
        _generate_with(model, tmp_path / "nothing.safetensors")
    with pytest.raises(ValueError, match="draft_adapter must be a file name"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, strategy="kangaroo", draft_adapter=3)
    assert "kangaroo" in hf_selfspec.available_strategies()


def test_an_explicit_relative_adapter_is_relative_to_the_working_directory(tiny_llama_dir, tmp_path, monkeypatch):
    """Only a profile's file name is anchored to its config's directory; a name passed to
    `generate` is a path like any other, even for a model loaded from a directory."""
    from hf_selfspec.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(tiny_llama_dir))
    save_adapter(DraftAdapter(model, AdapterShape.for_model(model, 1)), tmp_path / "here.safetensors")
    monkeypatch.chdir(tmp_path)
    output = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False, strategy="kangaroo",
                            draft_adapter="here.safetensors", return_dict_in_generate=True)
    assert output.strategy_stats.strategy == "kangaroo"


def test_an_adapter_copied_from_layers_with_transformers_output_hooks_runs_without_them(tmp_path):
    """A kangaroo verification asks transformers for a hidden state, which installs its output
    capture hooks on the model's layers; the adapter's block, a copy of one, must not carry them."""
    model = tiny_model("llama")
    path = random_adapter(model, 1, tmp_path)
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False, strategy="kangaroo",
                   draft_adapter=path)
    assert any(module._forward_hooks for module in model.modules())
    adapter = read_adapter(model, path)
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in adapter.modules())
