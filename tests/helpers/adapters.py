"""Draft adapters for tests: random ones that draft poorly, and the check that a profile naming
one drafts and stays lossless."""

from __future__ import annotations

import torch

from hf_selfspec.adapter import AdapterShape, DraftAdapter, save_adapter
from hf_selfspec.draft_heads import HeadsShape, heads_for
from hf_selfspec.loading import load_model_and_tokenizer


def random_adapter(model, exit_layer: int, directory, mlp: bool = True, seed: int = 5) -> str:
    """An adapter whose weights are the copied layer's, perturbed: a poor draft, which is what
    exercises rejections and rollbacks."""
    adapter = DraftAdapter(model, AdapterShape.for_model(model, exit_layer, mlp))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in adapter.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return str(save_adapter(adapter, directory / f"adapter-{exit_layer}-{int(mlp)}"))


def random_heads(model, directory, heads: int = 3, scale: float = 0.5, seed: int = 5, chained: bool = False) -> str:
    """Draft heads (a chain of them where `chained`) with random weights (a poor draft, which
    exercises rejections), or the identity (`scale` 0)."""
    drafted = heads_for(HeadsShape.for_model(model, heads, chained))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafted.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return str(save_adapter(drafted, directory / f"{'chain' if chained else 'heads'}-{heads}-{seed}-{scale}"))


def assert_trained_draft_matches_plain_greedy(architecture: str, draft_file, knobs: list[dict]) -> None:
    """On a tiny model of `architecture`, default and sharp, the draft `draft_file(model)` names
    keeps plain greedy's tokens on each random prompt with its `knobs`, and drafts."""
    from helpers.greedy import assert_same_greedy, random_prompts
    from helpers.tiny_models import tiny_model

    for sharpness in (None, 0.3):
        model = tiny_model(architecture, initializer_range=sharpness)
        draft = draft_file(model)
        drafted = 0
        for prompt, prompt_knobs in zip(random_prompts(model.config.vocab_size), knobs):
            output = assert_same_greedy(
                model, prompt, strategy="kangaroo", draft_adapter=draft, max_draft_tokens=5,
                backoff_probe_interval=0, **prompt_knobs,
            )
            drafted += output.strategy_stats.drafted_tokens
        assert drafted > 0


def assert_profile_drafts_losslessly(model_dir, config_path, text: str = "def add(a, b):"):
    """Load the model with `config_path` as its generation config and check that its profile
    drafts with kangaroo and keeps plain greedy's tokens; returns the model and the inputs."""
    model, tokenizer = load_model_and_tokenizer(str(model_dir), generation_config=config_path)
    inputs = tokenizer(text, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert output.strategy_stats.strategy == "kangaroo" and output.strategy_stats.drafted_tokens > 0
    plain = model.generate(**inputs, max_new_tokens=12, do_sample=False, strategy="plain")
    assert output.sequences.tolist() == plain.tolist()
    return model, inputs
