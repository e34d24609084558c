"""The draft's runner-ups verified beside its chain (`draft_alternatives`): greedy output stays
plain greedy's, an accepted alternative really adds a token, and what cannot take them says so."""

from __future__ import annotations

import pytest
import torch

from hf_selfspec.alternatives import verification_inputs
from hf_selfspec.cache import DraftAwareCache, cache_keyword
from helpers.adapters import random_adapter
from helpers.greedy import assert_same_greedy, random_prompts
from helpers.tiny_models import NUM_LAYERS, SLIDING_WINDOW, tiny_model

pytestmark = pytest.mark.version_sensitive

FULL_ATTENTION = ["llama", "qwen3"]
# All layers windowed (Mistral), or full and windowed layers mixed, which take a mask per type.
SLIDING_WINDOW_ARCHITECTURES = ["mistral", "qwen2", "gemma2", "gemma3"]
DRAFTS = {
    "layer_skip": {"attn_skip_layers": [1, 3], "mlp_skip_layers": [2]},
    "layer_skip_restricted_head": {"attn_skip_layers": [1, 3], "mlp_skip_layers": [2], "draft_vocab_size": 24},
    "lookup_then_layer_skip": {"attn_skip_layers": [2], "mlp_skip_layers": [2], "prompt_lookup_tokens": 3,
                               "prompt_lookup_min_ngram": 1},
}


