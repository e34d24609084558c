"""The exit policies and the gate, as state machines and inside generation."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import hf_selfspec
from hf_selfspec import AdaptiveExitPolicy, ExitPolicy, TargetConfidenceGate, ThroughputBackoff
from hf_selfspec.decoding_types import MODEL_SOURCE, TEXT_SOURCE, Draft, StepOutcome, Verdict
from helpers.tiny_models import tiny_model


def _outcome_of(draft: Draft, accepted: int, committed: int, seconds: float | None = 0.5,
                confidence: float = 1.0) -> StepOutcome:
    """A verification of `draft` that accepted `accepted` of its tokens and committed `committed`,
    the verifier `confidence` sure of its own token (token 0 of two)."""
    scores = torch.tensor([confidence, 1 - confidence]).log().expand(accepted + 1, 2)
    return StepOutcome(draft, Verdict([0] * (accepted + 1), accepted, scores, scores), committed, seconds)


def _outcome(drafted: int, accepted: int = 0, committed: int = 1, seconds: float | None = 0.5,
             source: str = MODEL_SOURCE, confidence: float = 1.0) -> StepOutcome:
    """A verification of `drafted` tokens from `source` (none: a plain step)."""
    return _outcome_of(Draft([0] * drafted, source=source), accepted, committed, seconds, confidence)


def test_adaptive_threshold_follows_hand_computed_sequence():
    policy = AdaptiveExitPolicy(
        threshold=0.6, target_acceptance=0.9, threshold_step=0.01, acceptance_ema=0.5, threshold_ema=0.9
    )
    # By hand, with AR starting at the target 0.9:
    # (4/4): AR = .5*.9 + .5*1 = .95 > .9  -> proposal .59  -> threshold .9*.6 + .1*.59 = .599
    # (1/4): AR = .5*.95 + .5*.25 = .60 <= .9 -> proposal .609 -> threshold .9*.599 + .1*.609 = .6000
    # (2/2): AR = .5*.6 + .5*1 = .80 <= .9 -> proposal .61  -> threshold .9*.6 + .1*.61 = .601
    expected = [(0.95, 0.599), (0.60, 0.6000), (0.80, 0.601)]
    for (accepted, drafted), (rate, threshold) in zip([(4, 4), (1, 4), (2, 2)], expected):
        policy.learn(_outcome(drafted, accepted))
        assert policy.acceptance_rate == pytest.approx(rate, abs=1e-12)
        assert policy.threshold == pytest.approx(threshold, abs=1e-12)


def test_fixed_exit_policy_never_moves():
    policy = ExitPolicy(0.4)
    policy.learn(_outcome(5, 0))
    assert policy.threshold == 0.4
    assert policy.exits_after(0.39) and not policy.exits_after(0.4)  # the token that trips it is kept


def test_the_adaptive_threshold_ignores_plain_steps():
    policy = AdaptiveExitPolicy(0.6, target_acceptance=0.9, threshold_step=0.01, acceptance_ema=0.5, threshold_ema=0.9)
    policy.learn(_outcome(0))
    assert (policy.threshold, policy.acceptance_rate) == (0.6, 0.9)


def test_gate_drafts_when_confident_and_decodes_plainly_when_not():
    gate = TargetConfidenceGate(0.5)
    assert gate.should_draft()  # nothing known yet: try drafting
    gate.learn(_outcome(0, confidence=0.3))
    assert not gate.should_draft()
    gate.learn(_outcome(0, confidence=0.5))
    assert gate.should_draft()  # "at or above" drafts
    gate.learn(_outcome(0, confidence=0.49))
    assert not gate.should_draft()


def _gated_stats(model, threshold):
    import torch

    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    output = model.generate(prompt, max_new_tokens=30, do_sample=False, strategy="target_confidence_gated",
                            attn_skip_layers=[2], mlp_skip_layers=[3], target_confidence_threshold=threshold,
                            draft_exit_threshold=0.0, backoff_probe_interval=0, return_dict_in_generate=True)
    return output.strategy_stats


def test_confident_verifier_drafts_unconfident_one_decodes_plainly():
    model = tiny_model("llama", initializer_range=0.3)
    open_gate = _gated_stats(model, 0.0)  # every verifier probability is >= 0
    # At most the last step is plain: with one token of room left there is nothing to draft.
    assert open_gate.drafted_tokens > 0 and open_gate.plain_steps <= 1
    closed_gate = _gated_stats(model, 1.0)  # no probability of a real model reaches 1 exactly here
    assert closed_gate.drafted_tokens == 0 and closed_gate.plain_steps == 29


def test_closed_gate_still_verifies_free_prompt_lookup_proposals():
    """Prompt lookup costs no forward pass, so a closed gate stops only the model's own draft."""
    import torch

    model = tiny_model("llama", initializer_range=0.3)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 3, 14, 15, 92, 65, 3, 14]])
    kwargs = dict(max_new_tokens=30, do_sample=False, strategy="target_confidence_gated", attn_skip_layers=[2],
                  mlp_skip_layers=[3], target_confidence_threshold=1.0, return_dict_in_generate=True)
    plain = model.generate(prompt, max_new_tokens=30, do_sample=False, strategy="plain")
    without_lookup = model.generate(prompt, **kwargs)
    with_lookup = model.generate(prompt, prompt_lookup_tokens=4, **kwargs)
    assert without_lookup.strategy_stats.drafted_tokens == 0
    assert with_lookup.strategy_stats.drafted_tokens > 0
    assert with_lookup.sequences.tolist() == without_lookup.sequences.tolist() == plain.tolist()


