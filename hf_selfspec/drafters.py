"""Who proposes tokens: the model with sub-layers skipped, a separate small model, or prompt lookup.

A drafter writes its proposals into the sequence buffer right after the committed tokens (the
verifier overwrites whatever it rejects) and returns them with the distributions they were
drawn from, which speculative sampling needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from transformers import DynamicCache

from .adapter import DraftAdapter
from .cache import DraftAwareCache, cache_keyword
from .decoding_types import LOOKUP_SOURCE, DecodingState, Draft, Drafter
from .layer_skip import SkippingDecoder, decoder_layers
from .lookup_corpus import LookupCorpus
from .policies import VERBATIM_REACH, Backoff, DraftSourceChoice, ExitPolicy, LookupLength
from .selection import TokenSelector


# (input_ids, position_ids) -> logits `[1, vocab]` at the last position, updating the cache.
NextLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _model_next_logits(model: nn.Module, cache: DraftAwareCache) -> NextLogits:
    def next_logits(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # An assistant model may sit on another device than the text (no copies where it does not).
        return model(
            input_ids=input_ids.to(model.device), position_ids=position_ids.to(model.device),
            **cache_keyword(cache), use_cache=True, logits_to_keep=1,
        ).logits[:, -1].to(input_ids.device)

    return next_logits


def _draft_autoregressively(
    next_logits: NextLogits,
    state: DecodingState,
    start: int,
    max_tokens: int,
    exit_policy: ExitPolicy,
    selector: TokenSelector,
    alternatives: int = 0,
) -> Draft:
    """Feed `sequence[start:length]`, then extend one token at a time until the exit fires.

    The token whose confidence trips the exit is kept: its forward pass is already paid for, and
    keeping it guarantees every drafting round gives the exit policy feedback to adapt on.
    Each token comes with up to `alternatives` runner-ups: the draft's likeliest other tokens
    (a sampled token need not be its likeliest), never one its scores rule out (a restricted
    head's -inf rows, a processor's bans).
    """
    draft = Draft()
    sequence, positions, end = state.sequence, state.positions, state.length
    for _ in range(max_tokens):
        logits = next_logits(sequence[:, start:end], positions[:, start:end])
        scores = selector.scores(sequence[:, :end], logits)
        token, distribution = selector.pick(scores)
        sequence[0, end] = token
        draft.tokens.append(token)
        draft.distributions.append(distribution)
        if alternatives:
            values, indices = (column.tolist() for column in scores[0].topk(alternatives + 1))
            runner_ups = [i for v, i in zip(values, indices) if i != token and v > -float("inf")]
            draft.alternatives.append(runner_ups[:alternatives])
        start, end = end, end + 1
        if float(distribution.max()) < exit_policy.threshold:
            break
    return draft


class RestrictedDraftHead:
    """The LM head over a subset of the vocabulary: the lowest ids plus the prompt's tokens.

    A `subset_size` of 0 or of the vocabulary's size keeps the whole head.

    At batch size one the head's weights dominate a draft step's memory traffic (a fifth of
    SmolLM2-135M); byte-pair vocabularies give frequent tokens low ids, so a few thousand rows
    cover most of what gets generated, and the prompt adds its own identifiers. Tokens outside
    the subset get -inf: the draft cannot propose them, the verifier still can.
    """

    def __init__(self, model: nn.Module, subset_size: int, prompt_ids: torch.Tensor):
        head = model.get_output_embeddings()
        vocab_size = head.weight.shape[0]
        subset_size = subset_size or vocab_size
        low_ids = torch.arange(min(subset_size, vocab_size), device=head.weight.device)
        self.token_ids = torch.unique(torch.cat([low_ids, prompt_ids.flatten().to(low_ids.device)]))
        # A subset that covers the vocabulary is the arange: no copy of the head, no scatter.
        self.covers_vocabulary = len(self.token_ids) == vocab_size
        select = slice(None) if self.covers_vocabulary else self.token_ids
        self.weight = head.weight[select]
        self.bias = head.bias[select] if getattr(head, "bias", None) is not None else None
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.scores = torch.full((1, vocab_size), -float("inf"), dtype=head.weight.dtype, device=head.weight.device)

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[..., len(token_ids)]` over the subset only, in `token_ids` order."""
        logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.covers_vocabulary:
            return self.subset_logits(hidden)
        scores = self.scores.clone()
        scores[0, self.token_ids] = self.subset_logits(hidden)[0]
        return scores


