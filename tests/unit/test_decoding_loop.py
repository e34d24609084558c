"""The decoding loop alone (`speculative_decode`), driven by a scripted drafter and a scripted
verifier: no transformer runs, so each test states exactly what every step proposes, accepts and
commits, and holds the loop's counters, its cache and its stopping to that.

The verifier stands in for the model: whatever its inputs, its logits at position p make TEXT[p + 1]
the greedy choice, so plain greedy decoding writes TEXT, and the loop must write it too. Its KV
entries are each input's (position, token), so the cache says which text it holds.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from hf_selfspec.cache import CACHE_ARGUMENT, DraftAwareCache
from hf_selfspec.decoding import DecodeRequest, RowParts, SpeculationParts, speculative_decode
from hf_selfspec.decoding_types import TEXT_SOURCE, Draft, Drafter, ExitPolicy
from hf_selfspec.policies import Backoff, Gate
from hf_selfspec.selection import TokenSelector
from hf_selfspec.stats import StrategyStats

VOCAB = 16
TEXT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]  # plain greedy's text, prompt included
WRONG = 0  # never in TEXT, so never the verifier's choice
LAYERS = 2


def write_kv(cache: DraftAwareCache, positions: list[int], tokens: list[int]) -> None:
    """One KV entry per input in every layer, holding its (position, token)."""
    entries = torch.tensor([positions, tokens], dtype=torch.float32).T[None, None]
    for layer in range(LAYERS):
        cache.update(entries, entries.clone(), layer)


def cached_text(cache: DraftAwareCache) -> list[tuple[int, int]]:
    """The (position, token) entries the cache holds, the same in every layer."""
    layers = [[(int(p), int(t)) for p, t in layer.keys[0, 0].tolist()] for layer in cache.layers]
    assert all(entries == layers[0] for entries in layers)
    return layers[0]


def entries_of(tokens: list[int]) -> list[tuple[int, int]]:
    return list(enumerate(tokens))


class ScriptedVerifier:
    """The model's forward, as the loop calls it, recording what each verification saw."""

    config = SimpleNamespace(num_hidden_layers=LAYERS)  # what the alternatives' mask reads
    dtype = torch.float32

    def __init__(self):
        self.calls: list[tuple[int, list[int]]] = []  # (cache length before, positions seen)

    def __call__(self, input_ids, position_ids, attention_mask, use_cache, logits_to_keep, **cache_keyword):
        cache = cache_keyword[CACHE_ARGUMENT]
        positions = position_ids[0].tolist()
        self.calls.append((cache.get_seq_length(), positions))
        write_kv(cache, positions, input_ids[0].tolist())
        logits = torch.zeros(len(positions), VOCAB)
        logits[torch.arange(len(positions)), [TEXT[p + 1] for p in positions]] = 1.0
        return SimpleNamespace(logits=logits[-logits_to_keep:][None])