def _continuation(sequence, min_ngram, max_ngram, max_tokens):
    from hf_selfspec.lookup import earliest_match

    match = earliest_match(sequence, min_ngram, max_ngram, max_reach=16)
    return [] if match is None else sequence[match.follow : match.follow + max_tokens].tolist()


def test_lookup_needs_a_match_of_at_least_min_ngram_tokens():
    # "7 8" recurs only as the single token 8 (followed by 9 earlier): a one-token match.
    one_token = torch.tensor([5, 8, 9, 10, 11, 7, 8])
    assert _continuation(one_token, 1, 3, 4) == [9, 10, 11, 7]
    assert _continuation(one_token, 2, 3, 4) == []
    # "10 11" recurs: the two-token match proposes what followed it, the longest match wins.
    two_tokens = torch.tensor([10, 11, 4, 5, 6, 2, 10, 11])
    assert _continuation(two_tokens, 2, 3, 2) == [4, 5]


def test_lookup_copies_the_earliest_occurrence_as_transformers_does():
    # "3 4" occurs at 0 (followed by 5 6 7 8) and at 5 (followed by 9, then the end of the text);
    # the earliest has the longer continuation and is the one transformers' prompt lookup copies.
    sequence = torch.tensor([3, 4, 5, 6, 7, 3, 4, 9, 3, 4])
    assert _continuation(sequence, 2, 2, 4) == [5, 6, 7, 3]


def test_a_match_reaches_back_as_far_as_the_text_agrees_with_it_up_to_the_bound():
    from hf_selfspec.lookup import earliest_match

    # The text ends repeating "1 2 3 4 5 6" verbatim; a 2-gram search finds "5 6", and the text
    # before it agrees for four more tokens back, where 0 and 9 differ.
    sequence = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6])
    match = earliest_match(sequence, 1, 2, max_reach=16)
    assert (match.follow, match.reach) == (7, 6)
    assert earliest_match(sequence, 1, 2, max_reach=4).reach == 4  # counted no further than needed
    # A match at the very start of the text has nothing before it: its reach is the n-gram.
    assert earliest_match(torch.tensor([5, 6, 9, 5, 6]), 1, 2, max_reach=16).reach == 2
    assert earliest_match(torch.tensor([5, 6, 9, 8]), 1, 2, max_reach=16) is None


def test_an_adaptive_length_jumps_to_a_long_reach_and_ignores_a_short_one():
    from hf_selfspec.policies import VERBATIM_REACH, AdaptiveLookupLength, LookupLength

    length = AdaptiveLookupLength(tokens=1, max_tokens=12)
    assert length.tokens_for(VERBATIM_REACH - 1) == 1  # a chance match moves nothing
    assert length.tokens_for(7) == 7  # a verbatim repeat of seven tokens: propose seven at once
    assert length.tokens_for(30) == 12  # never past the bound
    assert length.tokens_for(5) == 12  # a reach never shortens what whole acceptances earned
    length.learn(_outcome(12, 3))
    assert length.tokens == 7  # cuts still halve the way down
    assert LookupLength(3).tokens_for(30) == 3  # a fixed length stays fixed


# Speculative steps the back-off measures before it first compares the two modes.
FIRST = ThroughputBackoff._FIRST_SPECULATIVE_STEPS