class LayerSkipDrafter(Drafter):
    """The model itself with sub-layers skipped, writing into the verifier's own cache."""

    def __init__(
        self, model: nn.Module, cache: DraftAwareCache, decoder: SkippingDecoder, draft_vocab_size: int = 0,
        alternatives: int = 0,
    ):
        self.model, self.cache, self.decoder = model, cache, decoder
        self.draft_vocab_size, self.alternatives = draft_vocab_size, alternatives
        self.head: RestrictedDraftHead | None = None

    def _next_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(input_ids, position_ids, self.cache)[:, -1])

    def propose(self, state, max_tokens, exit_policy, selector):
        if self.head is None:  # first draft: the committed text is the prompt and one token
            self.head = RestrictedDraftHead(self.model, self.draft_vocab_size, state.sequence[:, : state.length])
        return _draft_autoregressively(
            self._next_logits, state, state.length - 1, max_tokens, exit_policy, selector, self.alternatives
        )


class ShallowExitDrafter(Drafter):
    """Kangaroo: the model's first `exit_layer` layers, then a trained adapter, then the LM head.

    The shallow layers write into the verifier's own cache, so their KV is shared and needs no
    recompute; a draft runs only them (see `SkippingDecoder`). The adapter's attention needs its
    own KV over the shallow hidden states of the committed text: each verification computes
    exactly those as the output of layer `exit_layer - 1` and hands them over (its
    `hidden_states[exit_layer]`), and the next draft feeds them to the adapter first. The shallow
    layers never run twice for one token, and the adapter sees what it was trained on.
    """

    def __init__(
        self, model: nn.Module, cache: DraftAwareCache, adapter: DraftAdapter, draft_vocab_size: int = 0,
        alternatives: int = 0,
    ):
        self.model, self.cache, self.adapter = model, cache, adapter
        self.draft_vocab_size, self.alternatives = draft_vocab_size, alternatives
        self.exit_layer = adapter.shape.exit_layer
        above = tuple(range(self.exit_layer, len(decoder_layers(model))))
        self.shallow_layers = SkippingDecoder(model, above, above)
        self.adapter_cache = DynamicCache()
        self.adapter_length = 0  # committed positions whose shallow states the adapter cache holds
        self.committed_length = 0  # positions the verifier has computed, the adapter's backlog included
        self.backlog: list[torch.Tensor] = []  # shallow states of `adapter_length..committed_length`
        self.head: RestrictedDraftHead | None = None

    def verification_hidden_state(self) -> int:
        return self.exit_layer

    def verified(self, hidden_states: torch.Tensor) -> None:
        self.backlog.append(hidden_states)  # these positions follow the committed ones

    def _next_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        shallow = self.shallow_layers.hidden_states(input_ids, position_ids, self.cache)
        hidden = torch.cat([*self.backlog, shallow], dim=1)
        # Counted back from the newest position on the device: reading it to the host would wait
        # for the shallow layers to finish before the adapter's work could be queued.
        positions = position_ids[:, -1:] + 1 - hidden.shape[1] + torch.arange(hidden.shape[1], device=hidden.device)
        self.backlog = []
        return self.head(self.adapter(hidden, positions, self.adapter_cache)[:, -1])

    def propose(self, state, max_tokens, exit_policy, selector):
        if self.head is None:  # first draft: the committed text is the prompt and one token
            self.head = RestrictedDraftHead(self.model, self.draft_vocab_size, state.sequence[:, : state.length])
        self.adapter_length = self.committed_length  # the backlog enters the adapter cache now
        return _draft_autoregressively(
            self._next_logits, state, state.length - 1, max_tokens, exit_policy, selector, self.alternatives
        )

    def continue_from(self, state: DecodingState, cached_length: int) -> None:
        # The adapter reads the shallow states of the whole text, and no verification computed
        # the cached tokens' here: the shallow layers run over them once, into a scratch cache
        # (the shared one already holds their KV).
        if cached_length:
            shallow = self.shallow_layers.hidden_states(
                state.sequence[:, :cached_length], state.positions[:, :cached_length],
                DraftAwareCache(self.model.config),
            )
            self.backlog, self.committed_length = [shallow], cached_length

    def keep_alternative(self, source_row: int, target_row: int) -> None:
        verification = self.backlog[-1].clone()
        verification[:, target_row] = verification[:, source_row]
        self.backlog[-1] = verification

    def rollback(self, committed_kv_length: int) -> None:
        excess = self.adapter_cache.get_seq_length() - self.adapter_length
        if excess > 0:
            self.adapter_cache.crop(-excess)
        backlog = torch.cat(self.backlog, dim=1) if self.backlog else None
        keep = committed_kv_length - self.adapter_length
        self.backlog = [backlog[:, :keep]] if backlog is not None and keep > 0 else []
        self.committed_length = committed_kv_length


