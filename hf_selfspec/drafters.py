"""Who drafts with a model: the model with sub-layers skipped, its first layers and a trained
adapter, or a separate small model (prompt lookup, which runs none, is `lookup.py`).

A drafter writes its proposals into the sequence buffer right after the committed tokens (the
verifier overwrites whatever it rejects) and returns them with the distributions they were
drawn from, which speculative sampling needs.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from transformers import DynamicCache

from .adapter import DraftAdapter
from .cache import DraftAwareCache, cache_keyword
from .decoding_types import DecodingState, Draft, Drafter, ExitPolicy, StepOutcome
from .layer_skip import SkippingDecoder, decoder_layers
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
    """Feed `sequence[start:length]`, then extend one token at a time until the exit fires
    (`ExitPolicy.exits_after`, the token that trips it kept).

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
        if exit_policy.exits_after(float(distribution.max())):
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
        self.hidden_layer = self.exit_layer

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

    def learn(self, outcome: StepOutcome) -> None:
        verification = outcome.hidden  # these positions follow the committed ones
        if outcome.moved_row is not None:  # an accepted alternative's state takes the rejected token's place
            source_row, target_row = outcome.moved_row
            verification = verification.clone()
            verification[:, target_row] = verification[:, source_row]
        self.backlog.append(verification)

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