def _run(backoff: ThroughputBackoff, steps: int, speculative_cost: float, speculative_tokens: int) -> list[bool]:
    """Feed `steps` decisions: a plain step commits 1 token per second; a speculative one commits
    `speculative_tokens` in `speculative_cost` seconds."""
    decisions = []
    for _ in range(steps):
        speculate = backoff.should_speculate()
        decisions.append(speculate)
        if speculate:
            backoff.learn(_outcome(2, committed=speculative_tokens, seconds=speculative_cost))
        else:
            backoff.learn(_outcome(0, committed=1, seconds=1.0))
    return decisions


def test_backoff_measures_both_modes_then_probes_a_losing_draft_ever_more_rarely():
    backoff = ThroughputBackoff(probe_interval=4)
    decisions = _run(backoff, 50, speculative_cost=1.8, speculative_tokens=1)  # 1.8 s per token: a loss
    assert decisions[: FIRST + 1] == [True] * FIRST + [False]  # speculative steps, then a plain one, then compare
    probes = [step - FIRST for step, speculate in enumerate(decisions) if speculate][FIRST:]
    # A probe once the draft has been idle for 4 steps (the measuring plain step included), then
    # the wait doubles after each probe that confirms the loss.
    assert probes == [4, 13, 30]


def test_backoff_keeps_a_paying_draft_and_still_probes_plain_steps():
    backoff = ThroughputBackoff(probe_interval=4)
    decisions = _run(backoff, 30, speculative_cost=1.8, speculative_tokens=3)  # 0.6 s per token: a win
    plain_steps = [step - FIRST for step, speculate in enumerate(decisions) if not speculate]
    assert plain_steps == [0, 5, 14]  # plain idles 4 steps after measuring, then 8, ...


def test_backoff_probes_a_close_loser_sooner_and_a_free_winner_on_schedule():
    close = ThroughputBackoff(probe_interval=16)
    # 1.05 s for 1 token: speculating loses by 5%, so a probe costs little and comes every 3 steps
    decisions = _run(close, FIRST + 20, speculative_cost=1.05, speculative_tokens=1)
    probes = [step - FIRST for step, speculate in enumerate(decisions) if speculate][FIRST:]
    assert probes[:3] == [3, 7, 11]
    # a winner priced at nothing (an estimate's cost model can be) keeps the doubling schedule
    free = ThroughputBackoff(probe_interval=4)
    plain_steps = [step - FIRST for step, speculate in enumerate(_run(free, FIRST + 30, 0.0, 3)) if not speculate]
    assert plain_steps == [0, 5, 14]


def test_throughput_is_a_plain_mean_until_the_smoothing_has_enough_steps():
    from hf_selfspec.policies import Throughput

    throughput = Throughput()
    for committed in (1, 4, 1, 4):
        throughput.add(committed, 1.0, smoothing=0.8)
    assert throughput.tokens == pytest.approx(2.5) and throughput.seconds == pytest.approx(1.0)
    throughput.add(9, 1.0, smoothing=0.8)  # from the fifth step on, each new one weighs 1 - 0.8
    assert throughput.tokens == pytest.approx(0.8 * 2.5 + 0.2 * 9)


def test_backoff_judges_a_draft_by_its_first_steps_together_not_by_the_first_alone():
    # A draft that pays on average (1 and then 4 tokens for 1.8 s each: 0.72 s a token against a
    # plain step's 1 s) but whose first step is rejected. Judged by that step alone (1.8 s a
    # token) it would be backed off at once; its first steps are averaged instead.
    backoff = ThroughputBackoff(probe_interval=4)
    decisions = []
    for step in range(FIRST + 6):
        speculate = backoff.should_speculate()
        decisions.append(speculate)
        if speculate:
            backoff.learn(_outcome(2, committed=1 if step % 2 == 0 else 4, seconds=1.8))
        else:
            backoff.learn(_outcome(0, committed=1, seconds=1.0))
    assert decisions[: FIRST + 1] == [True] * FIRST + [False]  # measure, then compare
    assert all(decisions[FIRST + 1 : FIRST + 5]) and not decisions[FIRST + 5]  # speculation won: plain is only probed