class ScriptedDrafter(Drafter):
    """Proposes the next draft of its script at each call, cut to the room the loop allows, and
    writes it after the committed text as a drafter must. The draft's own forward passes are
    stood for by a KV entry per drafted token left in the shared cache, which the loop must drop
    before verifying."""

    def __init__(self, cache: DraftAwareCache, script: list[Draft]):
        self.cache, self.script = cache, list(script)
        self.limits: list[int] = []
        self.continued_from: list[int] = []
        self.records: list[tuple[int, int, bool]] = []  # (accepted, committed, timed)
        self.rollbacks: list[int] = []
        self.moved_rows: list[tuple[int, int]] = []

    def propose(self, state, max_tokens, exit_policy, selector):
        self.limits.append(max_tokens)
        scripted = self.script.pop(0)
        tokens = scripted.tokens[:max_tokens]
        state.sequence[0, state.length : state.length + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        start = self.cache.get_seq_length()
        write_kv(self.cache, list(range(start, start + len(tokens))), [WRONG] * len(tokens))
        return Draft(tokens, alternatives=scripted.alternatives[: len(tokens)])

    def continue_from(self, state, cached_length):
        self.continued_from.append(cached_length)

    def learn(self, outcome):
        self.records.append((outcome.verdict.accepted, outcome.committed, outcome.seconds is not None))
        if outcome.moved_row is not None:
            self.moved_rows.append(outcome.moved_row)

    def rollback(self, committed_kv_length):
        self.rollbacks.append(committed_kv_length)


class ScriptedVerbatimLookup:
    """Prompt lookup that offers only scripted verbatim proposals, free as lookup's are."""

    def __init__(self, verbatim: list[Draft]):
        self.script = list(verbatim)
        self.limits: list[int] = []

    def verbatim(self, state, max_tokens):
        self.limits.append(max_tokens)
        tokens = self.script.pop(0).tokens[:max_tokens]
        state.sequence[0, state.length : state.length + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return Draft(tokens, source=TEXT_SOURCE)

    def free(self, state, max_tokens):
        return Draft(source=TEXT_SOURCE)

    def learn(self, outcome):
        pass


class HeldOff(Backoff):
    """A back-off that never lets the loop speculate but lets verbatim repeats through (if told
    to), recording what it is told."""

    def __init__(self, verifies_verbatim: bool):
        self.verifies_verbatim = verifies_verbatim
        self.heard: list[tuple[int, int]] = []

    def should_speculate(self):
        return False

    def learn(self, outcome):
        if outcome.seconds is not None:
            self.heard.append((len(outcome.draft.tokens), outcome.committed))


def decode(prompt_length: int, max_length: int, script: list[Draft], max_proposal_tokens: int = 4,
           eos_token_id: int | None = None, cache: DraftAwareCache | None = None,
           backoff: Backoff | None = None, verbatim: list[Draft] | None = None):
    """Greedy decoding of TEXT's first `prompt_length` tokens up to `max_length`, as `generate`
    runs the loop: its result, the verifier, the drafter and the cache, for the test to inspect.
    With `verbatim`, a lookup offers those verbatim proposals when asked (`drafter.lookup`)."""
    cache = DraftAwareCache() if cache is None else cache
    verifier = ScriptedVerifier()
    drafter = ScriptedDrafter(cache, script)
    drafter.lookup = None if verbatim is None else ScriptedVerbatimLookup(verbatim)
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length)])
    if eos_token_id is not None:
        criteria.append(EosTokenCriteria(eos_token_id))
    backoff = Backoff() if backoff is None else backoff
    parts = SpeculationParts(drafter, backoff, [RowParts(ExitPolicy(0.0), Gate(), drafter.lookup)])
    selector = TokenSelector(LogitsProcessorList(), do_sample=False)
    request = DecodeRequest(torch.tensor([TEXT[:prompt_length]]), selector, criteria, max_length, max_proposal_tokens)
    result = speculative_decode(verifier, cache, parts, request, StrategyStats())
    assert drafter.script == []  # the loop asked for every scripted draft, and for no more
    assert verbatim is None or drafter.lookup.script == []
    return result, verifier, drafter, cache


def counters(stats: StrategyStats) -> dict:
    return {name: value for name, value in stats.as_dict().items() if not name.endswith("seconds")}


