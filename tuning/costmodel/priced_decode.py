"""The decoding loop run as an estimate: plain greedy's known tokens stand in for the full
model, the predictions for the model's draft, and the cost model's prices for the clock."""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from hf_selfspec.tuner_api import (
    MODEL_SOURCE,
    DecodeRequest,
    Draft,
    DraftAwareCache,
    Drafter,
    OnlineCorpus,
    Runtime,
    SelfSpecParams,
    Strategy,
    StrategyStats,
    TokenSelector,
    WallClock,
    resolve_strategy,
    speculative_decode,
)

from .predictions import DraftPredictions
from .prices import CostModel
from .teacher_forcing import TeacherForcedPrompt


class _PredictedDraft(Drafter):
    """The model's draft as the draft pass predicts it: what a real draft proposes after the
    committed text, each token with its runner-ups, until the exit policy stops it (by the rule
    a real draft stops by)."""

    def __init__(self, predictions: DraftPredictions, prompt_length: int):
        self.predictions, self.prompt_length = predictions, prompt_length

    def propose(self, state, max_tokens, exit_policy, selector):
        row = state.length - self.prompt_length - 1  # the newest committed continuation token's
        draft = Draft()
        for token, confidence in self.predictions.chain(row, max_tokens):
            draft.tokens.append(token)
            if exit_policy.exits_after(confidence):
                break
        state.sequence[0, state.length : state.length + len(draft.tokens)] = torch.tensor(draft.tokens)
        draft.alternatives = self.predictions.alternatives[row : row + len(draft.tokens)]
        return draft

    def guesses(self, state, count):
        row = state.length - self.prompt_length - 1
        return self.predictions.first_guesses[row][:count] if row < len(self.predictions.first_guesses) else []


class _KnownVerifier:
    """The full model's forward pass where plain greedy decoding has already said what it
    chooses: at every verified position, logits that pick plain's token there with the full
    model's own confidence in it (which a confidence gate reads). Past the end of plain's text
    nothing is known, and the logits there pick token 0: the decode stops at that end anyway."""

    def __init__(self, data: TeacherForcedPrompt, vocab_size: int):
        device = data.full_text.device
        self.tokens = data.full_text[data.prompt_length :]
        # At least twice a uniform guess, so that the peak stays plain's token whatever the
        # teacher-forced pass rounded it to.
        confidence = torch.tensor(data.verifier_confidence, device=device).clamp(min=2 / vocab_size)
        self.peak, self.rest = confidence.log(), torch.log1p(-confidence) - math.log(vocab_size - 1)
        self.first_position, self.vocab_size = data.prompt_length - 1, vocab_size

    def __call__(self, input_ids, position_ids, attention_mask, logits_to_keep, hidden_layer):
        if hidden_layer is not None:
            raise ValueError(
                'objective = "estimated" cannot hand a drafter the verifier\'s hidden states; use objective = "measured"'
            )
        rows = position_ids[0, -logits_to_keep:] - self.first_position  # the continuation token each row chooses
        known = torch.nonzero(rows < len(self.tokens)).flatten()
        logits = torch.zeros((len(rows), self.vocab_size), device=position_ids.device)
        chosen = rows[known]
        logits[known] = self.rest[chosen, None].expand(-1, self.vocab_size)
        logits[known, self.tokens[chosen]] = self.peak[chosen]
        return logits[None], None  # one text


class PricedClock(WallClock):
    """The decoding loop's clock in an estimate: every stage priced by the cost model instead of
    timed. A verification costs the forward pass over its inputs (the first one, the prompt's
    prefill, what the prompt's prefill was timed at) and the loop's overhead per step; a draft,
    its model-drafted tokens (a lookup's cost nothing, but the draft's guesses verified beside
    one cost a drafted token). The back-off and the draft source choice learn from these prices
    as they learn from wall time in a real decode."""

    def __init__(self, cost: CostModel, params: SelfSpecParams, prefill_seconds: float):
        self.cost, self.prefill_seconds = cost, prefill_seconds
        self.draft_token_seconds = cost.draft_token_seconds(params)
        self.seconds = 0.0
        self.prefilled = False

    def step_started(self) -> float:
        return self.seconds

    def drafted(self, draft: Draft) -> float:
        if draft.source == MODEL_SOURCE:
            self.seconds += len(draft.tokens) * self.draft_token_seconds
        elif draft.alternatives:
            self.seconds += self.draft_token_seconds
        return self.seconds

    def verified(self, tokens: int) -> float:
        forward = self.cost.verify(tokens) if self.prefilled else self.prefill_seconds
        self.seconds += forward + self.cost.loop_step_overhead
        self.prefilled = True
        return self.seconds


def estimate_decode(
    model,
    data: TeacherForcedPrompt,
    params: SelfSpecParams,
    strategy: str | Strategy,
    draft: DraftPredictions,
    cost: CostModel,
    online_corpus: OnlineCorpus | None = None,
) -> tuple[float, StrategyStats]:
    """The priced seconds and the counters of decoding `data`'s prompt with `strategy`: the
    decoding loop itself (`speculative_decode`), with plain greedy's known tokens for the full
    model's verdicts, `draft`'s predictions for the model's draft, and `cost`'s prices for its
    clock. Everything else is the strategy's own composition: prompt lookup and its corpus, the
    gate, the exit policy, the back-off, a drafter of its own, and `online_corpus` where given,
    which then learns the prompt and its text as a real call's would."""
    strategy = resolve_strategy(strategy)
    cache = DraftAwareCache()  # stays empty: the known verifier writes no KV
    # The model's draft would cost forward passes, which the estimate exists to save: wherever
    # the strategy builds it, it gets the prediction instead.
    parts = strategy.build(
        model, params, cache, model_drafter=_PredictedDraft(draft, data.prompt_length), online_corpus=online_corpus
    )
    request = DecodeRequest(
        data.full_text[None, : data.prompt_length],
        TokenSelector(LogitsProcessorList(), do_sample=False),
        # plain decoding stopped there (its EOS, if it reached one)
        StoppingCriteriaList([MaxLengthCriteria(data.prompt_length + len(data.reference))]),
        max_length=data.prompt_length + data.max_new_tokens,
        max_proposal_tokens=params.max_proposal_tokens,
    )
    clock = PricedClock(cost, params, data.prefill_seconds)
    runtime = Runtime(_KnownVerifier(data, model.get_output_embeddings().weight.shape[0]), clock)
    result = speculative_decode(model, cache, parts, request, StrategyStats(strategy=strategy.name), runtime)
    if online_corpus is not None:
        online_corpus.add(data.full_text.tolist())
    return clock.seconds, result.stats


def plain_seconds(data: TeacherForcedPrompt, cost: CostModel) -> float:
    """Plain decoding in the same units: the prefill, then one forward and overhead per token."""
    steps = len(data.reference)
    return data.prefill_seconds + steps * cost.plain_step_overhead + (steps - 1) * cost.plain_forward()