def test_backoff_returns_to_drafting_when_the_text_starts_repeating():
    backoff = ThroughputBackoff(probe_interval=4)
    _run(backoff, FIRST + 12, speculative_cost=1.8, speculative_tokens=1)
    assert not backoff.should_speculate()
    # From now on a draft commits 6 tokens: the next probe finds it, and drafting resumes.
    decisions = _run(backoff, 40, speculative_cost=1.8, speculative_tokens=6)
    first_probe = decisions.index(True)
    assert first_probe <= 16
    # Drafting resumes, and a switch of winner restarts probing at the base interval.
    assert all(decisions[first_probe + 1 : first_probe + 4]) and not decisions[first_probe + 4]


def test_backoff_probe_interval_zero_always_speculates():
    tiny = tiny_model("llama", initializer_range=0.3)
    parts = hf_selfspec.Strategy().build(tiny, hf_selfspec.SelfSpecParams(backoff_probe_interval=0), cache=None)
    assert type(parts.backoff) is hf_selfspec.Backoff
    assert all(_run(parts.backoff, 20, speculative_cost=5.0, speculative_tokens=1))


class _NeverSpeculate(hf_selfspec.Backoff):
    def should_speculate(self) -> bool:
        return False


def test_a_backoff_that_refuses_leaves_only_plain_steps_and_the_same_tokens():
    import torch

    @hf_selfspec.register_strategy("test_never_speculates")
    class NeverSpeculates(hf_selfspec.Strategy):
        def build_backoff(self, params):
            return _NeverSpeculate()

    model = tiny_model("llama", initializer_range=0.3)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 3, 14, 15, 92, 65, 3, 14]])
    plain = model.generate(prompt, max_new_tokens=20, do_sample=False, strategy="plain")
    output = model.generate(prompt, max_new_tokens=20, do_sample=False, strategy="test_never_speculates",
                            prompt_lookup_tokens=4, return_dict_in_generate=True)
    assert output.sequences.tolist() == plain.tolist()
    assert output.strategy_stats.drafted_tokens == 0 and output.strategy_stats.plain_steps == 19


def test_adaptive_lookup_length_grows_on_whole_acceptances_and_shrinks_on_cuts_within_bounds():
    from hf_selfspec.policies import AdaptiveLookupLength

    length = AdaptiveLookupLength(tokens=3, max_tokens=20)
    # (proposed, accepted) -> the next length: doubled on a whole acceptance (capped at 20),
    # halfway down to the accepted count on a cut (floored at 1)
    script = [((3, 3), 6), ((6, 6), 12), ((12, 12), 20), ((20, 20), 20), ((20, 7), 13), ((13, 0), 6),
              ((6, 0), 3), ((3, 0), 1), ((1, 0), 1), ((1, 1), 2), ((2, 2), 4)]  # fmt: skip
    for (proposed, accepted), expected in script:
        length.learn(_outcome(proposed, accepted))
        assert length.tokens == expected, (proposed, accepted)
    # A proposal the text cut short (its match ran into the end of the text) and taken whole still grows it.
    length.learn(_outcome(2, 2))
    assert length.tokens == 8


def test_an_adaptive_lookup_length_shrinks_no_further_than_its_floor():
    from hf_selfspec.policies import AdaptiveLookupLength

    length = AdaptiveLookupLength(tokens=6, max_tokens=16, min_tokens=4)
    # Cuts at the first token halve the way down as before, but stop at the floor of 4; whole
    # acceptances still double from there.
    script = [((6, 0), 4), ((4, 0), 4), ((4, 4), 8), ((8, 1), 4), ((4, 0), 4)]  # fmt: skip
    for (proposed, accepted), expected in script:
        length.learn(_outcome(proposed, accepted))
        assert length.tokens == expected, (proposed, accepted)
    # A floor above the starting length is that length: a proposal never shrinks below where it started.
    short_start = AdaptiveLookupLength(tokens=2, max_tokens=16, min_tokens=5)
    for _ in range(3):
        short_start.learn(_outcome(short_start.tokens, 0))
    assert short_start.tokens == 2


def test_a_fixed_lookup_length_never_moves():
    from hf_selfspec.policies import LookupLength

    length = LookupLength(5)
    for proposed, accepted in ((5, 5), (5, 0)):
        length.learn(_outcome(proposed, accepted))
        assert length.tokens == 5


def _choose_sources(choice, steps: int, lookup_cost: float, model_cost: float) -> list[bool]:
    """Feed `steps` choices between a lookup proposal and the model's draft; each commits one
    token per step in the given seconds."""
    decisions = []
    for _ in range(steps):
        lookup = choice.lookup_first()
        decisions.append(lookup)
        choice.learn(_outcome(1, 1, 1, lookup_cost if lookup else model_cost, TEXT_SOURCE if lookup else MODEL_SOURCE))
    return decisions


