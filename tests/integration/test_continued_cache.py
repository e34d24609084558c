"""A chat that keeps its cache between turns: `generate(whole_text, past_key_values=cache)`
(`cache=cache` from transformers 5.24).

Plain decoding fills the cache it is given (or one it makes) and leaves it holding the KV of
every token but the newest, so the next turn feeds only the tokens after it. A strategy must do
the same: continue from the cached turns, give plain's tokens, and leave the cache as plain
leaves it, sliding-window layers trimmed to their window and no longer recording their past.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_selfspec import decoding
from hf_selfspec.adapter import AdapterShape, DraftAdapter, save_adapter
from hf_selfspec.cache import CACHE_ARGUMENT, cache_keyword
from helpers.adapters import random_adapter
from helpers.tiny_models import ARCHITECTURES, NUM_LAYERS, SLIDING_WINDOW, tiny_model

pytestmark = pytest.mark.version_sensitive

NEW_TOKENS = 3 * SLIDING_WINDOW + 5  # each turn outgrows the window
SKIP = dict(attn_skip_layers=[1, 3], mlp_skip_layers=[2], max_draft_tokens=5, draft_exit_threshold=0.0)
DRAFTS = {
    "layer_skip_with_alternatives": dict(strategy="self_speculative", draft_alternatives=2, **SKIP),
    "lookup_then_layer_skip": dict(strategy="target_confidence_gated", target_confidence_threshold=0.0,
                                   prompt_lookup_tokens=4, prompt_lookup_min_ngram=1, **SKIP),
    "kangaroo": dict(strategy="kangaroo", max_draft_tokens=5, draft_exit_threshold=0.0),
    # An assistant has a cache of its own, which starts empty and catches up on the whole text.
    "assistant": dict(strategy="target_confidence_gated", target_confidence_threshold=0.0, max_draft_tokens=5,
                      draft_exit_threshold=0.0),
}
CACHES = {"with_config": lambda model: DynamicCache(config=model.config), "lazy": lambda model: DynamicCache()}


def _turns(model, caches: dict, first_prompt: torch.Tensor, replies: list[torch.Tensor], **strategy_kwargs):
    """Decode the chat turn by turn, each turn's prompt the whole text so far, continuing from
    `caches[...]`; the sequences and the cache after each turn."""
    cache, text, turns = caches, first_prompt, []
    for reply in [None, *replies]:
        if reply is not None:
            text = torch.cat([text, reply], dim=1)
        output = model.generate(text, **cache_keyword(cache), max_new_tokens=NEW_TOKENS, do_sample=False,
                                return_dict_in_generate=True, **strategy_kwargs)
        assert getattr(output, CACHE_ARGUMENT) is cache  # filled in place, as plain decoding does
        text = output.sequences
        turns.append((text, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers],
                      cache.get_seq_length()))
    return turns


@pytest.mark.parametrize("cache_kind", sorted(CACHES))
@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_a_chat_continues_from_its_earlier_turns_as_plain_decoding_does(architecture, draft, cache_kind, tmp_path):
    model = tiny_model(architecture, initializer_range=0.3)
    # The back-off off: every step speculates, whatever the steps' timings, so every run checks
    # the same verifications and rollbacks against the cached turns.
    strategy_kwargs = dict(DRAFTS[draft], backoff_probe_interval=0)
    if draft == "kangaroo":
        strategy_kwargs["draft_adapter"] = random_adapter(model, 1, tmp_path)
    if draft == "assistant":
        strategy_kwargs["assistant_model"] = tiny_model(architecture, initializer_range=0.3, seed=1)
    generator = torch.Generator().manual_seed(7)
    first_prompt = torch.randint(1, 96, (1, 9), generator=generator)
    replies = [torch.randint(1, 96, (1, length), generator=generator) for length in (5, 1)]

    plain = _turns(model, CACHES[cache_kind](model), first_prompt, replies, strategy="plain")
    cache = CACHES[cache_kind](model)
    ours = _turns(model, cache, first_prompt, replies, **strategy_kwargs)

    for (plain_text, plain_kv, plain_length), (text, kv, length) in zip(plain, ours):
        assert text.tolist() == plain_text.tolist()
        assert length == plain_length == text.shape[1] - 1
        for (plain_keys, plain_values), (keys, values) in zip(plain_kv, kv, strict=True):
            # Computed in wider passes than plain's one token at a time: equal up to rounding.
            torch.testing.assert_close(keys, plain_keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(values, plain_values, atol=1e-4, rtol=1e-4)
    assert not any(getattr(layer, "record_past", False) for layer in cache.layers)
    # Plain decoding fed the next turn only the new tokens; so did the comparison above, on ours.
    assert all(keys.shape[-2] <= length for keys, _ in kv)


# The tiny Gemma models' greedy text repeats itself, so their drafts are taken whole and no
# runner-up is ever accepted; Qwen2's sliding-window layers stand in for theirs.
@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_runner_up_accepted_on_the_last_step_leaves_its_kv_in_the_cache(architecture, monkeypatch):
    """The step that ends a decode may accept a draft's runner-up and then the verifier's token
    after it. The cache then holds the runner-up's KV, in that token's place, as plain decoding's
    does, or a chat's next turn continues from a wrong state. Every length of decode is tried, so
    that some end on such a step; with the back-off off, which steps those are does not depend on
    timing."""
    model = tiny_model(architecture, initializer_range=0.3)
    verdicts = []
    real_verify = decoding.verify
    monkeypatch.setattr(decoding, "verify", lambda *args: verdicts.append(real_verify(*args)) or verdicts[-1])
    prompt = torch.randint(1, 96, (1, 9), generator=torch.Generator().manual_seed(7))
    ended_on_runner_up = 0
    for new_tokens in range(2, NEW_TOKENS + 1):
        plain_cache, cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        plain = model.generate(prompt, **cache_keyword(plain_cache), max_new_tokens=new_tokens, do_sample=False,
                               strategy="plain")
        verdicts.clear()
        ours = model.generate(prompt, **cache_keyword(cache), max_new_tokens=new_tokens, do_sample=False,
                              backoff_probe_interval=0, **DRAFTS["layer_skip_with_alternatives"])
        assert ours.tolist() == plain.tolist()
        ended_on_runner_up += verdicts[-1].alternative_row is not None
        assert cache.get_seq_length() == plain_cache.get_seq_length()
        for plain_layer, layer in zip(plain_cache.layers, cache.layers, strict=True):
            torch.testing.assert_close(layer.keys, plain_layer.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.values, plain_layer.values, atol=1e-4, rtol=1e-4)
    assert ended_on_runner_up


def test_the_adapter_reads_the_earlier_turns_too(tmp_path):
    """An unchanged copy of the last layer, exiting before it, drafts exactly what the full
    model would, but only if the adapter's attention sees the whole text: the cached turns'
    shallow states, which no verification of this call computed, as well as the new ones."""
    model = tiny_model("llama", initializer_range=0.3)
    exact = str(save_adapter(DraftAdapter(model, AdapterShape.for_model(model, NUM_LAYERS - 1)), tmp_path / "exact"))
    first = model.generate(torch.arange(3, 15)[None], max_new_tokens=10, do_sample=False, strategy="plain")
    cache = DynamicCache(config=model.config)
    model(first[:, :-1], **cache_keyword(cache), use_cache=True)
    text = torch.cat([first, torch.arange(40, 44)[None]], dim=1)
    output = model.generate(text, **cache_keyword(cache), max_new_tokens=NEW_TOKENS, do_sample=False,
                            return_dict_in_generate=True, strategy="kangaroo", draft_adapter=exact,
                            max_draft_tokens=4, draft_exit_threshold=0.0, backoff_probe_interval=0)
    expected = model.generate(text, max_new_tokens=NEW_TOKENS, do_sample=False, strategy="plain")
    assert output.sequences.tolist() == expected.tolist()
    assert output.strategy_stats.drafted_tokens > 0
    assert output.strategy_stats.acceptance_rate == 1.0


# From 5.24 a call may still name the cache `past_key_values`, which transformers maps to `cache`
# only after our checks have read the call.
CALL_NAMES = sorted({CACHE_ARGUMENT, "past_key_values"})


@pytest.mark.parametrize("call_name", CALL_NAMES)
@pytest.mark.parametrize("extra", [0, 3])
def test_a_cache_that_holds_the_whole_prompt_is_refused(extra, call_name):
    model = tiny_model("llama")
    prompt = torch.arange(3, 12)[None]
    cache = DynamicCache(config=model.config)
    model(torch.arange(3, 12 + extra)[None], **cache_keyword(cache), use_cache=True)
    with pytest.raises(ValueError, match=f"{CACHE_ARGUMENT} holding {9 + extra} tokens with a prompt of 9"):
        model.generate(prompt, **{call_name: cache}, max_new_tokens=4, strategy="self_speculative")


def test_caches_a_strategy_cannot_roll_back_are_refused():
    model = tiny_model("llama")
    prompt = torch.arange(3, 12)[None]
    static = StaticCache(config=model.config, max_cache_len=64)
    with pytest.raises(ValueError, match="cannot continue from a StaticCache"):
        model.generate(prompt, **cache_keyword(static), max_new_tokens=4, strategy="self_speculative")
    offloaded = DynamicCache(config=model.config, offloading=True)
    with pytest.raises(ValueError, match="offloaded"):
        model.generate(prompt, **cache_keyword(offloaded), max_new_tokens=4, strategy="self_speculative")
