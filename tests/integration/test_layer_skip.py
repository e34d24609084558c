"""The draft runs the decoder's layers itself: with nothing skipped it must compute exactly
what the model computes, logits and cache alike, on every architecture (the lossless tests cover
what skipping does to the output)."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import ARCHITECTURES, SLIDING_WINDOW, tiny_model

from hf_selfspec.cache import DraftAwareCache, cache_keyword
from hf_selfspec.drafters import RestrictedDraftHead
from hf_selfspec.layer_skip import SkippingDecoder

pytestmark = pytest.mark.version_sensitive

# Longer than the sliding window, so that windowed layers have dropped keys by the end.
TEXT_LENGTH = SLIDING_WINDOW + 5


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_with_nothing_skipped_it_matches_the_model_logits_and_cache(architecture):
    model = tiny_model(architecture)
    text = torch.randint(0, model.config.vocab_size, (1, TEXT_LENGTH + 4), generator=torch.Generator().manual_seed(3))
    model_cache, own_cache = DraftAwareCache(model.config), DraftAwareCache(model.config)
    decoder, head = SkippingDecoder(model), RestrictedDraftHead(model, 0, text)
    # A prefill, then single tokens and a two-token step, as drafts and verifications feed them
    chunks = [(0, TEXT_LENGTH), (TEXT_LENGTH, TEXT_LENGTH + 1), (TEXT_LENGTH + 1, TEXT_LENGTH + 2),
              (TEXT_LENGTH + 2, TEXT_LENGTH + 4)]
    with torch.no_grad():
        for start, end in chunks:
            ids, positions = text[:, start:end], torch.arange(start, end)[None]
            expected = model(input_ids=ids, position_ids=positions, **cache_keyword(model_cache), use_cache=True,
                             logits_to_keep=1).logits[:, -1]
            assert torch.equal(head(decoder(ids, positions, own_cache)[:, -1]), expected), (start, end)
    for index, (theirs, ours) in enumerate(zip(model_cache.layers, own_cache.layers)):
        assert theirs.get_seq_length() == ours.get_seq_length(), index
        assert torch.equal(theirs.keys, ours.keys) and torch.equal(theirs.values, ours.values), index


def test_half_a_layer_of_an_unknown_layout_is_refused_and_a_whole_one_is_skipped():
    model = tiny_model("llama")
    del model.model.layers[1].post_attention_layernorm  # no longer a layout whose halves we know
    with pytest.raises(ValueError, match=r"decoder layer 1 of LlamaForCausalLM \(LlamaDecoderLayer\) has a layout"):
        SkippingDecoder(model, (1,), ())
    assert [index for index, _, _ in SkippingDecoder(model, (1, 2), (1,)).steps] == [0, 2, 3]
