"""The speculative decoding loop: draft, verify, accept, roll back.

Positions are explicit and the sequence lives in one preallocated buffer, so a step allocates
nothing it does not have to. The prompt's prefill is simply the first verification, of whatever
the drafter can propose without a forward pass (as transformers' assisted decoding does). A cache
that arrives holding the prompt's first tokens (a chat's earlier turns) is continued: the prefill
covers the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList

from .alternatives import verification_inputs
from .cache import DraftAwareCache, cache_keyword
from .decoding_types import DecodingState, Draft, Drafter, Verdict
from .narrow_linear import verifying
from .policies import Backoff, ExitPolicy, Gate
from .selection import TokenSelector
from .stats import StrategyStats
from .verifier import verify


@dataclass
class SpeculationParts:
    """What a strategy composes: who proposes, when drafting stops, whether the model drafts,
    and whether to speculate at all."""

    drafter: Drafter
    exit_policy: ExitPolicy
    gate: Gate
    backoff: Backoff


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
class DecodeResult:
    sequences: torch.Tensor
    stats: StrategyStats
    scores: tuple[torch.Tensor, ...]
    logits: tuple[torch.Tensor, ...]


def speculative_decode(
    model,
    cache: DraftAwareCache,
    parts: SpeculationParts,
    input_ids: torch.Tensor,
    selector: TokenSelector,
    stopping_criteria: StoppingCriteriaList,
    max_length: int,
    max_proposal_tokens: int,
    stats: StrategyStats,
    streamer=None,
    keep_scores: bool = False,
    forward: FullForward | None = None,
    clock: WallClock | None = None,
) -> DecodeResult:
    """Decode from `input_ids` until the stopping criteria say so. `forward` (the full model by
    default) and `clock` (wall time by default) are the tuner's estimate's to replace: it drives
    this loop with plain decoding's known tokens and priced seconds."""
    forward = model_forward(model, cache) if forward is None else forward
    clock = WallClock() if clock is None else clock
    prompt_length = input_ids.shape[1]
    sequence = input_ids.new_zeros((1, max_length))
    sequence[:, :prompt_length] = input_ids
    positions = torch.arange(max_length, device=input_ids.device).unsqueeze(0)
    state = DecodingState(sequence, positions, prompt_length)
    cached_length = kv_length = cache.get_seq_length()
    parts.drafter.continue_from(state, cached_length)
    kept_scores: list[torch.Tensor] = []
    kept_logits: list[torch.Tensor] = []
    finished = prompt_length >= max_length

    while not finished:
        is_prefill = kv_length == cached_length

        # Draft: the back-off decides whether to speculate at all, the gate whether the model
        # drafts; proposals that cost no forward pass (prompt lookup) need only the back-off,
        # and ride along with the prompt's prefill, whose forward pass is wide anyway. Where the
        # back-off says no, it may still let a verbatim repeat through.
        started = clock.step_started()
        draft = Draft()
        room = max_length - state.length
        limit = min(max_proposal_tokens, room - 1)
        if limit > 0 and parts.backoff.should_speculate():
            if is_prefill:
                draft = parts.drafter.propose_free(state, limit)
            elif parts.gate.should_draft():
                draft = parts.drafter.propose(state, limit, parts.exit_policy, selector)
                cache.rollback(kv_length)  # the draft's own KV is not the full model's
            else:
                draft = parts.drafter.propose_free(state, limit)
        elif limit > 0 and parts.backoff.verifies_verbatim:
            draft = parts.drafter.propose_verbatim(state, limit)
        drafted = len(draft.tokens)
        drafting_ended = clock.drafted(draft)
        stats.draft_seconds += drafting_ended - started

        # Verify: every drafted position in one forward pass of the full model, the draft's
        # alternatives beside them
        input_ids, position_ids, attention_mask = verification_inputs(
            sequence, positions, kv_length, state.length, drafted, draft.alternatives, model, cache
        )
        first_row = state.length - 1 - kv_length  # the newest committed token's: logits from here on
        logits, hidden = forward(
            input_ids, position_ids, attention_mask, input_ids.shape[1] - first_row,
            parts.drafter.verification_hidden_state(),
        )
        if hidden is not None:
            parts.drafter.verified(hidden)
        verdict = verify(selector, state, draft, logits)
        verified = clock.verified(input_ids.shape[1])
        stats.verify_seconds += verified - drafting_ended

        # Accept
        committed, finished = _commit(state, verdict, stopping_criteria, kept_scores if keep_scores else None)
        if streamer is not None:
            streamer.put(sequence[0, state.length - committed : state.length].cpu())
        if keep_scores:
            kept_logits.extend(verdict.logits[:committed, None])

        # Roll back: keep the KV of every committed token but the newest, which has none yet
        verified_from, kv_length = kv_length, state.length - 1
        # An accepted alternative keeps its KV whenever the token after it was committed, on the
        # last step too: the cache a chat's next turn continues from must hold it. A stop on the
        # alternative itself leaves it the newest token, with no KV yet.
        if verdict.alternative_row is not None and committed == len(verdict.tokens):
            source_row, target_row = first_row + verdict.alternative_row, kv_length - 1 - verified_from
            cache.move_entry(verified_from + source_row, verified_from + target_row)
            parts.drafter.keep_alternative(source_row, target_row)
        cache.rollback(kv_length)
        parts.drafter.rollback(kv_length)
        # a prefill's time says nothing about a step's
        _adapt(parts, draft, verdict, committed, None if is_prefill else verified - started)
        if drafted or not is_prefill:
            _count(stats, verdict, drafted)

    if streamer is not None:
        streamer.end()
    return DecodeResult(sequence[:, : state.length].clone(), stats, tuple(kept_scores), tuple(kept_logits))


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


def _adapt(parts: SpeculationParts, draft: Draft, verdict: Verdict, committed: int, seconds: float | None) -> None:
    """Feed the step's outcome to every part that learns from it."""
    if draft.tokens:
        parts.exit_policy.update(verdict.accepted, len(draft.tokens))
    parts.drafter.record(draft, verdict.accepted, committed, seconds)
    if parts.gate.needs_confidence:
        probabilities = torch.softmax(verdict.scores[-1], dim=-1)
        parts.gate.update(float(probabilities[verdict.tokens[-1]]))
    if seconds is not None:
        parts.backoff.record(len(draft.tokens), committed, seconds)


def _count(stats: StrategyStats, verdict: Verdict, drafted: int) -> None:
    if drafted:
        stats.verification_steps += 1
        stats.drafted_tokens += drafted
        stats.accepted_tokens += verdict.accepted
        stats.accepted_lengths.append(verdict.accepted)
        stats.accepted_alternatives += verdict.alternative_row is not None
    else:
        stats.plain_steps += 1
