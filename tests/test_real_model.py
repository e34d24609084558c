"""Losslessness on the real embedded model, SmolLM2-135M-Instruct, on HumanEval prompts."""

from __future__ import annotations

import pytest

import hf_selfspec
from hf_selfspec.prompts import encode_prompt, load_prompts

pytestmark = pytest.mark.real_model
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2():
    return hf_selfspec.load_embedded(generation_config=None)


@pytest.fixture(scope="module")
def prompts_and_plain_outputs(smollm2):
    model, tokenizer = smollm2
    cases = []
    for prompt in load_prompts("humaneval", n=5):
        inputs = encode_prompt(tokenizer, prompt)
        plain = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain")
        cases.append((prompt.id, inputs, plain))
    return cases


@pytest.mark.parametrize(
    "strategy_kwargs",
    [
        {"strategy": "self_speculative"},
        {"strategy": "adaptive_draft_exit"},
        {"strategy": "target_confidence_gated"},
        {"strategy": "adaptive_draft_exit", "attn_skip_layers": list(range(1, 30)), "mlp_skip_layers": [], "draft_exit_threshold": 0.0, "max_draft_tokens": 2},
        {"strategy": "target_confidence_gated", "prompt_lookup_tokens": 8},
    ],
    ids=["self_speculative", "adaptive_draft_exit", "target_confidence_gated", "deep_skip", "prompt_lookup"],
)
def test_strategies_reproduce_plain_greedy_on_humaneval(smollm2, prompts_and_plain_outputs, strategy_kwargs):
    model, _ = smollm2
    drafted = 0
    for prompt_id, inputs, plain in prompts_and_plain_outputs:
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                                **strategy_kwargs)
        assert output.sequences.tolist() == plain.tolist(), prompt_id
        drafted += output.strategy_stats.drafted_tokens
    assert drafted > 0


def test_shipped_profile_is_applied_by_default_and_lossless(prompts_and_plain_outputs):
    """`load_embedded()` applies the profile tuned for this device, and it stays lossless."""
    from hf_selfspec.embedded import TUNED_CONFIG
    from hf_selfspec.profiles import device_profile_key, read_profiles

    model, _ = hf_selfspec.load_embedded()
    key = device_profile_key(model.device, model.dtype)
    profile = read_profiles(model.generation_config).get(key)
    assert profile is not None, f"{TUNED_CONFIG} has no profile for {key}"
    for prompt_id, inputs, plain in prompts_and_plain_outputs:
        output = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
        assert output.strategy_stats.strategy == profile.strategy, prompt_id
        assert output.sequences.tolist() == plain.tolist(), prompt_id
