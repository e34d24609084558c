"""The speculative decoding loop: draft, verify, accept, roll back, for one text or a batch.

Positions are explicit and the sequence lives in one preallocated buffer, so a step allocates
nothing it does not have to. The prompt's prefill is simply the first verification, of whatever
can be proposed without a forward pass (as transformers' assisted decoding does). A cache that
arrives holding the prompt's first tokens (a chat's earlier turns) is continued: the prefill
covers the rest. Each verification's outcome is one record (`StepOutcome`), which every part
that adapts learns from. A batch runs the same loop, each row drafting, verified and committed on
its own in every step's one forward pass (`batch.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import StoppingCriteriaList

from .batch import Batch, Row, within_quorum
from .cache import DraftAwareCache, cache_keyword
from .decoding_types import MODEL_SOURCE, DecodingState, Draft, Drafter, ExitPolicy, StepOutcome, Verdict
from .lookup import PromptLookup
from .narrow_linear import verifying
from .policies import Backoff, Gate
from .selection import TokenSelector
from .stats import StrategyStats
from .verifier import verify


class ModelDraft(Draft):
    """A row's proposal that the model is to draft, of at most `max_tokens` tokens: a batch's
    rows draft together, once every row has said what it proposes."""

    def __init__(self, max_tokens: int):
        super().__init__()
        self.max_tokens = max_tokens


@dataclass
class RowParts:
    """What decides one text's proposals, each row of a batch having its own: when the model's
    draft stops, whether the model drafts, and prompt lookup's sources (None: no lookup)."""

    exit_policy: ExitPolicy
    gate: Gate
    lookup: PromptLookup | None = None

    def propose(self, state: DecodingState, limit: int, backoff: Backoff, speculate: bool, prefill: bool) -> Draft:
        """The row's proposal, of at most `limit` tokens, `speculate` saying whether `backoff`
        lets the step speculate (a `ModelDraft` where the model is to draft it). Proposals that
        cost no forward pass (prompt lookup) need only the back-off, and ride along with the
        prompt's prefill, whose forward pass is wide anyway. Where the back-off says no, it may
        still let a verbatim repeat through."""
        if limit <= 0:
            return Draft()
        if not speculate:
            verbatim = self.lookup is not None and backoff.verifies_verbatim
            return self.lookup.verbatim(state, limit) if verbatim else Draft()
        if prefill or not self.gate.should_draft():
            return Draft() if self.lookup is None else self.lookup.free(state, limit)
        return ModelDraft(limit) if self.lookup is None else self.lookup.propose(state, limit, ModelDraft)

    def learn(self, outcome: StepOutcome) -> None:
        for part in (self.exit_policy, self.gate, self.lookup):
            if part is not None:
                part.learn(outcome)


@dataclass
class SpeculationParts:
    """What a strategy composes for one decode: who drafts with a model, whether to speculate at
    all, and what decides each text's proposals (`RowParts`, one per row of the batch). It is the
    step's one choice point (`propose`), and hands every verification's outcome to each part
    (`learn`)."""

    drafter: Drafter
    backoff: Backoff
    rows: list[RowParts]
    batch_quorum: float = 0.0  # a batch's proposals are no longer than this share of its rows' (`within_quorum`)
    # The drafter's first guesses verified beside a lookup proposal in a batch of one (`guessed_beside`).
    lookup_alternatives: int = 0

    def propose(self, rows: list[Row], limits: list[int], prefill: bool) -> list[Draft]:
        """Each row's proposal, of at most its limit: the back-off decides for the whole step
        whether to speculate, each row's gate whether the model drafts for it, and the rows the
        model drafts for draft together."""
        speculate = self.backoff.should_speculate()
        drafts = [row.parts.propose(row.state, limit, self.backoff, speculate, prefill) for row, limit in zip(rows, limits)]
        wanted = [draft.max_tokens if isinstance(draft, ModelDraft) else 0 for draft in drafts]
        if any(wanted):
            states, exit_policies = [row.state for row in rows], [row.parts.exit_policy for row in rows]
            drafted = self.drafter.propose_rows(states, wanted, exit_policies, [row.selector for row in rows])
            drafts = [model if tokens else draft for draft, model, tokens in zip(drafts, drafted, wanted)]
        if speculate and not prefill and len(rows) == 1:
            drafts = [self.guessed_beside(rows[0].state, drafts[0])]
        return within_quorum(drafts, self.batch_quorum)

    def guessed_beside(self, state: DecodingState, draft: Draft) -> Draft:
        """A lookup proposal with the drafter's first guesses (up to `lookup_alternatives`) that
        differ from its first token verified beside it: where lookup is wrong at once, the
        draft's guess there can still commit two tokens. Any other draft as it is."""
        if not self.lookup_alternatives or not draft.tokens or draft.source == MODEL_SOURCE or draft.alternatives:
            return draft
        guesses = [token for token in self.drafter.guesses(state, self.lookup_alternatives) if token != draft.tokens[0]]
        if guesses:
            draft.alternatives = [guesses[: self.lookup_alternatives]] + [[] for _ in draft.tokens[1:]]
        return draft

    def learn(self, rows: list[Row], outcomes: list[StepOutcome], hidden: torch.Tensor | None) -> None:
        """Each row's parts learn from its own outcome; the drafter and the back-off, which serve
        every row, from the step's (`StepOutcome.of_batch`)."""
        step = StepOutcome.of_batch(outcomes, hidden)
        self.drafter.learn(step)
        self.backoff.learn(step)
        for row, outcome in zip(rows, outcomes):
            row.parts.learn(outcome)


