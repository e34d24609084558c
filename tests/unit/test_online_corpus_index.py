"""The online corpus on its own: counts decide the proposal's length, the bound holds through
any number of texts with the index shrinking as texts go, and the choice between its proposal,
the text's and the model's is made in prompt lookup's one place."""

from __future__ import annotations

import random

import pytest
import torch

from hf_selfspec.decoding_types import MODEL_SOURCE, ONLINE_SOURCE, TEXT_SOURCE, DecodingState, Draft
from hf_selfspec.lookup import OnlineLookup, PromptLookup, TextLookup
from hf_selfspec.online_corpus import INDEXED_NGRAM, OnlineCorpus
from hf_selfspec.policies import Backoff, DraftSourceChoice, LookupLength


def test_the_proposal_goes_on_while_enough_of_the_contexts_occurrences_agree():
    corpus = OnlineCorpus(vocab_size=100)
    for tail in ([4, 5, 6], [4, 5, 6], [4, 5, 7], [4, 8, 9]):
        corpus.add([1, 2, 3, *tail])
    # "1 2 3" occurred four times: all went on with 4, three of four with 5, two of four with 6.
    assert corpus.continuation([1, 2, 3], 1, 2, 8, min_prob=0.5) == [4, 5, 6]
    assert corpus.continuation([1, 2, 3], 1, 2, 8, min_prob=0.6) == [4, 5]
    assert corpus.continuation([1, 2, 3], 1, 2, 8, min_prob=0.8) == [4]
    assert corpus.continuation([1, 2, 3], 1, 2, 2, min_prob=0.1) == [4, 5]
    # The longest suffix decides: "4 8" was followed by 9 alone, and "3 4 8" agrees three tokens
    # back, so it proposes up to three tokens; one that must be longer than three proposes nothing.
    assert corpus.continuation([3, 4, 8], 1, 3, 8, min_prob=0.9) == [9]
    assert corpus.continuation([3, 4, 8], 1, 3, 8, min_prob=0.9, longer_than=3) == []
    # A proposal is no longer than its context: "2 3" agrees two tokens back in [0, 2, 3].
    assert corpus.continuation([0, 2, 3], 1, 2, 8, min_prob=0.5) == [4, 5]
    # A context never seen, or seen only at a text's end, proposes nothing.
    assert corpus.continuation([50, 51], 1, 2, 8, min_prob=0.1) == []
    assert corpus.continuation([9], 1, 1, 8, min_prob=0.1) == []


def test_memory_stays_within_its_bound_after_ten_thousand_texts():
    bound = 5_000
    corpus = OnlineCorpus(vocab_size=50, max_tokens=bound)
    generator = random.Random(0)
    for _ in range(10_000):
        corpus.add([generator.randrange(50) for _ in range(generator.randrange(2, 120))])
        assert corpus.tokens <= bound
    assert corpus.indexed_occurrences <= INDEXED_NGRAM * corpus.tokens
    assert 0 < corpus.texts < 10_000 and corpus.tokens > bound // 2
    corpus.bound(100)
    assert corpus.tokens <= 100 and corpus.indexed_occurrences <= INDEXED_NGRAM * 100
    corpus.clear()
    assert corpus.tokens == corpus.texts == corpus.indexed_occurrences == 0
    assert corpus.continuation([1, 2], 1, 2, 8, min_prob=0.0) == []


def test_evicted_texts_are_no_longer_proposed():
    corpus = OnlineCorpus(vocab_size=100, max_tokens=8)
    corpus.add([1, 2, 3, 4, 5])
    assert corpus.continuation([1, 2], 1, 2, 8, min_prob=0.5) == [3, 4]
    corpus.add([6, 7, 8, 9, 10])  # ten tokens in all: the first text goes
    assert corpus.texts == 1 and corpus.continuation([1, 2], 1, 2, 8, min_prob=0.5) == []
    assert corpus.continuation([6, 7], 1, 2, 8, min_prob=0.5) == [8, 9]
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        OnlineCorpus(vocab_size=100, max_tokens=0)


class _Model:
    """The model's draft, always the same tokens."""

    def propose(self, max_tokens):
        return Draft(tokens=[90, 91][:max_tokens])


def _state(text):
    sequence = torch.zeros((1, 64), dtype=torch.long)
    sequence[0, : len(text)] = torch.tensor(text)
    return DecodingState(sequence, torch.arange(64)[None], len(text))


def test_the_online_corpus_goes_before_the_text_where_its_context_reaches_further_back():
    corpus = OnlineCorpus(vocab_size=100)
    corpus.add([7, 8, 5, 6, 40, 41, 42, 43, 44, 45])
    online = OnlineLookup(corpus, 1, 2, max_tokens=8, min_prob=0.5, min_context=3, backoff=Backoff())
    lookup = PromptLookup(TextLookup(1, 2, LookupLength(3)), None, DraftSourceChoice(), Backoff(), 2, online)

    def proposed(text):
        state = _state(text)
        draft = lookup.propose(state, 16, lambda tokens: _Model().propose(tokens))
        # what lookup proposes is what the verifier will read after the text
        assert draft.source == MODEL_SOURCE or state.sequence[0, state.length : state.length + len(draft.tokens)].tolist() == draft.tokens
        return draft.source, draft.tokens

    # "5 6" recurs in the text with nothing before it; in the corpus "7 8 5 6" agrees four tokens
    # back, and proposes as many tokens as its context is long.
    assert proposed([5, 6, 7, 8, 5, 6]) == (ONLINE_SOURCE, [40, 41, 42, 43])
    # The text's match "1 2 5 6" reaches further back than the corpus's "5 6": the text proposes.
    assert proposed([1, 2, 5, 6, 7, 8, 1, 2, 5, 6]) == (TEXT_SOURCE, [7, 8, 1])
    # A context shorter than min_context proposes nothing: "8 5 6" agrees three tokens back here.
    assert proposed([9, 8, 5, 6]) == (ONLINE_SOURCE, [40, 41, 42])
    assert proposed([9, 9, 5, 6]) == (MODEL_SOURCE, [90, 91])
    # Where the online corpus has nothing, the text's match still proposes; then the model.
    assert proposed([7, 9, 3, 7]) == (TEXT_SOURCE, [9, 3, 7])
    assert proposed([11, 12]) == (MODEL_SOURCE, [90, 91])
