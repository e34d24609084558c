"""Draft heads on the model's final hidden state (`draft_heads.py`), separate or chained:
lossless on every tiny architecture, reading the state the verifier chose each newest token
from, and clear errors for heads that do not fit."""

from __future__ import annotations

import json

import pytest
import torch

from hf_selfspec.adapter import read_adapter
from hf_selfspec.draft_heads import DraftChain, DraftHeads, HeadsShape
from hf_selfspec.decoding import SpeculationParts
from hf_selfspec.decoding_types import MODEL_SOURCE
from hf_selfspec.drafters import DraftHeadsDrafter
from hf_selfspec.files import adapter_files
from helpers.adapters import assert_trained_draft_matches_plain_greedy, random_heads
from helpers.greedy import assert_same_batched_greedy, assert_same_greedy, random_prompts, ragged_batch
from helpers.sampling import exact_joint, goodness_of_fit, sample_counts, sampling_model
from helpers.tiny_models import ARCHITECTURES, tiny_model

pytestmark = pytest.mark.version_sensitive


KNOBS = [
    {"draft_exit_threshold": 0.0},
    {"draft_exit_threshold": 0.0, "draft_vocab_size": 24, "draft_alternatives": 2},
    {"prompt_lookup_tokens": 3, "prompt_lookup_min_ngram": 1, "lookup_alternatives": 2},
]


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_draft_heads_match_plain_greedy(architecture, chained, tmp_path):
    assert_trained_draft_matches_plain_greedy(
        architecture, lambda model: random_heads(model, tmp_path, chained=chained), KNOBS
    )


def _recording_drafts(monkeypatch) -> list[tuple[int, list[int]]]:
    """`(newest committed token, drafted tokens)` of every draft the heads make."""
    seen = []
    propose_rows = DraftHeadsDrafter.propose_rows

    def recording(self, states, limits, exit_policies, selectors):
        drafts = propose_rows(self, states, limits, exit_policies, selectors)
        seen.extend((int(state.sequence[0, state.length - 1]), [int(token) for token in draft.tokens])
                    for state, draft in zip(states, drafts) if draft.tokens)
        return drafts

    monkeypatch.setattr(DraftHeadsDrafter, "propose_rows", recording)
    return seen


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
@pytest.mark.parametrize("alternatives", [0, 3])
def test_an_identity_head_guesses_the_newest_token_again(architecture, alternatives, chained, tmp_path, monkeypatch):
    """An untrained head passes the final state through, so the LM head's choice from it is the
    token that state chose: every draft must be the newest committed token, again and again.
    Any other row of the verification (the wrong accepted position, an alternative's row not
    followed) would guess another token."""
    model = tiny_model(architecture, initializer_range=0.3)
    heads = random_heads(model, tmp_path, heads=2, scale=0.0, chained=chained)
    seen = _recording_drafts(monkeypatch)
    for prompt in random_prompts(model.config.vocab_size):
        assert_same_greedy(model, prompt, strategy="kangaroo", draft_adapter=heads, draft_exit_threshold=0.0,
                           max_draft_tokens=2, backoff_probe_interval=0, draft_alternatives=alternatives)
    assert len(seen) > 10
    assert all(guessed == [newest] * len(guessed) for newest, guessed in seen), seen


@pytest.mark.parametrize("chained", [False, True])
def test_an_identity_head_guesses_the_newest_token_beside_a_lookup_proposal(chained, tmp_path, monkeypatch):
    """Beside a lookup proposal the heads' first guesses are verified where they differ from the
    proposal's first token: an untrained head's best guess is the newest committed token, so
    that is the first alternative offered, and is not offered where lookup proposes it itself.
    Where lookup is wrong and the text repeats its newest token, that guess is taken."""
    model = tiny_model("qwen2", initializer_range=0.3)
    heads = random_heads(model, tmp_path, heads=2, scale=0.0, chained=chained)
    seen = []
    guessed_beside = SpeculationParts.guessed_beside

    def recording(self, state, draft):
        draft = guessed_beside(self, state, draft)
        if draft.source != MODEL_SOURCE and draft.tokens:
            seen.append((int(state.sequence[0, state.length - 1]), draft.tokens[0], draft.alternatives[0]))
        return draft

    monkeypatch.setattr(SpeculationParts, "guessed_beside", recording)
    taken = 0
    for prompt in random_prompts(model.config.vocab_size):
        output = assert_same_greedy(model, prompt, strategy="kangaroo", draft_adapter=heads, max_draft_tokens=3,
                                    draft_exit_threshold=0.0, backoff_probe_interval=0, prompt_lookup_tokens=3,
                                    prompt_lookup_min_ngram=1, lookup_alternatives=2)
        taken += output.strategy_stats.accepted_alternatives
    assert any(newest != first for newest, first, _ in seen)
    assert all(len(offered) == 2 and offered[0] == newest for newest, first, offered in seen if newest != first), seen
    assert all(newest not in offered and len(offered) == 1 for newest, first, offered in seen if newest == first), seen
    assert taken > 0