# One forward pass of the full model over a verification's inputs `(input_ids, position_ids,
# attention_mask, logits_to_keep, hidden_layer)`, a row per text: logits `[rows, logits_to_keep,
# vocab]` for the last inputs, and the hidden state numbered `hidden_layer` of every input (None
# when that is None).
FullForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | dict | None, int, int | None], tuple[torch.Tensor, torch.Tensor | None]
]


def model_forward(model, cache: DraftAwareCache) -> FullForward:
    """The full model itself, writing the verified positions' KV into `cache`, its few rows on
    whichever layout this machine multiplies faster (`narrow_linear`)."""

    def forward(input_ids, position_ids, attention_mask, logits_to_keep, hidden_layer):
        # transformers collects a selected hidden state per call (its hooks read a context
        # variable), at no extra compute: what a drafter reads travels with the output.
        with verifying(model):
            outputs = model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                **cache_keyword(cache),
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **({} if hidden_layer is None else {"output_hidden_states": [hidden_layer]}),
            )
        return outputs.logits, None if hidden_layer is None else outputs.hidden_states[hidden_layer]

    return forward


class WallClock:
    """What a step's drafting and verifying took, which the parts that learn from cost (the
    back-off, the draft source choice) read, and `StrategyStats` reports. Told what each stage
    did, so that a clock pricing that work instead of timing it (the tuner's estimate) can
    stand in."""

    def step_started(self) -> float:
        return time.perf_counter()

    def drafted(self, draft: Draft) -> float:
        return time.perf_counter()

    def verified(self, tokens: int) -> float:
        """After a verification of `tokens` inputs (the prompt's prefill is the first)."""
        return time.perf_counter()


@dataclass
class Runtime:
    """How a decode's verifications run (`forward`) and are timed (`clock`): the full model and
    wall time, unless the tuner's estimate replaces both, driving the loop with plain decoding's
    known tokens and priced seconds."""

    forward: FullForward
    clock: WallClock

    @classmethod
    def real(cls, model, cache: DraftAwareCache) -> Runtime:
        return cls(model_forward(model, cache), WallClock())


@dataclass
class DecodeRequest:
    """What to decode, and how: as `generate` would from `input_ids` (a row per text, left-padded
    where `attention_mask` says so), up to `max_length` tokens or until the stopping criteria say
    so, proposing at most `max_proposal_tokens` a step; a row that stops before the others is
    padded with `pad_token_id`."""

    input_ids: torch.Tensor
    selector: TokenSelector
    stopping_criteria: StoppingCriteriaList
    max_length: int
    max_proposal_tokens: int
    streamer: Any = None
    keep_scores: bool = False  # keep every committed token's scores and logits, for `generate`'s output
    attention_mask: torch.Tensor | None = None
    pad_token_id: int | None = None


@dataclass
class DecodeResult:
    sequences: torch.Tensor
    stats: StrategyStats
    scores: tuple[torch.Tensor, ...]
    logits: tuple[torch.Tensor, ...]