class AssistantDrafter(Drafter):
    """A separate small model with its own cache, catching up on whatever was committed since
    it last drafted (plain steps under a closed gate included)."""

    def __init__(self, assistant: nn.Module):
        self.assistant = assistant
        self.cache = DraftAwareCache(assistant.config)
        self.next_logits = _model_next_logits(assistant, self.cache)
        self.kv_length = 0

    def propose(self, state, max_tokens, exit_policy, selector):
        draft = _draft_autoregressively(
            self.next_logits, state, self.kv_length, max_tokens, exit_policy, selector
        )
        self.kv_length = state.length + len(draft.tokens) - 1
        return draft

    def rollback(self, committed_kv_length: int) -> None:
        self.kv_length = min(self.kv_length, committed_kv_length)
        self.cache.rollback(self.kv_length)


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


class PromptLookupDrafter(Drafter):
    """Copy the continuation of the earliest occurrence of the current n-gram, else what the
    model itself wrote after it elsewhere (a lookup corpus, if given), else fall back to another
    drafter, whose drafts stay within `max_draft_tokens`.

    Code and edits repeat their own context (names, signatures, docstrings), so a matching
    n-gram often predicts several tokens at no model cost; where nothing matches, the model-based
    fallback still proposes. How much of a match is proposed is `length`'s to decide for the
    text and `corpus_length`'s for the corpus: the two are copied at different rates (a
    translation copies its own text for dozens of tokens while the corpus, in another language,
    is cut at once), and one length for both let each source's cuts shorten the other's
    proposals. Where both lookup and the model could propose, `sources` picks which one does;
    all of them learn from every verification.

    Where the text has no match, the corpus and then the model propose only while their
    back-offs (`corpus_backoff`, `model_backoff`) let them: each weighs the steps its source
    proposed against the steps it did not, by which committed tokens more cheaply in this
    request. The loop's own back-off cannot tell: it weighs speculation as a whole, and where
    the text copies (a translation looping on itself) lookup's long accepted runs keep
    speculation ahead, while the proposals at the steps between them, on text the corpus or the
    model predicts poorly (the corpus may not even be in the text's language), are rejected one
    after another and cost more than the plain steps they replace. One back-off for both would
    let the model's rejected drafts silence a corpus that pays (open writing in the corpus's
    own style).
    """

    TEXT, CORPUS, MODEL = "text", "corpus", "model"

    def __init__(
        self,
        fallback: Drafter,
        min_ngram: int,
        max_ngram: int,
        length: LookupLength,
        max_draft_tokens: int,
        sources: DraftSourceChoice,
        model_backoff: Backoff,
        corpus: LookupCorpus | None = None,
        corpus_length: LookupLength | None = None,
        corpus_backoff: Backoff | None = None,
    ):
        if corpus is not None and (corpus_length is None or corpus_backoff is None):
            raise ValueError("a lookup corpus needs a corpus_length and a corpus_backoff of its own")
        self.fallback, self.length, self.sources = fallback, length, sources
        self.corpus, self.corpus_length, self.corpus_backoff = corpus, corpus_length, corpus_backoff
        self.min_ngram, self.max_ngram, self.max_draft_tokens = min_ngram, max_ngram, max_draft_tokens
        self.model_backoff = model_backoff
        # The step being verified: which source proposed (None: a plain step), and the back-offs
        # that decided it, each with the source it governs.
        self.proposer: str | None = None
        self.asked: list[tuple[Backoff, str]] = []

    def propose_free(self, state, max_tokens):
        draft = self._copy_text(state, max_tokens)
        return draft if draft.tokens else self._copy_corpus(state, max_tokens)

    def propose(self, state, max_tokens, exit_policy, selector):
        self.asked = []
        draft = self._copy_text(state, max_tokens)
        if not draft.tokens:
            corpus_draft = self._copy_corpus(state, max_tokens)
            if corpus_draft.tokens:
                self.asked.append((self.corpus_backoff, self.CORPUS))
                if self.corpus_backoff.should_speculate():
                    draft = corpus_draft
        if draft.tokens and self.sources.lookup_first():
            return draft
        if not draft.tokens:
            self.asked.append((self.model_backoff, self.MODEL))
            if not self.model_backoff.should_speculate():
                self.proposer = None
                return draft  # empty: a plain step
        self.proposer = self.MODEL
        return self.fallback.propose(state, min(max_tokens, self.max_draft_tokens), exit_policy, selector)

    def propose_verbatim(self, state, max_tokens):
        return self._copy_text(state, max_tokens, min_reach=VERBATIM_REACH)

    def _copy_text(self, state: DecodingState, max_tokens: int, min_reach: int = 1) -> Draft:
        text = state.sequence[0, : state.length]
        match = earliest_match(text, self.min_ngram, self.max_ngram, max(self.length.max_proposal_tokens, min_reach))
        if match is None or match.reach < min_reach:
            return self._written(state, [], self.TEXT)
        tokens = text[match.follow : match.follow + min(max_tokens, self.length.tokens_for(match.reach))]
        return self._written(state, tokens.tolist(), self.TEXT)

    def _copy_corpus(self, state: DecodingState, max_tokens: int) -> Draft:
        if self.corpus is None:
            return Draft(source=LOOKUP_SOURCE)
        text = state.sequence[0, : state.length]
        tokens = self.corpus.continuation(text, self.min_ngram, self.max_ngram, min(max_tokens, self.corpus_length.tokens))
        return self._written(state, tokens, self.CORPUS)

    def _written(self, state: DecodingState, tokens: list[int], source: str) -> Draft:
        if tokens:
            state.sequence[0, state.length : state.length + len(tokens)] = torch.tensor(tokens)
        self.proposer = source if tokens else None
        return Draft(tokens=tokens, source=LOOKUP_SOURCE)

    def record(self, draft: Draft, accepted: int, committed: int, seconds: float | None) -> None:
        if seconds is not None:
            for backoff, source in self.asked:
                backoff.record(len(draft.tokens) if source == self.proposer else 0, committed, seconds)
        self.asked = []
        if not draft.tokens:
            return
        from_lookup = draft.source == LOOKUP_SOURCE
        if from_lookup:
            (self.length if self.proposer == self.TEXT else self.corpus_length).update(len(draft.tokens), accepted)
        else:
            self.fallback.record(draft, accepted, committed, seconds)
        if seconds is not None:
            self.sources.record(from_lookup, committed, seconds)

    def continue_from(self, state: DecodingState, cached_length: int) -> None:
        self.fallback.continue_from(state, cached_length)

    def rollback(self, committed_kv_length: int) -> None:
        self.fallback.rollback(committed_kv_length)

    def keep_alternative(self, source_row: int, target_row: int) -> None:
        self.fallback.keep_alternative(source_row, target_row)

    def verification_hidden_state(self) -> int | None:
        return self.fallback.verification_hidden_state()

    def verified(self, hidden_states: torch.Tensor) -> None:
        self.fallback.verified(hidden_states)