@pytest.mark.parametrize("chained", [False, True])
def test_an_identity_head_guesses_the_newest_token_in_a_batch(chained, tmp_path, monkeypatch):
    model = tiny_model("qwen2", initializer_range=0.3)
    heads = random_heads(model, tmp_path, heads=2, scale=0.0, chained=chained)
    seen = _recording_drafts(monkeypatch)
    input_ids, attention_mask = ragged_batch(model.config.vocab_size, rows=3)
    assert_same_batched_greedy(model, input_ids, attention_mask, strategy="kangaroo", draft_adapter=heads,
                               draft_exit_threshold=0.0, max_draft_tokens=2, backoff_probe_interval=0)
    assert len(seen) > 10
    assert all(guessed == [newest] * len(guessed) for newest, guessed in seen), seen


@pytest.mark.parametrize("architecture", ["mistral", "gemma2"])
@pytest.mark.parametrize("chained", [False, True])
def test_random_heads_match_plain_greedy_in_a_batch(architecture, chained, tmp_path):
    model = tiny_model(architecture, initializer_range=0.3)
    heads = random_heads(model, tmp_path, chained=chained)
    input_ids, attention_mask = ragged_batch(model.config.vocab_size, rows=3)
    output, _ = assert_same_batched_greedy(model, input_ids, attention_mask, strategy="kangaroo", draft_adapter=heads,
                                           draft_exit_threshold=0.0, max_draft_tokens=3, backoff_probe_interval=0)
    assert output.strategy_stats.drafted_tokens > 0


@pytest.mark.parametrize("chained", [False, True])
def test_sampling_with_heads_keeps_the_distribution(chained, tmp_path):
    model = sampling_model()
    heads = random_heads(model, tmp_path, scale=0.2, chained=chained)
    counts = sample_counts(model, seed=2024, strategy="kangaroo", draft_adapter=heads, draft_exit_threshold=0.0)
    assert goodness_of_fit(counts, exact_joint(model)) > 1e-3


def test_sampling_with_guesses_beside_lookup_keeps_the_distribution(tmp_path):
    model = sampling_model()
    heads = random_heads(model, tmp_path, scale=0.2, chained=True)
    counts = sample_counts(model, seed=2025, strategy="kangaroo", draft_adapter=heads, draft_exit_threshold=0.0,
                           prompt_lookup_tokens=2, prompt_lookup_min_ngram=1, lookup_alternatives=2)
    assert goodness_of_fit(counts, exact_joint(model)) > 1e-3


@pytest.mark.parametrize("chained, kind", [(False, DraftHeads), (True, DraftChain)])
def test_heads_save_and_load_round_trip(chained, kind, tmp_path):
    model = tiny_model("qwen3")
    path = random_heads(model, tmp_path, heads=4, chained=chained)
    loaded = read_adapter(model, path)
    assert isinstance(loaded, kind) and loaded.shape == HeadsShape.for_model(model, 4, chained)
    description = json.loads(adapter_files(path)[1].read_text())
    assert description["format"] == "hf-selfspec-draft-heads/1" and description["chained"] is chained


def test_heads_described_before_chains_load_as_separate_heads(tmp_path):
    model = tiny_model("qwen3")
    path = random_heads(model, tmp_path, heads=2)
    description = json.loads(adapter_files(path)[1].read_text())
    del description["chained"]
    adapter_files(path)[1].write_text(json.dumps(description))
    assert isinstance(read_adapter(model, path), DraftHeads)


@pytest.mark.parametrize(
    "change, message",
    [({"hidden_size": 32}, "hidden_size 32.*model has 64"), ({"heads": 0}, "heads must be a positive integer"),
     ({"model_type": "gpt2"}, "model_type 'gpt2'.*model has 'llama'"), ({"layers": 3}, "unexpected keyword"),
     ({"chained": 1}, "chained must be true or false")],
)
def test_heads_that_do_not_fit_are_refused(change, message, tmp_path):
    model = tiny_model("llama")
    path = random_heads(model, tmp_path)
    shape = {**json.loads(adapter_files(path)[1].read_text()), **change}
    adapter_files(path)[1].write_text(json.dumps(shape))
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, strategy="kangaroo", draft_adapter=path)