def test_a_branch_sees_the_text_before_its_position_and_itself():
    sequence = torch.arange(10, 20)[None]
    positions = torch.arange(10)[None]
    # 4 tokens cached, token 4 committed without KV, 3 drafted tokens at 5-7 with alternatives
    # [] / [30, 31] / [32].
    model = tiny_model("llama")
    input_ids, position_ids, mask = verification_inputs(sequence, positions, 4, 5, 3, [[], [30, 31], [32]], model)
    assert input_ids.tolist() == [[14, 15, 16, 17, 30, 31, 32]]
    assert position_ids.tolist() == [[4, 5, 6, 7, 6, 6, 7]]
    visible = (mask[0, 0] == 0).int().tolist()
    #                  cached      chain 4-7     branches
    assert visible == [[1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
                       [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
                       [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
                       [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                       [1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 0],  # 30 replaces token 6: sees up to 5
                       [1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0],
                       [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1]]  # 32 replaces token 7: sees up to 6
    assert verification_inputs(sequence, positions, 4, 5, 3, [], model)[2] is None


def test_a_sliding_layer_sees_its_window_of_the_keys_its_cache_holds():
    """Gemma2 alternates windowed and full layers: the full ones read every key, the windowed
    ones only the keys their cache layer returns (the newest window - 1 and the new rows), each
    row no further back than the window from its own position, a branch's included."""
    model = tiny_model("gemma2")
    cache = DraftAwareCache(model.config)
    text = 20
    with torch.no_grad():
        model(torch.arange(3, 3 + text)[None], **cache_keyword(cache), use_cache=True)
    sequence, positions = torch.arange(3, 3 + text + 4)[None], torch.arange(text + 4)[None]
    # Every token cached but the newest, committed at 20; 3 drafted at 20-22, an alternative to 21.
    masks = verification_inputs(sequence, positions, text, text + 1, 3, [[], [70], []], model, cache)[2]
    assert set(masks) == {"full_attention", "sliding_attention"}
    full, sliding = (masks[kind][0, 0] == 0 for kind in ("full_attention", "sliding_attention"))
    rows = 4 + 1  # the newest committed token, 3 drafted, 1 alternative
    assert full.shape == (rows, text + rows)
    assert sliding.shape == (rows, SLIDING_WINDOW - 1 + rows)
    query_positions = [20, 21, 22, 23, 22]
    key_positions = list(range(text - SLIDING_WINDOW + 1, text)) + query_positions
    for row, query in enumerate(query_positions):
        seen = [key_positions[k] for k in range(sliding.shape[1]) if sliding[row, k]]
        full_seen = [k for k in range(full.shape[1]) if full[row, k] and k < text]
        assert min(seen) == query - SLIDING_WINDOW + 1 and max(seen) == query
        assert full_seen == list(range(text))


@pytest.mark.parametrize("architecture", FULL_ATTENTION)
@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize("strategy", ["self_speculative", "adaptive_draft_exit", "target_confidence_gated"])
def test_layer_skip_drafts_with_alternatives_match_plain_greedy(architecture, draft, strategy):
    rescued = 0
    for sharpness in (None, 0.3):
        model = tiny_model(architecture, initializer_range=sharpness)
        for prompt in random_prompts(model.config.vocab_size):
            for alternatives in (1, 2):
                output = assert_same_greedy(
                    model, prompt, strategy=strategy, max_draft_tokens=5, draft_exit_threshold=0.0,
                    target_confidence_threshold=0.0, backoff_probe_interval=0, draft_alternatives=alternatives,
                    **DRAFTS[draft],
                )
                rescued += output.strategy_stats.accepted_alternatives
    assert rescued > 0


@pytest.mark.parametrize("architecture", FULL_ATTENTION)
@pytest.mark.parametrize("exit_layer", [1, NUM_LAYERS - 1])
def test_kangaroo_with_alternatives_matches_plain_greedy(architecture, exit_layer, tmp_path):
    """The adapter's own KV is fed from the verifier's shallow states, so an accepted
    alternative's state must move into place there too, or later drafts read the rejected one."""
    rescued = 0
    for sharpness in (None, 0.3):
        model = tiny_model(architecture, initializer_range=sharpness)
        adapter = random_adapter(model, exit_layer, tmp_path, mlp=exit_layer == 1)
        for prompt in random_prompts(model.config.vocab_size):
            for knobs in ({"draft_alternatives": 1}, {"draft_alternatives": 2, "draft_vocab_size": 24}):
                output = assert_same_greedy(
                    model, prompt, strategy="kangaroo", draft_adapter=adapter, max_draft_tokens=5,
                    draft_exit_threshold=0.0, backoff_probe_interval=0, **knobs,
                )
                rescued += output.strategy_stats.accepted_alternatives
    assert rescued > 0


def test_an_accepted_alternative_adds_the_verifiers_next_token():
    """One-token drafts commit one or two tokens a verification, and an alternative turns some
    ones into twos at the same positions, so the branched decode is never behind the chain
    after equally many verifications and ends in fewer once any alternative was accepted."""
    model = tiny_model("llama", initializer_range=0.3)
    knobs = dict(max_new_tokens=40, do_sample=False, return_dict_in_generate=True, strategy="self_speculative",
                 attn_skip_layers=[1, 3], mlp_skip_layers=[2], max_draft_tokens=1, backoff_probe_interval=0)
    chain_steps = branched_steps = rescued = 0
    for prompt in random_prompts(96):
        chain = model.generate(prompt, **knobs).strategy_stats
        branched = model.generate(prompt, draft_alternatives=3, **knobs).strategy_stats
        assert branched.verification_steps + branched.plain_steps <= chain.verification_steps + chain.plain_steps
        chain_steps += chain.verification_steps + chain.plain_steps
        branched_steps += branched.verification_steps + branched.plain_steps
        rescued += branched.accepted_alternatives
    assert rescued > 0 and branched_steps < chain_steps


def test_scores_and_end_of_text_where_an_alternative_was_accepted():
    model = tiny_model("qwen3", initializer_range=0.3)
    prompt = random_prompts(96)[2]
    kwargs = dict(max_new_tokens=30, do_sample=False, return_dict_in_generate=True, output_scores=True)
    plain = model.generate(prompt, strategy="plain", **kwargs)
    ours = model.generate(prompt, strategy="self_speculative", attn_skip_layers=[1, 3], mlp_skip_layers=[2],
                          draft_exit_threshold=0.0, draft_alternatives=2, backoff_probe_interval=0, **kwargs)
    assert ours.strategy_stats.accepted_alternatives > 0
    assert ours.sequences.tolist() == plain.sequences.tolist()
    for mine, theirs in zip(ours.scores, plain.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    # Each generated token in turn as the end of text: decoding stops on it as plain does.
    new_tokens = plain.sequences[0, prompt.shape[1]:].tolist()
    for eos in dict.fromkeys(new_tokens[3:]):
        ended = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos)
        expected = model.generate(prompt, strategy="plain", **ended)
        assert expected.shape[1] < plain.sequences.shape[1]
        assert model.generate(prompt, strategy="self_speculative", attn_skip_layers=[1, 3], mlp_skip_layers=[2],
                              draft_exit_threshold=0.0, draft_alternatives=2, backoff_probe_interval=0,
                              **ended).tolist() == expected.tolist(), eos


@pytest.mark.parametrize("architecture", FULL_ATTENTION)
def test_greedy_with_logits_processors_and_alternatives_matches_plain(architecture):
    """Processors read the text before each position, a branch's its own: the verifier scores
    an alternative's row after the alternative, not after the chain token it replaced."""
    model = tiny_model(architecture)  # default weights: flat enough for a penalty to change choices
    processed = dict(max_new_tokens=30, do_sample=False, repetition_penalty=2.0, no_repeat_ngram_size=2,
                     min_new_tokens=20)
    rescued = 0
    for prompt in random_prompts(model.config.vocab_size):
        expected = model.generate(prompt, strategy="plain", **processed)
        output = model.generate(
            prompt, strategy="self_speculative", max_draft_tokens=5, draft_exit_threshold=0.0, backoff_probe_interval=0,
            draft_alternatives=2, return_dict_in_generate=True, **DRAFTS["layer_skip"], **processed,
        )
        assert output.sequences.tolist() == expected.tolist()
        rescued += output.strategy_stats.accepted_alternatives
    assert rescued > 0


@pytest.mark.parametrize("architecture", SLIDING_WINDOW_ARCHITECTURES)
def test_sliding_window_models_with_alternatives_match_plain_greedy(architecture, tmp_path):
    """The text outgrows the window, so branches are verified against windowed layers whose
    oldest keys are gone, and an accepted branch's KV moves within what the window kept."""
    rescued = 0
    for sharpness in (None, 0.3):
        model = tiny_model(architecture, initializer_range=sharpness)
        adapter = random_adapter(model, 1, tmp_path, mlp=True)
        for prompt in random_prompts(model.config.vocab_size):
            for draft in ({**DRAFTS["layer_skip"], "strategy": "adaptive_draft_exit"},
                          {"strategy": "kangaroo", "draft_adapter": adapter}):
                output = assert_same_greedy(
                    model, prompt, max_draft_tokens=5, draft_exit_threshold=0.0, backoff_probe_interval=0,
                    draft_alternatives=2, **draft,
                )
                rescued += output.strategy_stats.accepted_alternatives
    assert rescued > 0


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"_attn_implementation": "flex_attention"}, "needs attn_implementation 'eager' or 'sdpa'"),
        ({"layer_types": ["full_attention", "chunked_attention"] * (NUM_LAYERS // 2), "attention_chunk_size": 4},
         "does not support llama's chunked_attention layers"),
    ],
)
def test_attention_a_hand_built_mask_cannot_express_refuses_alternatives(settings, message):
    model = tiny_model("llama")
    for name, value in settings.items():
        setattr(model.config, name, value)
    with pytest.raises(ValueError, match=f"draft_alternatives {message}.*use draft_alternatives=0"):
        model.generate(random_prompts(96)[0], max_new_tokens=4, do_sample=False, strategy="self_speculative",
                       draft_alternatives=1)


@pytest.mark.parametrize("knob", ["draft_alternatives", "lookup_alternatives"])
def test_an_assistant_model_refuses_alternatives(knob):
    model, assistant = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    with pytest.raises(ValueError, match=f"{knob} needs the model's own draft"):
        model.generate(random_prompts(96)[0], max_new_tokens=4, do_sample=False, strategy="target_confidence_gated",
                       assistant_model=assistant, **{knob: 1})


@pytest.mark.parametrize("knob", ["draft_alternatives", "lookup_alternatives"])
def test_a_negative_count_is_refused(knob):
    with pytest.raises(ValueError, match=f"{knob} must be >= 0"):
        tiny_model("llama").generate(random_prompts(96)[0], max_new_tokens=4, strategy="self_speculative",
                                     **{knob: -1})