def test_draft_source_choice_goes_lookup_first_then_to_the_cheaper_source_and_probes_the_other():
    from hf_selfspec.policies import CheaperDraftSource, DraftSourceChoice

    assert all(_choose_sources(DraftSourceChoice(), 30, lookup_cost=5.0, model_cost=1.0))  # today's rule
    first = CheaperDraftSource._FIRST_LOOKUP_STEPS
    choice = CheaperDraftSource(probe_interval=4)
    # Lookup is cut at every step (2 s a token), the model's draft pays (1 s a token).
    decisions = _choose_sources(choice, first + 20, lookup_cost=2.0, model_cost=1.0)
    assert decisions[: first + 1] == [True] * first + [False]  # lookup measured first, then the model once
    lookup_probes = [step - first for step, lookup in enumerate(decisions) if lookup][first:]
    # the model wins; lookup is probed once idle 4 steps (the model's measuring step included), then 8
    assert lookup_probes == [4, 13]
    # The text turns to copying: a lookup proposal now commits 8 tokens, and the next probe finds it.
    later = []
    for _ in range(20):
        lookup = choice.lookup_first()
        later.append(lookup)
        choice.learn(_outcome(1, 1, 8 if lookup else 1, 2.0 if lookup else 1.0, TEXT_SOURCE if lookup else MODEL_SOURCE))
    switched = later.index(True)
    assert switched <= 16 and all(later[switched : switched + 4])


def test_a_draft_source_measured_where_lookup_had_nothing_is_compared_without_a_probe():
    from hf_selfspec.policies import CheaperDraftSource

    first = CheaperDraftSource._FIRST_LOOKUP_STEPS
    unmeasured = _choose_sources(CheaperDraftSource(probe_interval=16), first + 3, lookup_cost=1.0, model_cost=3.0)
    assert unmeasured == [True] * first + [False, True, True]  # the model's draft is measured by a probe
    choice = CheaperDraftSource(probe_interval=16)
    choice.learn(_outcome(1, 1, 1, 3.0))  # the model drafted where lookup found no match: already measured
    assert all(_choose_sources(choice, first + 3, lookup_cost=1.0, model_cost=3.0))


class _ScriptedDraft(hf_selfspec.decoding_types.Drafter):
    """The model's draft, scripted: always `tokens`, recording the feedback on its own drafts."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.feedback = tokens, []

    def propose(self, state, max_tokens, exit_policy, selector):
        return Draft(tokens=self.tokens[:max_tokens])

    def learn(self, outcome):
        if outcome.proposed_by(MODEL_SOURCE):
            self.feedback.append((outcome.draft.tokens, outcome.verdict.accepted, outcome.committed, outcome.seconds))


def _lookup(model, length, max_draft_tokens, model_backoff=None, sources=None, corpus=None, max_ngram=1):
    """Prompt lookup over the text (and `corpus`, a `CorpusLookup`) beside the scripted `model`,
    and a step of it: propose after `state`'s text, then learn how the verifier took the draft."""
    from hf_selfspec.lookup import PromptLookup, TextLookup
    from hf_selfspec.policies import Backoff, DraftSourceChoice

    lookup = PromptLookup(TextLookup(1, max_ngram, length), corpus, sources or DraftSourceChoice(),
                          model_backoff or Backoff(), max_draft_tokens)

    def step(state, max_tokens, accepted, committed, seconds=0.5):
        draft = lookup.propose(state, max_tokens, lambda tokens: model.propose(state, tokens, None, None))
        accepted = len(draft.tokens) if accepted is None else accepted
        outcome = _outcome_of(draft, accepted, accepted + 1 if committed is None else committed, seconds)
        lookup.learn(outcome)
        model.learn(outcome)
        return draft

    return lookup, step


def _state(text: list[int], size: int):
    from hf_selfspec.decoding_types import DecodingState

    sequence = torch.zeros((1, size), dtype=torch.long)
    sequence[0, : len(text)] = torch.tensor(text)
    return DecodingState(sequence, torch.arange(size)[None], len(text))


