"""The speculative decoding loop: draft, verify, accept, roll back.

Positions are explicit and the sequence lives in one preallocated buffer, so a step allocates
nothing it does not have to. The prompt's prefill is simply the first verification, of whatever
can be proposed without a forward pass (as transformers' assisted decoding does). A cache that
arrives holding the prompt's first tokens (a chat's earlier turns) is continued: the prefill
covers the rest. Each verification's outcome is one record (`StepOutcome`), which every part
that adapts learns from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import StoppingCriteriaList

from .alternatives import verification_inputs
from .cache import DraftAwareCache, cache_keyword
from .decoding_types import DecodingState, Draft, Drafter, ExitPolicy, StepOutcome, Verdict
from .lookup import PromptLookup
from .narrow_linear import verifying
from .policies import Backoff, Gate
from .selection import TokenSelector
from .stats import StrategyStats
from .verifier import verify


@dataclass
class SpeculationParts:
    """What a strategy composes: who drafts with a model, when drafting stops, whether the model
    drafts, whether to speculate at all, and prompt lookup's sources (None: no lookup). It is
    the step's one choice point (`propose`), and hands every verification's outcome to each
    part (`learn`)."""

    drafter: Drafter
    exit_policy: ExitPolicy
    gate: Gate
    backoff: Backoff
    lookup: PromptLookup | None = None

    def propose(self, state: DecodingState, limit: int, selector: TokenSelector, prefill: bool) -> Draft:
        """The step's proposal, of at most `limit` tokens: the back-off decides whether to
        speculate at all, the gate whether the model drafts; proposals that cost no forward pass
        (prompt lookup) need only the back-off, and ride along with the prompt's prefill, whose
        forward pass is wide anyway. Where the back-off says no, it may still let a verbatim
        repeat through."""
        if limit <= 0:
            return Draft()
        if not self.backoff.should_speculate():
            verbatim = self.lookup is not None and self.backoff.verifies_verbatim
            return self.lookup.verbatim(state, limit) if verbatim else Draft()
        if prefill or not self.gate.should_draft():
            return Draft() if self.lookup is None else self.lookup.free(state, limit)

        def model_draft(max_tokens: int) -> Draft:
            return self.drafter.propose(state, max_tokens, self.exit_policy, selector)

        return model_draft(limit) if self.lookup is None else self.lookup.propose(state, limit, model_draft)

    def learn(self, outcome: StepOutcome) -> None:
        for part in (self.drafter, self.exit_policy, self.gate, self.backoff, self.lookup):
            if part is not None:
                part.learn(outcome)


# One forward pass of the full model over a verification's inputs `(input_ids, position_ids,
# attention_mask, logits_to_keep, hidden_layer)`: logits `[logits_to_keep, vocab]` for the last
# inputs, and the hidden state numbered `hidden_layer` of every input (None when that is None).
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
        return outputs.logits[0], None if hidden_layer is None else outputs.hidden_states[hidden_layer]

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
    """What to decode, and how: as `generate` would from `input_ids`, up to `max_length` tokens
    or until the stopping criteria say so, proposing at most `max_proposal_tokens` a step."""

    input_ids: torch.Tensor
    selector: TokenSelector
    stopping_criteria: StoppingCriteriaList
    max_length: int
    max_proposal_tokens: int
    streamer: Any = None
    keep_scores: bool = False  # keep every committed token's scores and logits, for `generate`'s output


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
    state = _committed_prompt(request)
    cached_length = kv_length = cache.get_seq_length()
    parts.drafter.continue_from(state, cached_length)
    kept_scores: list[torch.Tensor] | None = [] if request.keep_scores else None
    kept_logits: list[torch.Tensor] = []
    finished = state.length >= request.max_length

    while not finished:
        is_prefill = kv_length == cached_length

        # Draft
        started = clock.step_started()
        limit = min(request.max_proposal_tokens, request.max_length - state.length - 1)
        draft = parts.propose(state, limit, request.selector, is_prefill)
        if not is_prefill:
            # A model's draft left its own KV in the shared cache, not the full model's. (Where
            # nothing drafted into it, the cache is as the last step's rollback left it.)
            cache.rollback(kv_length)
        drafting_ended = clock.drafted(draft)
        stats.draft_seconds += drafting_ended - started

        # Verify: every drafted position in one forward pass of the full model, the draft's
        # alternatives beside them
        input_ids, position_ids, attention_mask = verification_inputs(
            state.sequence, state.positions, kv_length, state.length, len(draft.tokens), draft.alternatives, model,
            cache,
        )
        first_row = state.length - 1 - kv_length  # the newest committed token's: logits from here on
        logits, hidden = forward(
            input_ids, position_ids, attention_mask, input_ids.shape[1] - first_row, parts.drafter.hidden_layer
        )
        verdict = verify(request.selector, state, draft, logits)
        verified = clock.verified(input_ids.shape[1])
        stats.verify_seconds += verified - drafting_ended

        # Accept
        committed, finished = _commit(state, verdict, request.stopping_criteria, kept_scores)
        if request.streamer is not None:
            request.streamer.put(state.sequence[0, state.length - committed : state.length].cpu())
        if request.keep_scores:
            kept_logits.extend(verdict.logits[:committed, None])

        # Roll back: keep the KV of every committed token but the newest, which has none yet
        verified_from, kv_length = kv_length, state.length - 1
        moved_row = None
        # An accepted alternative keeps its KV whenever the token after it was committed, on the
        # last step too: the cache a chat's next turn continues from must hold it. A stop on the
        # alternative itself leaves it the newest token, with no KV yet.
        if verdict.alternative_row is not None and committed == len(verdict.tokens):
            moved_row = (first_row + verdict.alternative_row, kv_length - 1 - verified_from)
            cache.move_entry(verified_from + moved_row[0], verified_from + moved_row[1])
        # a prefill's time says nothing about a step's
        seconds = None if is_prefill else verified - started
        parts.learn(StepOutcome(draft, verdict, committed, seconds, hidden, moved_row))
        cache.rollback(kv_length)
        parts.drafter.rollback(kv_length)
        if draft.tokens or not is_prefill:
            _count(stats, verdict, len(draft.tokens))

    if request.streamer is not None:
        request.streamer.end()
    return DecodeResult(state.sequence[:, : state.length].clone(), stats, tuple(kept_scores or ()), tuple(kept_logits))


def _committed_prompt(request: DecodeRequest) -> DecodingState:
    """The prompt in a buffer of `max_length` tokens, which the decode fills."""
    prompt_length = request.input_ids.shape[1]
    sequence = request.input_ids.new_zeros((1, request.max_length))
    sequence[:, :prompt_length] = request.input_ids
    positions = torch.arange(request.max_length, device=request.input_ids.device).unsqueeze(0)
    return DecodingState(sequence, positions, prompt_length)


def _commit(
    state: DecodingState, verdict: Verdict, stopping_criteria: StoppingCriteriaList, kept_scores: list[torch.Tensor] | None
) -> tuple[int, bool]:
    """Append the verdict's tokens one by one, stopping exactly where plain decoding would. As in
    plain decoding, the criteria see the scores kept so far, so one that reads the newest token's
    scores (transformers' `ConfidenceCriteria`) works when scores are kept."""
    for count, token in enumerate(verdict.tokens, start=1):
        state.sequence[0, state.length] = token
        state.length += 1
        if kept_scores is not None:
            kept_scores.append(verdict.scores[count - 1, None])
        scores = None if kept_scores is None else tuple(kept_scores)
        if bool(stopping_criteria(state.sequence[:, : state.length], scores).any()):
            return count, True
    return len(verdict.tokens), False


def _count(stats: StrategyStats, verdict: Verdict, drafted: int) -> None:
    if drafted:
        stats.verification_steps += 1
        stats.drafted_tokens += drafted
        stats.accepted_tokens += verdict.accepted
        stats.accepted_lengths.append(verdict.accepted)
        stats.accepted_alternatives += verdict.alternative_row is not None
    else:
        stats.plain_steps += 1
