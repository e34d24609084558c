"""Prompt lookup: proposals copied from the text itself, from a lookup corpus or from the online
corpus of the model's earlier calls, at no forward pass.

Code and edits repeat their own context (names, signatures, docstrings), so a matching n-gram
often predicts several tokens at no model cost; where nothing matches, the model's draft still
proposes. A strategy composes the sources (`TextLookup`, `CorpusLookup`, `OnlineLookup`) into a
`PromptLookup`,
which decides at each step where the model may draft which of them, if any, proposes; every
source and every back-off and length within learns from each verification's outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .decoding_types import CORPUS_SOURCE, MODEL_SOURCE, ONLINE_SOURCE, TEXT_SOURCE, DecodingState, Draft, StepOutcome
from .lookup_corpus import LookupCorpus
from .online_corpus import MAX_CONTEXT, OnlineCorpus
from .policies import VERBATIM_REACH, Backoff, DraftSourceChoice, LookupLength


@dataclass
class LookupMatch:
    """Where the text's current n-gram occurred before, and how far back the text agrees there."""

    follow: int  # where the earlier occurrence's continuation starts
    reach: int  # how many of the text's last tokens equal those before `follow` (the n-gram and on)


def earliest_match(sequence: torch.Tensor, min_ngram: int, max_ngram: int, max_reach: int) -> LookupMatch | None:
    """The earliest earlier occurrence of the longest matching suffix n-gram of the 1-D
    `sequence` (None if no n-gram of `min_ngram` to `max_ngram` tokens recurs), with its reach
    counted up to `max_reach`.

    The earliest occurrence, as transformers' prompt lookup takes it: it is usually in the prompt
    (a signature, a docstring example), with a long continuation behind it, while the latest is
    often a repeat a few tokens back whose continuation the end of the text cuts short, so the
    latest occurrence costs more verifications.
    """
    length = sequence.shape[0]
    for ngram in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = sequence[-ngram:]
        windows = sequence[:-1].unfold(0, ngram, 1)  # every earlier n-gram, by start index
        starts = torch.nonzero((windows == pattern).all(dim=1)).flatten()
        if starts.numel():
            start = int(starts[0])
            # windows end before the last token, so a continuation always exists
            back = min(start, max(max_reach - ngram, 0))
            before_match = sequence[start - back : start].flip(0)
            before_end = sequence[length - ngram - back : length - ngram].flip(0)
            agreeing = int((before_match == before_end).cumprod(0).sum()) if back else 0
            return LookupMatch(follow=start + ngram, reach=ngram + agreeing)
    return None


def _written(state: DecodingState, tokens: list[int], source: str) -> Draft:
    """`tokens` proposed by `source`, written after the committed text as every draft is."""
    if tokens:
        state.sequence[0, state.length : state.length + len(tokens)] = torch.tensor(tokens)
    return Draft(tokens=tokens, source=source)


class TextLookup:
    """The continuation of the earliest occurrence of the text's current n-gram, as long as
    `length` says for a match of its reach."""

    def __init__(self, min_ngram: int, max_ngram: int, length: LookupLength):
        self.min_ngram, self.max_ngram, self.length = min_ngram, max_ngram, length
        self.reach = 0  # the reach of the last match looked up (0: none), which the online corpus must beat

    def propose(self, state: DecodingState, max_tokens: int, min_reach: int = 1) -> Draft:
        """Nothing where the match reaches fewer than `min_reach` tokens back."""
        text = state.sequence[0, : state.length]
        match = earliest_match(text, self.min_ngram, self.max_ngram, max(self.length.max_proposal_tokens, min_reach))
        self.reach = 0 if match is None else match.reach
        if match is None or match.reach < min_reach:
            return Draft(source=TEXT_SOURCE)
        tokens = text[match.follow : match.follow + min(max_tokens, self.length.tokens_for(match.reach))]
        return _written(state, tokens.tolist(), TEXT_SOURCE)

    def learn(self, outcome: StepOutcome) -> None:
        if outcome.proposed_by(TEXT_SOURCE):
            self.length.learn(outcome)


class CorpusLookup:
    """What the model itself wrote after the text's current n-gram elsewhere (`LookupCorpus`).

    It keeps a length of its own: the text and the corpus are copied at different rates (a
    translation copies its own text for dozens of tokens while the corpus, in another language,
    is cut at once), and one length for both let each source's cuts shorten the other's
    proposals. It proposes where the text has no match only while its `backoff` lets it
    (`PromptLookup` says why)."""

    def __init__(self, corpus: LookupCorpus, min_ngram: int, max_ngram: int, length: LookupLength, backoff: Backoff):
        self.corpus, self.min_ngram, self.max_ngram = corpus, min_ngram, max_ngram
        self.length, self.backoff = length, backoff

    def propose(self, state: DecodingState, max_tokens: int) -> Draft:
        text = state.sequence[0, : state.length]
        tokens = self.corpus.continuation(text, self.min_ngram, self.max_ngram, min(max_tokens, self.length.tokens))
        return _written(state, tokens, CORPUS_SOURCE)

    def learn(self, outcome: StepOutcome) -> None:
        if outcome.proposed_by(CORPUS_SOURCE):
            self.length.learn(outcome)