def test_lookup_learns_its_length_from_the_verifier_and_the_model_hears_its_own_drafts():
    from hf_selfspec.policies import AdaptiveLookupLength

    model = _ScriptedDraft([90, 91, 92])
    lookup, step = _lookup(model, AdaptiveLookupLength(2, 8), max_draft_tokens=2)
    state = _state([7] + list(range(10, 30)) + [7], 64)  # "7" recurs: lookup copies what followed it the first time
    proposed = []
    for accepted_whole in (True, True, False, False):
        draft = step(state, 16, None if accepted_whole else 1, None)
        assert draft.source == TEXT_SOURCE and draft.tokens == list(range(10, 10 + len(draft.tokens)))
        proposed.append(len(draft.tokens))
    assert proposed == [2, 4, 8, 4]  # grown on whole acceptances, capped at 8, halved towards 1 on a cut
    assert lookup.text.length.tokens == 2
    # Where lookup has nothing, the model drafts within max_draft_tokens and hears its verdict.
    state.length = 3  # "7 10 11": no earlier occurrence
    draft = step(state, 16, 1, 2, seconds=None)
    assert (draft.source, draft.tokens) == (MODEL_SOURCE, [90, 91])
    assert model.feedback == [([90, 91], 1, 2, None)] and lookup.text.length.tokens == 2


class _ScriptedBackoff(hf_selfspec.policies.Backoff):
    """Says whether to speculate from a script, recording what it is told."""

    def __init__(self, answers: list[bool]):
        self.answers, self.heard = answers, []

    def should_speculate(self):
        return self.answers.pop(0)

    def learn(self, outcome):
        self.heard.append((len(outcome.draft.tokens), outcome.committed, outcome.seconds))


def test_where_lookup_has_nothing_the_model_drafts_only_while_its_own_backoff_lets_it():
    from hf_selfspec.policies import LookupLength

    model, backoff = _ScriptedDraft([90, 91]), _ScriptedBackoff([True, False])
    _, step = _lookup(model, LookupLength(2), max_draft_tokens=2, model_backoff=backoff)
    text = [5, 6, 7, 8, 6]  # "6" recurs once the text reaches its end; nothing recurs before that

    def proposed(length, accepted, committed):
        draft = step(_state(text[:length], 16), 8, accepted, committed)
        return draft.source, draft.tokens

    assert proposed(3, 1, 2) == (MODEL_SOURCE, [90, 91])  # nothing to copy, and the back-off lets the model draft
    assert proposed(4, 0, 1) == (TEXT_SOURCE, [])  # nothing to copy, the back-off says no: a plain step
    assert proposed(5, 2, 3) == (TEXT_SOURCE, [7, 8])  # a match: lookup proposes, the back-off is not asked
    assert backoff.answers == []
    # It measures exactly the steps it decided: the model's draft, then the plain step.
    assert backoff.heard == [(2, 2, 0.5), (0, 1, 0.5)]
    assert model.feedback == [([90, 91], 1, 2, 0.5)]


def test_the_corpus_proposes_only_while_its_own_backoff_lets_it_and_learns_a_length_of_its_own():
    from hf_selfspec.decoding_types import CORPUS_SOURCE
    from hf_selfspec.lookup import CorpusLookup
    from hf_selfspec.lookup_corpus import LookupCorpus
    from hf_selfspec.policies import AdaptiveLookupLength

    corpus_backoff, model_backoff = _ScriptedBackoff([True, False, True, False]), _ScriptedBackoff([False, True])
    model = _ScriptedDraft([90])
    corpus = CorpusLookup(LookupCorpus([[40, 41, 42, 43, 44, 45]]), 1, 1, AdaptiveLookupLength(4, 8), corpus_backoff)
    _, step = _lookup(model, AdaptiveLookupLength(4, 8), max_draft_tokens=1, model_backoff=model_backoff,
                      corpus=corpus)
    unmatched = [5, 6, 40]  # "40" never occurred in the text; the corpus knows what follows it
    matched = [9, 10, 11, 12, 13, 14, 9]  # "9" recurs: the text itself has a continuation

    def proposed(text, accepted):
        draft = step(_state(text, 32), 16, accepted, None)
        return draft.source, draft.tokens

    assert proposed(unmatched, 0) == (CORPUS_SOURCE, [41, 42, 43, 44])  # the corpus may propose; all rejected
    assert proposed(unmatched, 0) == (TEXT_SOURCE, [])  # neither back-off lets its source propose: plain
    assert proposed(matched, 4) == (TEXT_SOURCE, [10, 11, 12, 13])  # the text's length was not cut by the corpus's
    assert proposed(unmatched, 0) == (CORPUS_SOURCE, [41, 42])  # the corpus's own length was: halved on its cut
    assert proposed(unmatched, 0) == (MODEL_SOURCE, [90])  # the corpus backed off, the model may draft
    assert corpus_backoff.answers == model_backoff.answers == []
    # Each back-off hears the steps it decided, as its source's (drafted tokens) or not (0).
    assert corpus_backoff.heard == [(4, 1, 0.5), (0, 1, 0.5), (2, 1, 0.5), (0, 1, 0.5)]
    assert model_backoff.heard == [(0, 1, 0.5), (1, 1, 0.5)]
    assert model.feedback == [([90], 0, 1, 0.5)]