def test_the_loop_commits_plain_greedys_text_and_counts_each_step():
    """After the prompt's prefill: a draft of 3 whose first 2 match, one of 2 that both match,
    an empty one (a plain step), one cut to the single token the room allows and rejected, then
    a step with no room to draft."""
    result, verifier, drafter, cache = decode(prompt_length=3, max_length=13, script=[
        Draft(TEXT[4:6] + [WRONG]),
        Draft(TEXT[7:9]),
        Draft([]),
        Draft([WRONG, WRONG]),
    ])
    assert result.sequences.tolist() == [TEXT[:13]]
    assert counters(result.stats) == {
        "strategy": "", "drafted_tokens": 3 + 2 + 1, "accepted_tokens": 2 + 2 + 0, "acceptance_rate": 4 / 6,
        "mean_accepted_length": 4 / 3, "verification_steps": 3, "plain_steps": 2, "accepted_alternatives": 0,
        "accepted_lengths": [2, 2, 0],
    }
    # Each verification sees the newest committed token and the draft, right after the cache's
    # last entry: the draft's own KV was dropped first.
    assert [len(positions) for _, positions in verifier.calls] == [3, 1 + 3, 1 + 2, 1, 1 + 1, 1]
    assert [positions[0] for _, positions in verifier.calls] == [0, 3, 6, 9, 10, 11]
    assert all(cached == positions[0] for cached, positions in verifier.calls)
    assert drafter.limits == [4, 4, 2, 1]  # max_proposal_tokens, then the room before max_length
    # The drafter hears every step: the untimed prefill, the three verifications, and both plain steps.
    assert drafter.records == [(0, 1, False), (2, 3, True), (2, 3, True), (0, 1, True), (0, 1, True), (0, 1, True)]
    # After every step the cache keeps the committed text but its newest token, and only that.
    assert drafter.rollbacks == [3, 6, 9, 10, 11, 12]
    assert cached_text(cache) == entries_of(TEXT[:12])


def test_while_the_backoff_holds_speculation_off_only_verbatim_proposals_are_verified():
    """The back-off says no at every step, so the drafter is never asked for a draft; where the
    back-off lets verbatim repeats through, it is asked for a verbatim proposal instead: none at the prefill, then three tokens taken whole,
    then one rejected, and then there is no room left to propose."""
    backoff = HeldOff(verifies_verbatim=True)
    result, verifier, drafter, cache = decode(prompt_length=3, max_length=10, script=[], backoff=backoff,
                                              verbatim=[Draft([]), Draft(TEXT[4:7]), Draft([WRONG])])
    assert result.sequences.tolist() == [TEXT[:10]]
    assert drafter.limits == [] and drafter.lookup.limits == [4, 4, 1]
    assert counters(result.stats) == {
        "strategy": "", "drafted_tokens": 3 + 1, "accepted_tokens": 3, "acceptance_rate": 3 / 4,
        "mean_accepted_length": 3 / 2, "verification_steps": 2, "plain_steps": 1, "accepted_alternatives": 0,
        "accepted_lengths": [3, 0],
    }
    # The back-off hears the verbatim steps as speculation, the plain one as plain (not the prefill).
    assert backoff.heard == [(3, 4), (1, 1), (0, 1)]
    assert cached_text(cache) == entries_of(TEXT[:9])
    # A back-off that does not let them through leaves plain steps only.
    result, verifier, drafter, cache = decode(prompt_length=3, max_length=10, script=[],
                                              backoff=HeldOff(verifies_verbatim=False), verbatim=[])
    assert result.sequences.tolist() == [TEXT[:10]]
    assert drafter.lookup.limits == [] and result.stats.plain_steps == 6


def test_an_eos_inside_an_accepted_draft_ends_the_text_there():
    eos = TEXT[6]
    assert eos not in TEXT[:6]
    result, verifier, drafter, cache = decode(prompt_length=3, max_length=len(TEXT), eos_token_id=eos,
                                              script=[Draft(TEXT[4:8])])
    assert result.sequences.tolist() == [TEXT[:7]]  # the accepted tokens after EOS are not committed
    assert (result.stats.drafted_tokens, result.stats.accepted_tokens) == (4, 4)
    assert (result.stats.verification_steps, result.stats.plain_steps) == (1, 0)
    assert drafter.records == [(0, 1, False), (4, 3, True)]
    assert len(verifier.calls) == 2
    assert cached_text(cache) == entries_of(TEXT[:6])