class OnlineLookup:
    """What followed the text's current context in the model's earlier calls (`OnlineCorpus`),
    as long as the share of those occurrences agreeing with the proposal stays at `min_prob` or
    above, up to `max_tokens`, from a context of `min_context` tokens or more. It proposes where
    it is asked only while its `backoff` lets it (`PromptLookup` says why)."""

    def __init__(self, corpus: OnlineCorpus, min_ngram: int, max_ngram: int, max_tokens: int, min_prob: float,
                 min_context: int, backoff: Backoff):
        self.corpus, self.min_ngram, self.max_ngram = corpus, min_ngram, max_ngram
        self.max_tokens, self.min_prob, self.min_context, self.backoff = max_tokens, min_prob, min_context, backoff

    def propose(self, state: DecodingState, max_tokens: int, longer_than: int) -> Draft:
        """Nothing where the context found reaches no further back than `longer_than` tokens."""
        text = state.sequence[0, max(0, state.length - MAX_CONTEXT) : state.length].tolist()
        tokens = self.corpus.continuation(text, self.min_ngram, self.max_ngram, min(max_tokens, self.max_tokens),
                                          self.min_prob, max(longer_than, self.min_context - 1))
        return _written(state, tokens, ONLINE_SOURCE)


class PromptLookup:
    """Lookup's sources beside the model's draft: the text first, then the corpus (if any),
    then the model, whose drafts stay within `max_draft_tokens` (0: the model never drafts).
    Where both lookup and the model could propose, `sources` picks which one does.

    The online corpus (if any) goes before the text's own match where its context reaches
    further back than the text's match does: a short match in the text is often chance (a `": "`
    of the JSON the prompt shows), while a longer context in the corpus says the text is going
    the way earlier calls went; where the text's match reaches as far or further (the answer
    copying this request's own prompt), the text is the better evidence.

    Where the text has no match, the corpus and then the model propose only while their
    back-offs (the corpus's own, `model_backoff`) let them: each weighs the steps its source
    proposed against the steps it did not, by which committed tokens more cheaply in this
    request. The loop's own back-off cannot tell: it weighs speculation as a whole, and where
    the text copies (a translation looping on itself) lookup's long accepted runs keep
    speculation ahead, while the proposals at the steps between them, on text the corpus or the
    model predicts poorly (the corpus may not even be in the text's language), are rejected one
    after another and cost more than the plain steps they replace. One back-off for both would
    let the model's rejected drafts silence a corpus that pays (open writing in the corpus's
    own style).
    """

    def __init__(
        self,
        text: TextLookup,
        corpus: CorpusLookup | None,
        sources: DraftSourceChoice,
        model_backoff: Backoff,
        max_draft_tokens: int,
        online: OnlineLookup | None = None,
    ):
        self.text, self.corpus, self.sources, self.online = text, corpus, sources, online
        self.model_backoff, self.max_draft_tokens = model_backoff, max_draft_tokens
        # The back-offs that decided the step being verified, each with the source it governs.
        self.asked: list[tuple[Backoff, str]] = []

    def _text_or_online(self, state: DecodingState, max_tokens: int, ask_backoff: bool) -> Draft:
        """The online corpus's proposal where its context reaches further back than the text's
        match (and, if `ask_backoff`, its back-off lets it), else the text's; empty if neither
        proposes."""
        draft = self.text.propose(state, max_tokens)
        if self.online is None:
            return draft
        online = self.online.propose(state, max_tokens, longer_than=self.text.reach)
        if not online.tokens:
            return draft  # nothing was written over the text's proposal
        if ask_backoff:
            self.asked.append((self.online.backoff, ONLINE_SOURCE))
            if not self.online.backoff.should_speculate():
                return _written(state, draft.tokens, TEXT_SOURCE)
        return online

    def free(self, state: DecodingState, max_tokens: int) -> Draft:
        """What lookup proposes at a step where the model may not draft."""
        draft = self._text_or_online(state, max_tokens, ask_backoff=False)
        if draft.tokens or self.corpus is None:
            return draft
        return self.corpus.propose(state, max_tokens)

    def verbatim(self, state: DecodingState, max_tokens: int) -> Draft:
        """A verbatim repeat of the text (`VERBATIM_REACH`), offered while the loop's back-off
        holds speculation off."""
        return self.text.propose(state, max_tokens, min_reach=VERBATIM_REACH)

    def propose(self, state: DecodingState, max_tokens: int, model_draft: Callable[[int], Draft]) -> Draft:
        """What is proposed at a step where the model may draft (`model_draft(max_tokens)`)."""
        self.asked = []
        draft = self._text_or_online(state, max_tokens, ask_backoff=True)
        if not draft.tokens and self.corpus is not None:
            corpus_draft = self.corpus.propose(state, max_tokens)
            if corpus_draft.tokens:
                self.asked.append((self.corpus.backoff, CORPUS_SOURCE))
                if self.corpus.backoff.should_speculate():
                    draft = corpus_draft
        if not self.max_draft_tokens or (draft.tokens and self.sources.lookup_first()):
            return draft
        if not draft.tokens:
            self.asked.append((self.model_backoff, MODEL_SOURCE))
            if not self.model_backoff.should_speculate():
                return draft  # empty: a plain step
        return model_draft(min(max_tokens, self.max_draft_tokens))

    def learn(self, outcome: StepOutcome) -> None:
        for backoff, source in self.asked:
            backoff.learn(outcome.as_seen_by(source))
        self.asked = []
        self.text.learn(outcome)
        if self.corpus is not None:
            self.corpus.learn(outcome)
        self.sources.learn(outcome)