def test_a_verbatim_proposal_copies_the_text_only_where_its_match_reaches_back_far_enough():
    from hf_selfspec.lookup import CorpusLookup
    from hf_selfspec.lookup_corpus import LookupCorpus
    from hf_selfspec.policies import VERBATIM_REACH, Backoff, LookupLength

    model = _ScriptedDraft([90])
    corpus = CorpusLookup(LookupCorpus([[9, 5, 70, 71]]), 1, 2, LookupLength(3), Backoff())
    lookup, _ = _lookup(model, LookupLength(3), max_draft_tokens=1, corpus=corpus, max_ngram=2)

    def verbatim(text):
        draft = lookup.verbatim(_state(text, 32), 16)
        return draft.source, draft.tokens

    # The text ends repeating "2 3 4 5": the match of "4 5" agrees with it for four tokens back.
    assert VERBATIM_REACH == 4
    assert verbatim([1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5]) == (TEXT_SOURCE, [6, 7, 8])
    # Three tokens of agreement, a chance one-token match, or none: no proposal, not even from the
    # corpus (which knows what follows "9 5") or the model.
    assert verbatim([1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 4, 5]) == (TEXT_SOURCE, [])
    assert verbatim([1, 2, 3, 4, 5, 6, 7, 8, 9, 5]) == (TEXT_SOURCE, [])
    assert verbatim([1, 2, 3]) == (TEXT_SOURCE, [])


class _RecordingLength(hf_selfspec.policies.AdaptiveLookupLength):
    lengths: list[int] = []

    def learn(self, outcome):
        super().learn(outcome)
        self.lengths.append(self.tokens)


class _ScriptedVerifier(LogitsProcessor):
    """Make the model's next token the script's: copying the prompt in long stretches, with
    fresh tokens between them that cut any lookup short."""

    def __init__(self, prompt_length: int, script: list[int]):
        self.prompt_length, self.script = prompt_length, script

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.script[input_ids.shape[1] - self.prompt_length]] = 0.0
        return forced


def test_an_adaptive_lookup_length_moves_both_ways_inside_generation_and_output_is_unchanged():
    @hf_selfspec.register_strategy("test_recording_lookup_length")
    class RecordingLookupLength(hf_selfspec.Strategy):
        def build_lookup_length(self, params):
            return _RecordingLength(params.prompt_lookup_tokens, params.prompt_lookup_max_tokens)

    model = tiny_model("llama", initializer_range=0.3)
    passage = list(range(20, 50))
    prompt = torch.tensor([passage])
    script = passage[:12] + [60, 61] + passage[5:25] + [62, 63, 64] + passage[:20]
    kwargs = dict(max_new_tokens=len(script), do_sample=False,
                  logits_processor=LogitsProcessorList([_ScriptedVerifier(prompt.shape[1], script)]))
    plain = model.generate(prompt, strategy="plain", **kwargs)
    assert plain[0, prompt.shape[1]:].tolist() == script
    _RecordingLength.lengths = []
    output = model.generate(prompt, strategy="test_recording_lookup_length", prompt_lookup_tokens=2,
                            prompt_lookup_max_tokens=12, max_draft_tokens=3, backoff_probe_interval=0,
                            return_dict_in_generate=True, **kwargs)
    assert output.sequences.tolist() == plain.tolist()
    lengths = [2] + _RecordingLength.lengths
    assert any(b > a for a, b in zip(lengths, lengths[1:]))  # grew
    assert any(b < a for a, b in zip(lengths, lengths[1:]))  # shrank
    assert all(1 <= length <= 12 for length in lengths) and 12 in lengths
    assert max(output.strategy_stats.accepted_lengths) > 3  # a lookup past the model draft's bound, taken
