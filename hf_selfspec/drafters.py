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
from .draft_heads import DraftChain, DraftHeads
from .cache import DraftAwareCache, Realignment, cache_keyword, drop_columns, keep_rows, shift_rows
from .decoding_types import DecodingState, Draft, Drafter, ExitPolicy, StepOutcome
from .layer_skip import SkippingDecoder, decoder_layers
from .batch import quorum_rows
from .selection import TokenSelector


# (input_ids, position_ids) -> logits `[rows, vocab]` at the last position, updating the cache.
NextLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _model_next_logits(model: nn.Module, cache: DraftAwareCache) -> NextLogits:
    def next_logits(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # An assistant model may sit on another device than the text (no copies where it does not).
        padding = cache.padding_mask(cache.get_seq_length() + input_ids.shape[1], model.device)
        return model(
            input_ids=input_ids.to(model.device), position_ids=position_ids.to(model.device), attention_mask=padding,
            **cache_keyword(cache), use_cache=True, logits_to_keep=1,
        ).logits[:, -1].to(input_ids.device)

    return next_logits


def _inputs(states: list[DecodingState], ends: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, position_ids)`: each row's `width` tokens before its `ends` entry; in a batch,
    a row with fewer repeats its first where the columns before it are its padding."""
    if len(states) == 1:  # views, no copies
        return states[0].sequence[:, ends[0] - width : ends[0]], states[0].positions[:, ends[0] - width : ends[0]]
    device = states[0].sequence.device
    index = [(torch.arange(end - width, end, device=device)).clamp(min=0) for end in ends]
    return (
        torch.cat([state.sequence[:, columns] for state, columns in zip(states, index)]),
        torch.cat([state.positions[:, columns] for state, columns in zip(states, index)]),
    )


def _draft_autoregressively(
    next_logits: NextLogits,
    states: list[DecodingState],
    width: int,
    limits: list[int],
    exit_policies: list[ExitPolicy],
    selectors: list[TokenSelector],
    alternatives: int = 0,
    quorum: float = 0.0,
) -> list[Draft]:
    """Feed each row's last `width` committed tokens, then extend each row one token at a time
    until its exit fires (`ExitPolicy.exits_after`, the token that trips it kept) or it has its
    `limits` entry of tokens; a batch's rows step together while any of them drafts, the others
    feeding their last token again (KV the rollback drops), and only while `quorum_rows` of them
    draft: each step of the draft costs every row.

    Each token comes with up to `alternatives` runner-ups (`_draft_token`).
    """
    drafts = [Draft() for _ in states]
    drafting = [limit > 0 for limit in limits]
    ends = [state.length for state in states]
    needed = quorum_rows(quorum, len(states))
    input_ids, position_ids = _inputs(states, ends, width)
    while sum(drafting) >= needed:
        logits = next_logits(input_ids, position_ids)
        for row, (state, draft) in enumerate(zip(states, drafts)):
            if not drafting[row]:
                continue
            confidence = _draft_token(draft, selectors[row], state, ends[row], logits[row : row + 1], alternatives)
            ends[row] += 1
            exits = exit_policies[row].exits_after(confidence)
            drafting[row] = not exits and len(draft.tokens) < limits[row]
        input_ids, position_ids = _inputs(states, ends, 1)
    return drafts


def _draft_token(
    draft: Draft, selector: TokenSelector, state: DecodingState, end: int, logits: torch.Tensor, alternatives: int
) -> float:
    """Pick the token at `end` of `state.sequence` from the draft's `logits` `[1, vocab]` as the
    selector picks after the text before it, write it there and add it to `draft`, with up to
    `alternatives` runner-ups: the draft's likeliest other tokens (a sampled token need not be
    its likeliest), never one its scores rule out (a restricted head's -inf rows, a processor's
    bans). Returns the draft's top probability there, the exit policy's input."""
    scores = selector.scores(state.sequence[:, :end], logits)
    token, distribution = selector.pick(scores)
    state.sequence[0, end] = token
    draft.tokens.append(token)
    draft.distributions.append(distribution)
    if alternatives:
        values, indices = (column.tolist() for column in scores[0].topk(alternatives + 1))
        draft.alternatives.append([i for v, i in zip(values, indices) if i != token and v > -float("inf")][:alternatives])
    return float(distribution.max())


class RestrictedDraftHead:
    """The LM head over a subset of the vocabulary: the lowest ids plus the prompt's tokens (every
    row's, in a batch).

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
        """Logits `[rows, vocab]` for the hidden states `[rows, hidden]`."""
        if self.covers_vocabulary:
            return self.subset_logits(hidden)
        scores = self.scores.expand(hidden.shape[0], -1).clone()
        scores[:, self.token_ids] = self.subset_logits(hidden)
        return scores


class LayerSkipDrafter(Drafter):
    """The model itself with sub-layers skipped, writing into the verifier's own cache."""

    def __init__(
        self, model: nn.Module, cache: DraftAwareCache, decoder: SkippingDecoder, draft_vocab_size: int = 0,
        alternatives: int = 0, batch_quorum: float = 0.0,
    ):
        self.model, self.cache, self.decoder = model, cache, decoder
        self.draft_vocab_size, self.alternatives, self.batch_quorum = draft_vocab_size, alternatives, batch_quorum
        self.head: RestrictedDraftHead | None = None

    def _next_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(input_ids, position_ids, self.cache)[:, -1])

    def propose(self, state, max_tokens, exit_policy, selector):
        return self.propose_rows([state], [max_tokens], [exit_policy], [selector])[0]

    def propose_rows(self, states, limits, exit_policies, selectors):
        if self.head is None:  # first draft: each text is its prompt and one token
            self.head = _draft_head(self.model, self.draft_vocab_size, states)
        # A batch's rows are verified without alternatives (`Batch.verification_inputs`).
        alternatives = self.alternatives if len(states) == 1 else 0
        return _draft_autoregressively(
            self._next_logits, states, 1, limits, exit_policies, selectors, alternatives, self.batch_quorum
        )


def _draft_head(model: nn.Module, subset_size: int, states: list[DecodingState]) -> RestrictedDraftHead:
    prompts = torch.cat([state.sequence[0, : state.length] for state in states])
    return RestrictedDraftHead(model, subset_size, prompts)


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
        alternatives: int = 0, batch_quorum: float = 0.0,
    ):
        self.model, self.cache, self.adapter = model, cache, adapter
        self.draft_vocab_size, self.alternatives, self.batch_quorum = draft_vocab_size, alternatives, batch_quorum
        self.exit_layer = adapter.shape.exit_layer
        above = tuple(range(self.exit_layer, len(decoder_layers(model))))
        self.shallow_layers = SkippingDecoder(model, above, above)
        self.adapter_cache = DynamicCache()
        self.adapter_length = 0  # committed positions whose shallow states the adapter cache holds
        self.committed_length = 0  # positions the verifier has computed, the adapter's backlog included
        self.backlog: list[torch.Tensor] = []  # shallow states of `adapter_length..committed_length`
        self.verified_starts: tuple[int, ...] | None = None  # the rows' first columns when the backlog was verified
        self.head: RestrictedDraftHead | None = None
        self.hidden_layer = self.exit_layer

    def _next_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        shallow = self.shallow_layers.hidden_states(input_ids, position_ids, self.cache)
        hidden = torch.cat([*self.backlog, shallow], dim=1)
        # Counted back from the newest position on the device: reading it to the host would wait
        # for the shallow layers to finish before the adapter's work could be queued.
        positions = position_ids[:, -1:] + 1 - hidden.shape[1] + torch.arange(hidden.shape[1], device=hidden.device)
        self.backlog = []
        mask = self._adapter_mask(hidden, self.cache.starts)
        return self.head(self.adapter(hidden, positions, self.adapter_cache, mask)[:, -1])

    def _adapter_mask(self, hidden: torch.Tensor, starts: tuple[int, ...] | None) -> torch.Tensor | None:
        """The adapter's mask for `hidden` after what its cache holds, whose columns are the shared
        cache's: causal, each row's padding (from its column `starts`) hidden. None without
        padding: the adapter's own causal mask."""
        if starts is None:
            return None
        past, queries = self.adapter_cache.get_seq_length(), hidden.shape[1]
        keys = torch.arange(past + queries, device=hidden.device)
        causal = keys[None, :] <= past + torch.arange(queries, device=hidden.device)[:, None]
        visible = causal[None] & (keys[None, None, :] >= torch.tensor(starts, device=hidden.device)[:, None, None])
        mask = torch.zeros(visible.shape, dtype=hidden.dtype, device=hidden.device)
        return mask.masked_fill(~visible, torch.finfo(hidden.dtype).min)[:, None]

    def propose(self, state, max_tokens, exit_policy, selector):
        return self.propose_rows([state], [max_tokens], [exit_policy], [selector])[0]

    def propose_rows(self, states, limits, exit_policies, selectors):
        if self.head is None:  # first draft: each text is its prompt and one token
            self.head = _draft_head(self.model, self.draft_vocab_size, states)
        self.adapter_length = self.committed_length  # the backlog enters the adapter cache now
        alternatives = self.alternatives if len(states) == 1 else 0
        return _draft_autoregressively(
            self._next_logits, states, 1, limits, exit_policies, selectors, alternatives, self.batch_quorum
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
        self.verified_starts = self.cache.starts  # the columns the backlog's states stand at, until `realign`

    def rollback(self, committed_kv_length: int) -> None:
        self.realign(Realignment(committed_kv_length))

    def realign(self, realignment: Realignment) -> None:
        """The adapter cache and the backlog cover the shared cache's columns, first the one then
        the other, and move as its rows move. Where rows move right, the backlog enters the
        adapter cache first: it then moves with the rest (a row's states that would fall past
        the adapter cache's end could not be fed again)."""
        self._crop_adapter_cache()  # the draft's own entries
        if any(realignment.shifts):
            self._feed_backlog(self.verified_starts)
            shift_rows(self.adapter_cache.layers, realignment.shifts)
            self.adapter_length = min(self.adapter_length, realignment.kv_length)
            self._crop_adapter_cache()
        backlog = torch.cat(self.backlog, dim=1) if self.backlog else None
        keep = realignment.kv_length - self.adapter_length
        backlog = backlog[:, :keep] if backlog is not None and keep > 0 else None
        if realignment.kept_rows is not None:
            keep_rows(self.adapter_cache.layers, realignment.kept_rows)
            backlog = None if backlog is None else backlog[list(realignment.kept_rows)]
        dropped = min(realignment.dropped_columns, self.adapter_length)
        drop_columns(self.adapter_cache.layers, dropped)
        self.adapter_length -= dropped
        if backlog is not None and realignment.dropped_columns > dropped:
            backlog = backlog[:, realignment.dropped_columns - dropped :]
        self.backlog = [] if backlog is None else [backlog]
        self.committed_length = realignment.kv_length - realignment.dropped_columns

    def _crop_adapter_cache(self) -> None:
        excess = self.adapter_cache.get_seq_length() - self.adapter_length
        if excess > 0:
            self.adapter_cache.crop(-excess)

    def _feed_backlog(self, starts: tuple[int, ...] | None) -> None:
        """Run the adapter over the backlog, whose states stand at columns laid out by `starts`."""
        if not self.backlog:
            return
        hidden = torch.cat(self.backlog, dim=1)
        self.backlog = []
        columns = self.adapter_length + torch.arange(hidden.shape[1], device=hidden.device)
        first = torch.tensor(starts or (0,) * hidden.shape[0], device=hidden.device)
        positions = (columns[None, :] - first[:, None]).clamp(min=0)
        self.adapter(hidden, positions, self.adapter_cache, self._adapter_mask(hidden, starts))
        self.adapter_length += hidden.shape[1]


class AssistantDrafter(Drafter):
    """A separate small model with its own cache, catching up on whatever was committed since
    it last drafted (plain steps under a closed gate included).

    In a batch its cache's columns are the shared cache's (`shared`), and it moves as they move.
    It then keeps every key, a sliding window's too (the mask applies the window): a row moved
    right must still find the keys its window reaches. A row's moved entries that fall past the
    end of what every row has right are fed again, with the rest of the catch-up."""

    def __init__(self, assistant: nn.Module, shared: DraftAwareCache | None = None):
        self.assistant, self.shared = assistant, shared
        self.cache: DraftAwareCache | None = None  # made at the first draft, for one text or a batch
        self.kv_length = 0
        self.right: list[int] = []  # per row, how many of the cache's columns hold that row's own KV

    def propose(self, state, max_tokens, exit_policy, selector):
        return self.propose_rows([state], [max_tokens], [exit_policy], [selector])[0]

    def propose_rows(self, states, limits, exit_policies, selectors):
        if self.cache is None:
            self.cache = DraftAwareCache(self.assistant.config if len(states) == 1 else None)
        committed = states[0].length - 1 if self.shared is None else self.shared.get_seq_length()
        self.cache.starts = None if self.shared is None else self.shared.starts
        drafts = _draft_autoregressively(
            _model_next_logits(self.assistant, self.cache), states, committed + 1 - self.kv_length, limits,
            exit_policies, selectors,
        )
        self.kv_length = self.cache.get_seq_length()
        # a row fed its newest committed token and all its drafted tokens but the last
        self.right = [committed + max(len(draft.tokens), 1) for draft in drafts]
        return drafts

    def rollback(self, committed_kv_length: int) -> None:
        self.realign(Realignment(committed_kv_length))

    def realign(self, realignment: Realignment) -> None:
        if self.cache is None:
            return
        shifts = realignment.shifts or (0,) * len(self.right)
        rows = range(len(shifts)) if realignment.kept_rows is None else realignment.kept_rows
        right = [min(self.right[row] if self.right else self.kv_length, realignment.kv_length - shifts[row]) + shifts[row]
                 for row in rows]
        shift_rows(self.cache.layers, realignment.shifts)
        self.kv_length = min([self.kv_length, realignment.kv_length, *right])
        self.cache.rollback(self.kv_length)
        keep_rows(self.cache.layers, realignment.kept_rows)
        dropped = min(realignment.dropped_columns, self.kv_length)
        drop_columns(self.cache.layers, dropped)
        self.kv_length -= dropped
        self.right = []


class DraftHeadsDrafter(Drafter):
    """Draft heads (`draft_heads.py`): read from the final hidden state whose LM head chose a
    row's newest token, which the last verification computed and handed over. No layer runs and
    the shared cache is untouched: nothing to feed, nothing to roll back. Separate heads are all
    read from that state at once; a chain runs once per token, on the token it drafted last."""

    def __init__(
        self, model: nn.Module, heads: DraftHeads | DraftChain, draft_vocab_size: int = 0, alternatives: int = 0
    ):
        self.model, self.heads = model, heads
        self.draft_vocab_size, self.alternatives = draft_vocab_size, alternatives
        self.hidden_layer = len(decoder_layers(model))  # the normed final state, what the LM head reads
        self.features: torch.Tensor | None = None  # [rows, hidden], a row per text
        self.head: RestrictedDraftHead | None = None

    def propose(self, state, max_tokens, exit_policy, selector):
        return self.propose_rows([state], [max_tokens], [exit_policy], [selector])[0]

    def propose_rows(self, states, limits, exit_policies, selectors):
        if self.head is None:  # first draft: each text is its prompt and one token
            self.head = _draft_head(self.model, self.draft_vocab_size, states)
        alternatives = self.alternatives if len(states) == 1 else 0  # a batch verifies none
        drafts = [Draft() for _ in states]
        drafting = [row for row, limit in enumerate(limits) if limit > 0]
        chained = isinstance(self.heads, DraftChain)
        # Separate heads: every head's scores at once, `[rows, heads, vocab]`.
        head_scores = None if chained else self.head(self.heads(self.features).flatten(0, 1)).view(len(states), self.heads.shape.heads, -1)
        before = self.features  # the chain's state before each token it drafts
        chosen = torch.cat([state.sequence[:, state.length - 1] for state in states])  # the token it chose
        for ahead in range(min(max(limits), self.heads.shape.heads)):
            if chained:
                before = self.heads.step(before, self.model.get_input_embeddings()(chosen))
            scores = self.head(before) if chained else head_scores[:, ahead]
            for row in list(drafting):
                state = states[row]
                confidence = _draft_token(drafts[row], selectors[row], state, state.length + ahead, scores[row : row + 1], alternatives)
                chosen[row] = state.sequence[0, state.length + ahead]
                if exit_policies[row].exits_after(confidence) or ahead + 1 == limits[row]:
                    drafting.remove(row)
            if not drafting:
                break
        return drafts

    def guesses(self, state, count):
        if self.features is None or len(self.features) != 1:
            return []
        if self.head is None:
            self.head = _draft_head(self.model, self.draft_vocab_size, [state])
        if isinstance(self.heads, DraftChain):
            newest = self.model.get_input_embeddings()(state.sequence[:, state.length - 1])
            first = self.heads.step(self.features, newest)
        else:
            first = self.heads(self.features)[:, 0]
        values, indices = (column.tolist() for column in self.head(first)[0].topk(count))
        return [token for value, token in zip(values, indices) if value > -float("inf")]

    def learn(self, outcome: StepOutcome) -> None:
        rows = outcome.rows or (outcome,)
        self.features = torch.cat([row.hidden[:, row.newest_row] for row in rows])

    def realign(self, realignment: Realignment) -> None:
        if realignment.kept_rows is not None and self.features is not None:
            self.features = self.features[list(realignment.kept_rows)]