def test_an_accepted_alternative_moves_its_kv_to_the_token_it_replaced():
    """The second drafted token is wrong, and its second alternative is the verifier's choice:
    it is committed with the verifier's next token from its own row, and its KV, computed past
    the chain, takes the rejected token's place."""
    result, verifier, drafter, cache = decode(prompt_length=3, max_length=8, script=[
        Draft([TEXT[4], WRONG, WRONG], alternatives=[[], [WRONG, TEXT[5]], []]),
    ])
    assert result.sequences.tolist() == [TEXT[:8]]
    assert counters(result.stats) == {
        "strategy": "", "drafted_tokens": 3, "accepted_tokens": 2, "acceptance_rate": 2 / 3,
        "mean_accepted_length": 2.0, "verification_steps": 1, "plain_steps": 1, "accepted_alternatives": 1,
        "accepted_lengths": [2],
    }
    # The chain (the newest committed token and 3 drafted), then both alternatives at position 5.
    assert verifier.calls[1] == (3, [3, 4, 5, 6, 5, 5])
    assert drafter.moved_rows == [(5, 2)]  # rows counted from the verification's first input
    assert drafter.records == [(0, 1, False), (2, 3, True), (0, 1, True)]
    assert cached_text(cache) == entries_of(TEXT[:7])


def test_a_cache_holding_the_prompts_start_is_continued():
    cache = DraftAwareCache()
    write_kv(cache, [0, 1], TEXT[:2])
    result, verifier, drafter, cache = decode(prompt_length=5, max_length=7, script=[], cache=cache)
    assert result.sequences.tolist() == [TEXT[:7]]
    assert drafter.continued_from == [2]
    assert verifier.calls == [(2, [2, 3, 4]), (5, [5])]  # the prefill covers only what was not cached
    # A prefill with nothing drafted is neither a plain step nor a verification.
    assert (result.stats.plain_steps, result.stats.verification_steps) == (1, 0)
    assert cached_text(cache) == entries_of(TEXT[:6])


def test_a_prompt_that_fills_max_length_runs_no_forward():
    result, verifier, drafter, cache = decode(prompt_length=4, max_length=4, script=[])
    assert result.sequences.tolist() == [TEXT[:4]]
    assert verifier.calls == [] and drafter.rollbacks == []
    assert counters(result.stats) == counters(StrategyStats())


def test_parts_built_for_another_number_of_rows_are_refused():
    cache = DraftAwareCache()
    parts = SpeculationParts(ScriptedDrafter(cache, []), Backoff(), [RowParts(ExitPolicy(0.0), Gate())])
    selector = TokenSelector(LogitsProcessorList(), do_sample=False)
    two_rows = torch.tensor([TEXT[:3], TEXT[:3]])
    request = DecodeRequest(two_rows, selector, StoppingCriteriaList([MaxLengthCriteria(6)]), 6, 4)
    with pytest.raises(ValueError, match="built for a batch of 1, the request has 2 rows"):
        speculative_decode(ScriptedVerifier(), cache, parts, request, StrategyStats())


def test_the_loops_contract_stays_small():
    """The loop reads on one screen: it takes few inputs, calls a drafter through few methods,
    and every part that adapts learns through one method, from one outcome record."""
    from hf_selfspec import drafters, lookup, policies

    assert len(inspect.signature(speculative_decode).parameters) <= 7
    drafter_methods = {name for name, value in vars(Drafter).items() if callable(value) and not name.startswith("_")}
    # a batch's rows draft together (`propose_rows`) and move in the cache (`realign`); both default
    # to what one text needs (`propose`, `rollback`); `guesses`, beside another source's proposal,
    # defaults to none
    assert drafter_methods == {"propose", "propose_rows", "guesses", "learn", "rollback", "realign", "continue_from"}
    adaptive = [
        Drafter, ExitPolicy, SpeculationParts, lookup.PromptLookup, lookup.TextLookup, lookup.CorpusLookup,
        *(part for module in (policies, drafters) for part in vars(module).values()
          if isinstance(part, type) and part.__module__ == module.__name__ and hasattr(part, "learn")),
    ]
    assert {policies.LookupLength, policies.DraftSourceChoice, drafters.ShallowExitDrafter} <= set(adaptive)
    for part in adaptive:
        others = {"update", "record", "verified", "keep_alternative", "propose_free", "propose_verbatim"} & set(dir(part))
        assert not others, (part, others)