def speculative_decode(
    model,
    cache: DraftAwareCache,
    parts: SpeculationParts,
    request: DecodeRequest,
    stats: StrategyStats,
    runtime: Runtime | None = None,
) -> DecodeResult:
    """Decode `request` with `parts`, verifying on `runtime` (the full model and wall time by
    default) into `cache`, counting into `stats`."""
    runtime = Runtime.real(model, cache) if runtime is None else runtime
    forward, clock = runtime.forward, runtime.clock
    batch_size = request.input_ids.shape[0]
    if len(parts.rows) != batch_size:
        raise ValueError(f"the parts were built for a batch of {len(parts.rows)}, the request has {batch_size} rows")
    batch = Batch(request, parts.rows, cache)
    cached_length = kv_length = cache.get_seq_length()
    parts.drafter.continue_from(batch.rows[0].state, cached_length)
    # Where the criteria hold an EOS, a row that stops is padded; else it runs on (`Batch`).
    pads_stopped = any(hasattr(criteria, "eos_token_id") for criteria in request.stopping_criteria)

    while batch.active:
        rows, is_prefill = batch.active, kv_length == cached_length

        # Draft
        started = clock.step_started()
        drafts = parts.propose(rows, batch.limits(request.max_proposal_tokens), is_prefill)
        if not is_prefill:
            # A model's draft left its own KV in the shared cache, not the full model's. (Where
            # nothing drafted into it, the cache is as the last step's rollback left it.)
            cache.rollback(kv_length)
        drafting_ended = clock.drafted(Draft.joined(drafts))
        stats.draft_seconds += drafting_ended - started

        # Verify: every row's drafted positions in one forward pass of the full model, the
        # draft's alternatives beside them
        input_ids, position_ids, attention_mask = batch.verification_inputs(drafts, kv_length, model, cache)
        first_row = batch.fresh - 1  # the newest committed token's: logits from here on
        logits, hidden = forward(
            input_ids, position_ids, attention_mask, input_ids.shape[1] - first_row, parts.drafter.hidden_layer
        )
        verdicts = [verify(row.selector, row.state, draft, row_logits)
                    for row, draft, row_logits in zip(rows, drafts, logits)]
        verified = clock.verified(input_ids.numel())
        stats.verify_seconds += verified - drafting_ended

        # Accept
        committed = batch.commit(verdicts, request.stopping_criteria, request.keep_scores)

        # Roll back: keep the KV of every committed token but the newest, which has none yet
        moved_row = _keep_alternative(cache, rows, verdicts, committed, first_row, kv_length)
        seconds = None if is_prefill else verified - started  # a prefill's time says nothing about a step's
        outcomes = [
            StepOutcome(draft, verdict, count, seconds, None if hidden is None else hidden[i : i + 1], moved_row,
                        first_row=first_row)
            for i, (draft, verdict, count) in enumerate(zip(drafts, verdicts, committed))
        ]
        parts.learn(rows, outcomes, hidden)
        realignment = batch.settle(committed, kv_length, pads_stopped, cache.starts)
        cache.realign(realignment)
        parts.drafter.realign(realignment)
        kv_length = realignment.kv_length - realignment.dropped_columns
        if request.streamer is not None:
            batch.stream(request.streamer, committed)
        for draft, verdict in zip(drafts, verdicts):
            if draft.tokens or not is_prefill:
                _count(stats, verdict, len(draft.tokens))

    if request.streamer is not None:
        request.streamer.end()
    scores = batch.kept("scores") if request.keep_scores else ()
    logits = batch.kept("logits") if request.keep_scores else ()
    return DecodeResult(batch.output_sequences(), stats, scores, logits)


def _keep_alternative(cache, rows, verdicts, committed, first_row, verified_from) -> tuple[int, int] | None:
    """Where one text's verifier accepted an alternative, move its KV to the place of the draft
    token it replaced: `(source_row, target_row)`, rows counted from the verification's first
    input. It keeps its KV whenever the token after it was committed, on the last step too: the
    cache a chat's next turn continues from must hold it. A stop on the alternative itself
    leaves it the newest token, with no KV yet. (A batch's drafts carry no alternatives.)"""
    verdict = verdicts[0]
    if len(rows) > 1 or verdict.alternative_row is None or committed[0] != len(verdict.tokens):
        return None
    kv_length = rows[0].state.length - 1
    moved_row = (first_row + verdict.alternative_row, kv_length - 1 - verified_from)
    cache.move_entry(verified_from + moved_row[0], verified_from + moved_row[1])
    return moved_row


def _count(stats: StrategyStats, verdict: Verdict, drafted: int) -> None:
    if drafted:
        stats.verification_steps += 1
        stats.drafted_tokens += drafted
        stats.accepted_tokens += verdict.accepted
        stats.accepted_lengths.append(verdict.accepted)
        stats.accepted_alternatives += verdict.alternative_row is not None
    else:
        stats.plain_steps += 1
