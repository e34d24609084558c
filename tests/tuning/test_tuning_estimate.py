"""The estimated objective: the draft pass, the decoding loop driven over plain greedy's known
tokens with priced seconds, and the study that confirms its best estimates by real decoding."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types

import optuna
import pytest
import torch
from optuna.trial import TrialState
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from helpers.tuning import write_study_config

from hf_selfspec import strategies
from hf_selfspec.cache import DraftAwareCache, cache_keyword
from hf_selfspec.decoding import DecodeRequest, Runtime, model_forward, speculative_decode
from hf_selfspec.decoding_types import DecodingState, Draft, Drafter, ExitPolicy
from hf_selfspec.drafters import LayerSkipDrafter
from hf_selfspec.layer_skip import SkippingDecoder
from hf_selfspec.measure import forward_timings, timed_generate
from hf_selfspec.params import SelfSpecParams, resolve_params
from hf_selfspec.policies import ThroughputBackoff
from hf_selfspec.selection import TokenSelector
from hf_selfspec.stats import StrategyStats
from helpers.adapters import random_adapter, random_heads
from helpers.tiny_models import NUM_LAYERS, tiny_model
from hf_selfspec.tuning.studies.config import SearchConfig, StudyConfigError, load_study_config
from hf_selfspec.tuning.costmodel.calibration import calibrate, verification_runs
from hf_selfspec.tuning.costmodel.estimated import EstimatedSpeedupObjective
from hf_selfspec.tuning.costmodel.predictions import draft_predictions
from hf_selfspec.tuning.costmodel.priced_decode import PricedClock, estimate_decode, plain_seconds
from hf_selfspec.tuning.costmodel.prices import CostModel
from hf_selfspec.tuning.costmodel.teacher_forcing import TeacherForcedPrompt, check_supported, teacher_force
from hf_selfspec.tuning.costmodel.timing import typical_seconds
from hf_selfspec.tuning.studies.export import export_profile
from hf_selfspec.tuning.studies.objective import PreparedPrompt
from hf_selfspec.tuning.studies.space import decode_params, warm_start_trials
from hf_selfspec.tuning.tune import format_summary, run_tune

pytestmark = pytest.mark.version_sensitive

NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 11, 17)


@pytest.fixture(scope="module")
def sharp_llama():
    return _sharp("llama")


def _sharp(architecture: str):
    """Sharp weights make confident, repetitive text: long accepted runs, lookup hits, a gate
    that opens and closes (Gemma's, with its scaled embeddings, repeat so much that a random
    adapter is never wrong; its default weights are sharp enough). No EOS: past it a real
    draft's acceptances are not in the reference."""
    model = tiny_model(architecture, initializer_range=None if architecture.startswith("gemma") else 0.3)
    model.generation_config.eos_token_id = None
    return model


def _prepared(model, length: int, seed: int, new_tokens: int = NEW_TOKENS) -> PreparedPrompt:
    # From id 3 up: no pad token, which transformers would mask in plain decoding's prompt.
    prompt = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    plain = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, strategy="plain",
                           return_dict_in_generate=True, output_logits=True)
    return PreparedPrompt(f"p{seed}", {"input_ids": prompt}, plain.sequences[0, length:].tolist(),
                          torch.cat(plain.logits))


def _free(num_layers: int) -> CostModel:
    """Costs do not matter to the counters."""
    return CostModel(num_layers, (0.0,) * 16, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


# A verification of k tokens costs more than one of k - 1, a drafted token a fraction of a
# verification (an adapter's more cheaply than the full model's): drafting pays only where it is
# accepted, so the back-off and the draft source choice have something to decide.
PRICES = CostModel(NUM_LAYERS, (0.0, 1.0, *(1.1 + 0.1 * k for k in range(14))), 0.2, 0.1, 0.05, 0.05, 0.0, 0.0, 0.1)


def _estimate(model, data: TeacherForcedPrompt, params: SelfSpecParams, strategy, cost: CostModel = PRICES):
    return estimate_decode(model, data, params, strategy, draft_predictions(model, data, params), cost)


@torch.no_grad()
def _decode(model, data: TeacherForcedPrompt, params: SelfSpecParams, strategy, cost: CostModel = PRICES):
    """Real decoding, its clock priced as the estimate's is: a back-off or a draft source choice
    then decides from the same seconds in both. Returns those seconds and the counters."""
    prompt = data.full_text[None, : data.prompt_length]
    max_length = data.prompt_length + data.max_new_tokens
    cache = DraftAwareCache(model.config)
    strategy = strategies.resolve_strategy(strategy)
    clock = PricedClock(cost, params, data.prefill_seconds)
    request = DecodeRequest(prompt, TokenSelector(LogitsProcessorList(), False),
                            StoppingCriteriaList([MaxLengthCriteria(max_length)]), max_length, params.max_proposal_tokens)
    runtime = Runtime(model_forward(model, cache), clock)
    result = speculative_decode(
        model, cache, strategy.build(model, params, cache), request, StrategyStats(strategy=strategy.name), runtime
    )
    assert result.sequences[0].tolist() == data.full_text.tolist()  # lossless, as ever
    return clock.seconds, result.stats


def _counters(stats: StrategyStats) -> dict:
    keys = ("drafted_tokens", "accepted_tokens", "verification_steps", "plain_steps", "accepted_alternatives",
            "accepted_lengths")  # fmt: skip
    return {key: getattr(stats, key) for key in keys}


def _estimated_as_decoded(model, params: SelfSpecParams, strategy, contrast) -> tuple[StrategyStats, StrategyStats]:
    """Asserts that on each prompt the estimate and a real decode priced alike agree on every
    counter and on the seconds; returns the estimate's counters summed over the prompts, and
    `contrast`'s (another estimate of the same text)."""
    total, contrasted = StrategyStats(), StrategyStats()
    for seed, length in enumerate(PROMPT_LENGTHS):
        data = teacher_force(model, _prepared(model, length, seed, 40), 40)
        estimated_seconds, estimated = _estimate(model, data, params, strategy)
        real_seconds, real = _decode(model, data, params, strategy)
        assert _counters(estimated) == _counters(real), seed
        assert estimated_seconds == pytest.approx(real_seconds), seed
        total.add(estimated)
        contrasted.add(contrast(data))
    return total, contrasted


# Every rule at work: a lookup whose length adapts, the choice between it and the model's draft,
# the back-off, the draft's alternatives, each strategy's exit policy and gate.
EVERY_RULE = {
    "max_draft_tokens": 3, "draft_exit_threshold": 0.3, "draft_alternatives": 1, "prompt_lookup_tokens": 2,
    "prompt_lookup_min_ngram": 1, "prompt_lookup_max_tokens": 8, "prompt_lookup_min_tokens": 2,
    "draft_source_probe_interval": 2, "backoff_probe_interval": 2, "target_confidence_threshold": 0.5,
}  # fmt: skip
# Drafts whose predictions are exact: the full model drafting for itself (always accepted), and a
# trained adapter, whose shallow layers are the full model's own (often rejected).
DRAFTS = ("full model", "adapter")


def _kangaroo_estimate_checked_by_decoding(model, params, length: int, seed: int):
    """A prompt's teacher-forced data and the estimate's Kangaroo counters, asserted equal to what
    a real `generate` with the same params counts."""
    prompt = _prepared(model, length, seed)
    data = teacher_force(model, prompt, NEW_TOKENS)
    _, estimated = _estimate(model, data, params, "kangaroo", _free(NUM_LAYERS))
    real = model.generate(prompt.inputs["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False,
                          strategy="kangaroo", return_dict_in_generate=True, **params.as_dict()).strategy_stats
    assert _counters(estimated) == _counters(real), seed
    return data, estimated


def test_the_estimate_of_lookup_alone_counts_what_decoding_does(sharp_llama):
    """`max_draft_tokens` 0 (the warm start's lookup alone): lookup proposes, the model never
    drafts, in the estimate as in a decode."""
    params = resolve_params(NUM_LAYERS, {**EVERY_RULE, "max_draft_tokens": 0, "backoff_probe_interval": 0})
    total, _ = _estimated_as_decoded(sharp_llama, params, "self_speculative", lambda data: StrategyStats())
    assert total.drafted_tokens > 0 and total.accepted_alternatives == 0


@pytest.mark.parametrize(
    "strategy, draft",
    [
        (name, draft)
        for name in strategies.available_strategies()
        for draft in DRAFTS
        if draft == "adapter" or not strategies.resolve_strategy(name).needs_draft_adapter
    ],
)
def test_the_estimate_counts_what_decoding_does_with_every_strategy(sharp_llama, tmp_path, strategy, draft):
    """The estimate runs the decoding loop itself with the strategy's own parts, so with a draft
    it predicts exactly, and its clock priced alike, it reports what a real decode reports:
    every counter, step for step, and the same priced seconds."""
    if draft == "adapter":
        knobs = {"draft_adapter": random_adapter(sharp_llama, 1, tmp_path)}
    else:
        knobs = {"attn_skip_layers": [], "mlp_skip_layers": []}
    params = resolve_params(NUM_LAYERS, {**EVERY_RULE, **knobs})
    never_adapting = resolve_params(
        NUM_LAYERS, {**EVERY_RULE, **knobs, "backoff_probe_interval": 0, "draft_source_probe_interval": 0}
    )
    total, without_the_timed_rules = _estimated_as_decoded(
        sharp_llama, params, strategy, lambda data: _estimate(sharp_llama, data, never_adapting, strategy)[1]
    )
    assert 0 < total.accepted_tokens and total.verification_steps > 0 and total.plain_steps > 0
    # the back-off and the draft source choice, which learn from the clock, changed the decode
    assert _counters(total) != _counters(without_the_timed_rules)


@pytest.mark.parametrize(
    "architecture, exit_layer, mlp, draft_vocab_size, draft_alternatives, threshold",
    [
        ("llama", 1, True, 0, 0, 0.0), ("llama", 2, False, 24, 0, 0.3), ("llama", 1, True, 24, 1, 0.6),
        ("llama", 2, True, 0, 2, 0.3), ("qwen3", 1, True, 0, 0, 0.3), ("qwen3", 2, True, 0, 0, 0.3),
        # Text longer than the window: the pass keeps every key and masks each layer type.
        ("mistral", 2, True, 0, 2, 0.3), ("qwen2", 2, True, 24, 1, 0.0), ("gemma2", 1, True, 0, 2, 0.6),
        ("gemma3", 2, True, 0, 1, 0.3),
    ],
)
def test_the_estimate_counts_what_decoding_with_a_trained_adapter_does(
    tmp_path, architecture, exit_layer, mlp, draft_vocab_size, draft_alternatives, threshold
):
    """An adapter drafts from the full model's own shallow layers, so as long as its tokens are
    right, the one pass over the text predicts exactly what a real draft proposes next, and its
    runner-ups; past a wrong token, the side branches draft what the real draft goes on to
    propose and how sure it is. So the estimate matches a real decode (`generate` itself) step for
    step: rejections, rescues by an alternative, and where an exit threshold stops each draft."""
    model = _sharp(architecture)
    adapter = random_adapter(model, exit_layer, tmp_path, mlp=mlp)
    params = resolve_params(NUM_LAYERS, {
        "draft_adapter": adapter, "max_draft_tokens": 4, "draft_exit_threshold": threshold,
        "draft_vocab_size": draft_vocab_size, "backoff_probe_interval": 0, "draft_alternatives": draft_alternatives,
    })  # fmt: skip
    total = StrategyStats()
    for seed, length in enumerate(PROMPT_LENGTHS):
        _, estimated = _kangaroo_estimate_checked_by_decoding(model, params, length, seed)
        total.add(estimated)
    assert 0 < total.accepted_tokens < total.drafted_tokens  # both acceptances and rejections
    assert (total.accepted_alternatives > 0) == (draft_alternatives > 0)


@pytest.mark.parametrize(
    "architecture, draft_vocab_size, draft_alternatives, threshold, chained, beside_lookup",
    [("llama", 0, 0, 0.0, False, 0), ("llama", 24, 2, 0.3, False, 0), ("qwen2", 0, 1, 0.0, False, 0),
     ("gemma3", 0, 0, 0.3, False, 0), ("llama", 0, 0, 0.0, True, 0), ("qwen2", 24, 2, 0.3, True, 0),
     ("gemma3", 0, 1, 0.0, True, 0), ("llama", 24, 0, 0.0, True, 3), ("qwen2", 0, 1, 0.3, False, 2)],
)
def test_the_estimate_counts_what_decoding_with_draft_heads_does(
    tmp_path, architecture, draft_vocab_size, draft_alternatives, threshold, chained, beside_lookup
):
    """Draft heads read only the full model's final states of committed text (a chain, the
    tokens as well: the committed ones, then its own), so the one pass over the text predicts
    exactly what they propose after each token, the later heads' tokens included: the estimate
    matches a real decode step for step. Reading those states leaves the teacher-forced KV,
    which every trial reads, exactly as it was."""
    model = _sharp(architecture)
    params = resolve_params(NUM_LAYERS, {
        "draft_adapter": random_heads(model, tmp_path, chained=chained), "max_draft_tokens": 3, "draft_exit_threshold": threshold,
        "draft_vocab_size": draft_vocab_size, "backoff_probe_interval": 0, "draft_alternatives": draft_alternatives,
        **({"prompt_lookup_tokens": 3, "prompt_lookup_min_ngram": 1, "lookup_alternatives": beside_lookup} if beside_lookup else {}),
    })  # fmt: skip
    total = StrategyStats()
    for seed, length in enumerate(PROMPT_LENGTHS):
        data, estimated = _kangaroo_estimate_checked_by_decoding(model, params, length, seed)
        kept = [(layer.keys.clone(), layer.values.clone()) for layer in data.cache.layers]
        draft_predictions(model, data, params)
        for (keys, values), layer in zip(kept, data.cache.layers, strict=True):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        total.add(estimated)
    assert 0 < total.accepted_tokens < total.drafted_tokens


class _PatternDrafter(Drafter):
    """Proposes `pattern(committed text)`, cut to the room: a drafter of a test's own, which
    costs no forward pass and which no built-in strategy composes."""

    def __init__(self, pattern):
        self.pattern = pattern

    def propose(self, state, max_tokens, exit_policy, selector):
        tokens = self.pattern(state.sequence[0, : state.length].tolist())[:max_tokens]
        state.sequence[0, state.length : state.length + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return Draft(tokens=tokens)


def _recall(text: list[int]) -> list[int]:
    """What followed the newest token where it occurred last before."""
    earlier = [index for index, token in enumerate(text[:-1]) if token == text[-1]]
    return text[earlier[-1] + 1 : earlier[-1] + 4] if earlier else []


@pytest.fixture
def own_drafter_strategy(monkeypatch):
    """Register a strategy whose drafter is its own, proposing `pattern`; unregistered after the
    test, and tunable with the knobs every strategy declares."""

    def register(name: str, pattern) -> str:
        class OwnDrafter(strategies.Strategy):
            def build_drafter(self, model, params, cache, assistant_model, model_drafter=None):
                return _PatternDrafter(pattern)

        monkeypatch.setitem(strategies._REGISTRY, name, OwnDrafter)
        strategies.register_strategy(name)(OwnDrafter)
        return name

    return register


def test_a_strategy_with_its_own_drafter_is_estimated_with_that_drafter(sharp_llama, own_drafter_strategy):
    """Its drafter is what the strategy builds, not the model's draft the estimate predicts: the
    estimate proposes what it proposes, and reports what a real decode with it reports."""
    strategy = own_drafter_strategy("recall", _recall)
    params = resolve_params(NUM_LAYERS, {"max_draft_tokens": 3, "backoff_probe_interval": 2})
    own, default = _estimated_as_decoded(
        sharp_llama, params, strategy, lambda data: _estimate(sharp_llama, data, params, "self_speculative")[1]
    )
    assert own.accepted_tokens > 0
    assert _counters(own) != _counters(default)


def test_a_trial_that_accepts_nothing_is_never_estimated_above_plain(sharp_llama, own_drafter_strategy):
    """Priced so that a verification step costs less than a plain step (as a cost model timed on
    a busy machine can be), a draft that is never accepted would be estimated faster than plain;
    but every token then took a full forward pass, as in plain decoding, so the trial's value
    is no more than plain's."""
    forced = [teacher_force(sharp_llama, _prepared(sharp_llama, length, seed), NEW_TOKENS)
              for seed, length in enumerate(PROMPT_LENGTHS)]  # fmt: skip
    unused = min(set(range(sharp_llama.config.vocab_size)) - {token for data in forced for token in data.reference})
    strategy = own_drafter_strategy("never_right", lambda text: [unused] * 3)
    cheap_steps = CostModel(NUM_LAYERS, (0.0,) + (1.0,) * 15, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    params = resolve_params(NUM_LAYERS, {"max_draft_tokens": 3})
    for data in forced:
        seconds, stats = _estimate(sharp_llama, data, params, strategy, cheap_steps)
        assert stats.drafted_tokens > 0 and stats.accepted_tokens == 0
        assert seconds < plain_seconds(data, cheap_steps)  # what the cost model alone would claim

    objective = EstimatedSpeedupObjective(sharp_llama, forced, cheap_steps, SearchConfig(strategy=strategy), "test")
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial(warm_start_trials(SearchConfig(strategy=strategy), NUM_LAYERS)[0])
    study.optimize(objective, n_trials=1)
    (trial,) = study.trials
    assert trial.user_attrs["acceptance_rate"] == 0.0
    assert trial.value <= 1.0


@pytest.mark.parametrize("architecture", ["llama", "gemma2"])
def test_the_estimate_adapts_the_lookup_length_as_decoding_does(tmp_path, architecture):
    """One-token matches proposed at a length that grows while proposals are taken whole and
    shrinks when they are cut, beside an adapter's draft that the verifier sometimes rejects:
    the estimate runs the decoding loop's own lookup drafter and length policy, so it matches a
    real decode step for step, and the adaptation changes what is proposed."""
    model = _sharp(architecture)
    fixed = {
        "draft_adapter": random_adapter(model, 1, tmp_path), "max_draft_tokens": 3, "draft_exit_threshold": 0.3,
        "prompt_lookup_tokens": 2, "prompt_lookup_min_ngram": 1, "backoff_probe_interval": 0,
    }  # fmt: skip
    params = resolve_params(NUM_LAYERS, {**fixed, "prompt_lookup_max_tokens": 12})
    changed = 0
    for seed, length in enumerate(PROMPT_LENGTHS):
        data, estimated = _kangaroo_estimate_checked_by_decoding(model, params, length, seed)
        _, at_fixed_length = _estimate(model, data, resolve_params(NUM_LAYERS, fixed), "kangaroo", _free(NUM_LAYERS))
        changed += at_fixed_length.drafted_tokens != estimated.drafted_tokens
    assert changed > 0


def test_the_estimate_chooses_the_cheaper_draft_source_by_its_priced_steps(sharp_llama):
    """A full-model draft is always accepted and here costs nothing, while one-token lookups are
    mostly cut: choosing by priced seconds per committed token, the estimate turns to the model's
    draft where lookup would have gone first, commits the text in fewer, longer steps, and makes
    the choices a real decode priced alike makes."""
    knobs = {"attn_skip_layers": [], "mlp_skip_layers": [], "max_draft_tokens": 2, "draft_exit_threshold": 0.0,
             "prompt_lookup_tokens": 2, "prompt_lookup_min_ngram": 1, "backoff_probe_interval": 0}  # fmt: skip
    cost = CostModel(NUM_LAYERS, (0.0,) + (1.0,) * 15, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3, new_tokens=96), 96)

    def estimate(draft_source_probe_interval: int):
        params = resolve_params(NUM_LAYERS, {**knobs, "draft_source_probe_interval": draft_source_probe_interval})
        seconds, stats = _estimate(sharp_llama, data, params, "self_speculative", cost)
        assert _counters(stats) == _counters(_decode(sharp_llama, data, params, "self_speculative", cost)[1])
        return seconds, stats

    lookup_first_seconds, lookup_first = estimate(0)
    chosen_seconds, chosen = estimate(4)
    assert lookup_first.accepted_tokens < lookup_first.drafted_tokens  # lookups were cut
    assert chosen.verification_steps < lookup_first.verification_steps
    assert chosen.acceptance_rate > lookup_first.acceptance_rate
    assert chosen_seconds < lookup_first_seconds


def test_an_adapter_draft_is_priced_as_the_layers_below_its_exit_and_one_more_block(tmp_path):
    """Attention and MLP priced apart (1 and 10 units), so the sum says which ran: every layer
    below the exit whole, then the adapter's attention and, if it has one, its MLP."""
    model = tiny_model("llama")
    cost = CostModel(NUM_LAYERS, (0.0,) * 16, 0.0, 0.0, 1.0, 10.0, 0.0, 0.0)
    for exit_layer, mlp, units in ((1, True, 2 + 20), (2, False, 3 + 20), (3, True, 4 + 40)):
        params = resolve_params(NUM_LAYERS, {"draft_adapter": random_adapter(model, exit_layer, tmp_path, mlp=mlp)})
        assert cost.draft_token_seconds(params) == units, (exit_layer, mlp)


def test_untimed_draft_heads_are_priced_as_a_draft_without_layers(tmp_path):
    model = tiny_model("llama")
    cost = CostModel(NUM_LAYERS, (0.0,) * 16, 0.0, 100.0, 1.0, 10.0, 0.0, 0.0)
    assert cost.draft_token_seconds(resolve_params(NUM_LAYERS, {"draft_adapter": random_heads(model, tmp_path)})) == 100


def test_calibration_times_each_listed_adapter_and_prices_its_trials_with_that(sharp_llama, tmp_path):
    """An adapter's block, mask and rotary set-up are not a decoder layer's, so calibration times
    each listed adapter's real draft; a trial choosing it is priced at that time (the restricted
    head's difference added as for any draft), and the prompt's teacher-forced KV, which every
    trial then reads, is left exactly as it was."""
    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3), NEW_TOKENS)
    kept = [(layer.keys.clone(), layer.values.clone()) for layer in data.cache.layers]
    adapters = [random_adapter(sharp_llama, exit_layer, tmp_path) for exit_layer in (1, 3)] + [random_heads(sharp_llama, tmp_path)]
    cost = calibrate(sharp_llama, data, NUM_LAYERS, 4, adapters)
    assert sorted(cost.adapter_draft_seconds) == sorted(adapters)
    for adapter in adapters:
        timed = cost.adapter_draft_seconds[adapter]
        assert timed > 0
        assert cost.draft_token_seconds(resolve_params(NUM_LAYERS, {"draft_adapter": adapter})) == timed
        restricted = resolve_params(NUM_LAYERS, {"draft_adapter": adapter, "draft_vocab_size": 32})
        head = cost.restricted_head_constant + 32 * cost.restricted_head_per_row
        assert cost.draft_token_seconds(restricted) == pytest.approx(max(timed + head, 0.0))
    assert data.cache.get_seq_length() == data.kv_length
    for (keys, values), layer in zip(kept, data.cache.layers, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)




def test_calibration_times_every_price_in_rounds_so_a_burst_of_load_bends_none(sharp_llama, tmp_path):
    """Every timing costs one unit but those of a burst as long as the first round, which cost
    ten: timed one item after another, the burst would fall on the first item's every timing; in
    rounds it falls on one timing of each, and every typical time is the unit. So the verifier costs
    the same at every width, the draft nothing per sub-layer and the head nothing per row."""
    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3), NEW_TOKENS)
    adapter = random_adapter(sharp_llama, 1, tmp_path)
    items = 4 + 3 + 3 + 1 + 3  # widths, skip sets, heads, the adapter, the prefill, two plain decodes
    names = []  # of the runs timed so far; a round ends with the plain decode on the verifier's kernels
    calls = []

    def bursting_timer(run):
        run()
        first_round = "plain_decode_on_verifier_kernels" not in names
        names.append(getattr(run, "__name__", ""))
        calls.append(run)
        return 10.0 if first_round else 1.0

    cost = calibrate(sharp_llama, data, NUM_LAYERS, 4, [adapter], timer=bursting_timer)
    first_round = calls[: names.index("plain_decode_on_verifier_kernels") + 1]
    assert len(set(first_round)) == items  # every item, the widths more than once
    assert len(first_round) > items
    assert cost.verify_seconds == (0.0, 1.0, 1.0, 1.0, 1.0)
    assert cost.attention_seconds == cost.mlp_seconds == 0.0
    assert cost.restricted_head_per_row == 0.0
    full_model_draft = resolve_params(NUM_LAYERS, {"attn_skip_layers": [], "mlp_skip_layers": []})
    assert cost.draft_token_seconds(full_model_draft) == pytest.approx(cost.adapter_draft_seconds[adapter])


def test_plain_is_priced_at_its_decodes_step_against_the_verifiers_and_the_overhead_timed_within_it(
    sharp_llama, monkeypatch
):
    """Plain's step is the verifier's one-token pass, as timed in the rounds, times what a plain
    decode's step takes on the stock kernels over what one takes on the verifier's (here 0.8 of
    it), each read off whole decodes timed in the same rounds. Plain's overhead per step is what
    the stock decode spends beyond its forward passes, timed within it, in the cost model's
    units. A busy machine's long tail of slow calls, which a few short timed calls miss but a
    long decode pays (here its forward passes take 1.6 times their price), moves neither."""
    from hf_selfspec.tuning.costmodel import calibration

    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3), NEW_TOKENS)
    steps, prefill, step, verifier_step, overhead, tail = len(data.reference), 0.5, 0.8, 1.0, 0.02, [1.0]
    running = [""]  # the run being timed

    @contextlib.contextmanager
    def forward_timings(model):
        on_verifier = running[0] == "plain_decode_on_verifier_kernels"
        seconds = (verifier_step if on_verifier else step) * tail[0]
        yield [(data.prompt_length, prefill * tail[0]), *((1, seconds),) * (steps - 1)]

    def timer(run):
        running[0] = getattr(run, "__name__", "")
        run()
        if running[0] == "plain_decode":
            return (prefill + (steps - 1) * step + steps * overhead) * tail[0]
        return {"prefill": prefill, "plain_decode_on_verifier_kernels": 0.0}.get(running[0], 1.0)

    monkeypatch.setattr(calibration, "forward_timings", forward_timings)
    for slower in (1.0, 1.6):
        tail[0] = slower
        cost = calibrate(sharp_llama, data, NUM_LAYERS, 4, timer=timer)
        assert cost.verify(1) == 1.0 and cost.plain_forward() == pytest.approx(step)
        assert cost.plain_step_overhead == pytest.approx(overhead)
        priced = prefill + (steps - 1) * step + steps * overhead
        assert plain_seconds(dataclasses.replace(data, prefill_seconds=prefill), cost) == pytest.approx(priced)


def test_plain_is_priced_in_the_ratio_its_decodes_keep_to_the_verifiers_one_token_pass(sharp_llama, monkeypatch):
    """Where the rounds time the verifier's one-token pass at twice what a decode's step on the
    same kernels averaged (a busy machine's short calls landing behind the neighbour), plain's
    step is priced at twice its decode's step too: plain and every verification stand in the
    ratio their decodes' steps keep, whatever the level the short calls read."""
    from hf_selfspec.tuning.costmodel import calibration

    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3), NEW_TOKENS)
    running = [""]

    @contextlib.contextmanager
    def forward_timings(model):
        step = 0.9 if running[0] == "plain_decode_on_verifier_kernels" else 1.2
        yield [(data.prompt_length, 0.5), *((1, step),) * (len(data.reference) - 1)]

    def timer(run):
        running[0] = getattr(run, "__name__", "")
        run()
        return 1.8

    monkeypatch.setattr(calibration, "forward_timings", forward_timings)
    cost = calibrate(sharp_llama, data, NUM_LAYERS, 4, timer=timer)
    assert cost.verify(1) == pytest.approx(1.8)
    assert cost.plain_forward() == pytest.approx(1.8 * 1.2 / 0.9)


def test_the_verifier_is_priced_over_every_text_it_is_timed_after(sharp_llama, monkeypatch):
    """Timed after two texts, the verifier's passes take turns between them, and a width's price
    is the typical of all its timings: here a one-token pass costs 1 after the short text and 2
    after the long one, so the price lies between, where the short text's alone gives 1."""
    from hf_selfspec.tuning.costmodel import calibration

    short, long = (teacher_force(sharp_llama, _prepared(sharp_llama, length, seed=3), NEW_TOKENS) for length in (11, 17))
    after: list[int] = []  # the length of text the run's forward passes ran after
    one_token: list[float] = []  # every one-token verification's timing
    forward = calibration.verifier_forward

    def recording_forward(model, input_ids, start, *args, **kwargs):
        after.append(start)
        return forward(model, input_ids, start, *args, **kwargs)

    @contextlib.contextmanager
    def forward_timings(model):
        yield [(short.prompt_length, 0.5), *((1, 1.0),) * (len(short.reference) - 1)]

    def timer(run):
        after.clear()
        run()
        width = run.args[0] if isinstance(run, functools.partial) else None
        if width != 1:
            return 3.0 if width else 1.0
        one_token.append(2.0 if after == [long.kv_length] else 1.0)
        return one_token[-1]

    monkeypatch.setattr(calibration, "verifier_forward", recording_forward)
    monkeypatch.setattr(calibration, "forward_timings", forward_timings)
    assert calibrate(sharp_llama, short, NUM_LAYERS, 4, timer=timer).verify(1) == 1.0
    one_token.clear()
    cost = calibrate(sharp_llama, short, NUM_LAYERS, 4, timer=timer, verified_after=[short, long])
    assert abs(one_token.count(1.0) - one_token.count(2.0)) <= 1 and len(set(one_token)) == 2
    assert cost.verify(1) == pytest.approx(typical_seconds(one_token))
    assert 1.0 < cost.verify(1) < 2.0


def _scripted_loop_decode(monkeypatch, data: TeacherForcedPrompt, forwards, draft: float, outside: float, load: list):
    """Has `calibrate_loop`'s probe decode of `data` take the forward passes `forwards`
    (`(width, idle seconds)`), `draft` idle seconds of drafting and `outside` idle seconds of the
    loop's own work, all times `load[0]`, without decoding."""
    from hf_selfspec.tuning.costmodel import calibration

    recorded: list = []

    @contextlib.contextmanager
    def forward_timings(model):
        recorded.clear()
        yield recorded

    def timed_generate(model, inputs, strategy, **kwargs):
        assert strategy == "self_speculative"
        recorded.extend((width, seconds * load[0]) for width, seconds in forwards)
        total = sum(seconds for _, seconds in forwards) + draft + outside
        stats = StrategyStats(verification_steps=len(forwards) - 1, draft_seconds=draft * load[0])
        return types.SimpleNamespace(seconds=total * load[0], stats=stats)

    monkeypatch.setattr(calibration, "forward_timings", forward_timings)
    monkeypatch.setattr(calibration, "timed_generate", timed_generate)


def test_a_load_while_the_loop_is_timed_is_not_taken_for_its_overhead(sharp_llama, monkeypatch):
    """The loop's overhead is its decode's time beyond its drafting and its forward passes, all
    timed in that decode: a neighbour that slows everything threefold, or a draft dearer than the
    cost model says, leaves it as it reads on an idle machine; forward passes timed cheaper than
    the cost model prices them read it in the cost model's units."""
    from hf_selfspec.tuning.costmodel import calibration

    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3), NEW_TOKENS)
    cost = dataclasses.replace(PRICES, loop_step_overhead=0.0)
    steps, overhead, load = 6, 0.05, [1.0]
    forwards = [(data.prompt_length, data.prefill_seconds), *((4, cost.verify(4)),) * (steps - 1)]
    _scripted_loop_decode(monkeypatch, data, forwards, 2.0, steps * overhead, load)
    assert calibration.calibrate_loop(sharp_llama, cost, [data], {}).loop_step_overhead == pytest.approx(overhead)
    load[0] = 3.0
    assert calibration.calibrate_loop(sharp_llama, cost, [data], {}).loop_step_overhead == pytest.approx(overhead)

    _scripted_loop_decode(monkeypatch, data, forwards, 20.0, steps * overhead, load)
    assert calibration.calibrate_loop(sharp_llama, cost, [data], {}).loop_step_overhead == pytest.approx(overhead)

    halved = [(width, seconds / 2) for width, seconds in forwards]
    _scripted_loop_decode(monkeypatch, data, halved, 1.0, steps * overhead / 2, load)
    assert calibration.calibrate_loop(sharp_llama, cost, [data], {}).loop_step_overhead == pytest.approx(overhead)


def test_the_loop_probe_times_the_prefill_and_every_verification_of_its_decode(sharp_llama):
    """`forward_timings` sees the full model's own forward passes in a real decode, and no
    draft's: the prompt's prefill, then one verification of each step, as wide as its draft and
    the newest committed token."""
    from hf_selfspec.tuning.costmodel import calibration

    inputs = _prepared(sharp_llama, 11, seed=3).inputs
    kwargs = {"strategy": "self_speculative", "max_new_tokens": NEW_TOKENS, "do_sample": False}
    kwargs |= resolve_params(NUM_LAYERS, calibration._LOOP_PROBE).as_dict()
    with forward_timings(sharp_llama) as forwards:
        run = timed_generate(sharp_llama, inputs, **kwargs)
    assert run.stats.verification_steps > 1
    assert forwards[0][0] == inputs["input_ids"].shape[1]
    assert len(forwards) == 1 + run.stats.verification_steps + run.stats.plain_steps
    assert sum(width - 1 for width, _ in forwards[1:]) == run.stats.drafted_tokens
    assert all(seconds > 0 for _, seconds in forwards)
    timed = len(forwards)
    timed_generate(sharp_llama, inputs, **kwargs)  # outside: no longer timed
    assert len(forwards) == timed


def test_the_probe_verifies_outside_autograd_as_decoding_does(sharp_llama):
    """The cost-model watch probes from an Optuna callback, where autograd is on. A verification
    recorded for autograd would chain its graph onto the shared cache's, so every probe would
    keep the last one's memory alive, and it would run on other kernels than decoding's."""
    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3), NEW_TOKENS)
    assert torch.is_grad_enabled() and any(parameter.requires_grad for parameter in sharp_llama.parameters())
    for run in verification_runs(sharp_llama, [data], (1, 4)).values():
        run()
    assert not any(layer.keys.requires_grad or layer.values.requires_grad for layer in data.cache.layers)


def test_the_estimate_looks_up_in_a_corpus_as_decoding_does(sharp_llama, tmp_path):
    """Lookups only (a closed gate), first in the text, then in the model's own writing: the
    estimate proposes exactly what a real decode proposes, with the loop's own lookup."""
    from hf_selfspec.lookup_corpus import save_lookup_corpus

    texts = [_prepared(sharp_llama, 4, seed).reference_tokens for seed in range(10, 16)]
    path = save_lookup_corpus(texts, tmp_path / "own", sharp_llama.config.vocab_size, "the model's own")
    knobs = {
        "target_confidence_threshold": 1.0, "prompt_lookup_tokens": 5, "prompt_lookup_min_ngram": 1,
        "backoff_probe_interval": 0, "attn_skip_layers": [], "mlp_skip_layers": [],
    }  # fmt: skip
    params = resolve_params(NUM_LAYERS, {**knobs, "lookup_corpus": str(path)})
    drafted = 0
    for seed, length in enumerate(PROMPT_LENGTHS):
        prompt = _prepared(sharp_llama, length, seed)
        data = teacher_force(sharp_llama, prompt, NEW_TOKENS)
        _, estimated = _estimate(sharp_llama, data, params, "target_confidence_gated", _free(NUM_LAYERS))
        real = sharp_llama.generate(prompt.inputs["input_ids"], max_new_tokens=NEW_TOKENS, do_sample=False,
                                    strategy="target_confidence_gated", return_dict_in_generate=True,
                                    **params.as_dict()).strategy_stats
        assert _counters(estimated) == _counters(real), seed
        _, without = _estimate(sharp_llama, data, resolve_params(NUM_LAYERS, knobs), "target_confidence_gated")
        drafted += estimated.drafted_tokens - without.drafted_tokens
    assert drafted > 0  # the corpus proposed where the text alone did not


def test_the_estimate_backs_off_where_its_priced_steps_say_drafting_loses(sharp_llama):
    """The estimate feeds the back-off priced seconds in place of wall time. Priced so that a
    drafted token costs as much as a plain step, a draft the verifier sometimes rejects loses,
    and the back-off must turn to plain steps and beat drafting at every step; priced free,
    drafting wins and the back-off keeps drafting."""
    knobs = {"attn_skip_layers": [1, 3], "mlp_skip_layers": [2], "max_draft_tokens": 4, "draft_exit_threshold": 0.0}
    pricey = CostModel(NUM_LAYERS, (0.0,) + (1.0,) * 15, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0)
    free_draft = CostModel(NUM_LAYERS, (0.0,) + (1.0,) * 15, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    data = teacher_force(sharp_llama, _prepared(sharp_llama, 11, seed=3), NEW_TOKENS)

    def estimate(cost: CostModel, backoff_probe_interval: int):
        params = resolve_params(NUM_LAYERS, {**knobs, "backoff_probe_interval": backoff_probe_interval})
        return _estimate(sharp_llama, data, params, "self_speculative", cost)

    always_seconds, always = estimate(pricey, 0)
    assert always.plain_steps <= 1 and always.accepted_tokens < always.drafted_tokens  # rejections happen
    backoff_seconds, backed_off = estimate(pricey, 4)
    # drafting steps: the back-off's first measurement of drafting, then one probe
    assert backed_off.verification_steps == ThroughputBackoff._FIRST_SPECULATIVE_STEPS + 1
    assert backed_off.plain_steps > always.plain_steps + 1
    assert backoff_seconds < always_seconds
    _, kept = estimate(free_draft, 4)
    # plain steps: the one measuring step, two probes (after 4 and 8 drafting steps), and the last
    # step, which has no room to draft
    assert kept.plain_steps <= 4 and kept.verification_steps > kept.plain_steps


@pytest.mark.parametrize("architecture, draft_vocab_size", [("llama", 0), ("llama", 24), ("mistral", 0), ("gemma2", 24)])
def test_draft_pass_predicts_what_a_real_draft_proposes_first(architecture, draft_vocab_size):
    """Row j of the masked pass is the draft after j + 1 committed tokens, reading the full
    model's KV for all of them, exactly like the first token of a real draft there."""
    model = _sharp(architecture)
    params = resolve_params(
        NUM_LAYERS, {"attn_skip_layers": [1, 3], "mlp_skip_layers": [2], "draft_vocab_size": draft_vocab_size}
    )
    prompt = _prepared(model, 9, seed=7)
    data = teacher_force(model, prompt, NEW_TOKENS)
    predicted = draft_predictions(model, data, params)
    tokens, confidence = predicted.tokens, predicted.confidence
    assert len(tokens) == len(prompt.reference_tokens) - 1
    selector = TokenSelector(LogitsProcessorList(), do_sample=False)
    cache = DraftAwareCache(model.config)
    decoder = SkippingDecoder(model, params.attn_skip_layers, params.mlp_skip_layers)
    # One drafter throughout, first asked after one committed token: a restricted head picks its
    # rows then, from the text so far, as in a real decode.
    drafter = LayerSkipDrafter(model, cache, decoder, draft_vocab_size)
    kv_length = 0
    for committed in (1, 5, 12, len(prompt.reference_tokens) - 1):
        length = data.prompt_length + committed
        with torch.no_grad():
            # The cache grows as a decode's does (a windowed one cannot start over).
            model(input_ids=data.full_text[None, kv_length : length - 1], **cache_keyword(cache), use_cache=True,
                  position_ids=torch.arange(kv_length, length - 1)[None])
            kv_length = length - 1
            sequence = torch.zeros((1, length + 1), dtype=torch.long)
            sequence[0, :length] = data.full_text[:length]
            state = DecodingState(sequence, torch.arange(length + 1)[None], length)
            draft = drafter.propose(state, 1, ExitPolicy(0.0), selector)
            cache.rollback(kv_length)
        assert draft.tokens[0] == tokens[committed - 1], committed
        assert float(draft.distributions[0].max()) == pytest.approx(confidence[committed - 1], rel=1e-4)


def test_attention_a_hand_built_mask_cannot_express_is_refused_with_the_reason():
    model = tiny_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="objective = \"estimated\" needs attn_implementation 'eager' or 'sdpa'"):
        check_supported(model)


@pytest.mark.parametrize(
    "line, message",
    [
        ('objective = "fastest"', "study.objective: must be one of measured, estimated"),
        ("confirm_top = -1", "study.confirm_top: must be at least 0"),
        ("confirm_rounds = 0", "study.confirm_rounds: must be at least 1"),
    ],
)
def test_bad_objective_settings_name_the_key(tmp_path, tiny_llama_dir, line, message):
    path = write_study_config(tmp_path / "bad.toml", tiny_llama_dir, "sqlite://", study=line)
    with pytest.raises(StudyConfigError, match=message):
        load_study_config(path)


def test_estimated_study_confirms_its_best_trials_by_real_decoding(tmp_path, tiny_llama_dir):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    path = write_study_config(
        tmp_path / "study.toml",
        tiny_llama_dir,
        storage,
        strategy="target_confidence_gated",
        max_new_tokens=10,
        study='objective = "estimated"\nconfirm_top = 2\nconfirm_rounds = 2',
    )
    outcome = run_tune(load_study_config(path), n_trials=6, show_progress=False)

    estimated = outcome.study.get_trials(states=(TrialState.COMPLETE,))
    assert outcome.study.study_name.endswith(":estimated") and len(estimated) == 6
    assert all(trial.user_attrs["objective"] == "estimated" for trial in estimated)
    top = sorted(estimated, key=lambda trial: trial.value, reverse=True)[:2]
    confirmed = outcome.confirmed.get_trials(states=(TrialState.COMPLETE,))
    assert outcome.confirmed.study_name == outcome.study.study_name.removesuffix(":estimated")
    assert [trial.params for trial in confirmed] == [trial.params for trial in top]
    assert [trial.user_attrs["estimated_speedup"] for trial in confirmed] == [trial.value for trial in top]
    # priced again at the same prices before confirming, each came to exactly its study value
    assert not any("estimated_speedup_in_study" in trial.user_attrs for trial in confirmed)
    assert "Measured by real decoding" in format_summary(outcome)

    result = export_profile(storage, outcome.export_study.study_name, tmp_path / "export")
    best = max(confirmed, key=lambda trial: trial.value)
    assert result.profile.measured["trial"] == best.number
    assert result.profile.params == decode_params(best.params, "target_confidence_gated", NUM_LAYERS)


def _estimated_study_config(tmp_path, tiny_llama_dir, n_trials: int):
    """A short estimated study of the tiny model with no confirmation, in its own SQLite file."""
    return write_study_config(
        tmp_path / "study.toml",
        tiny_llama_dir,
        f"sqlite:///{tmp_path / 'optuna.db'}",
        max_new_tokens=6,
        study=f'objective = "estimated"\nconfirm_top = 0\nn_trials = {n_trials}',
    )


def test_a_study_that_spent_its_budget_runs_nothing_and_times_nothing(tmp_path, tiny_llama_dir, monkeypatch):
    path = _estimated_study_config(tmp_path, tiny_llama_dir, n_trials=2)
    first = run_tune(load_study_config(path), show_progress=False)
    assert sum(first.this_run.values()) == 2

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated a cost model for a study with no trials left to run")

    monkeypatch.setattr("hf_selfspec.tuning.tune.estimated_objective", no_calibration)
    again = run_tune(load_study_config(path), show_progress=False)
    assert sum(again.this_run.values()) == 0
    assert len(again.study.get_trials(states=(TrialState.COMPLETE,))) == 2


def test_an_estimated_study_re_checks_its_cost_model_and_records_each_re_time(tmp_path, tiny_llama_dir, monkeypatch):
    """The watch runs with the study: here it probes after every trial and every probe reads a
    drift upwards, so every second probe, the two running past the tolerance, times the cost
    model again, which the study records, with the prices it then estimates at."""
    from functools import partialmethod

    from hf_selfspec.tuning.costmodel import drift
    from hf_selfspec.tuning.costmodel.drift import CostModelWatch

    monkeypatch.setattr(CostModelWatch, "__init__", partialmethod(CostModelWatch.__init__, every=1))
    monkeypatch.setattr(CostModelWatch, "_drift", lambda self, ratio: 1)
    rescaled = drift.rescaled_overheads
    retimed_constants = iter((101.0, 102.0))
    monkeypatch.setattr(drift, "rescaled_overheads", lambda old, new: dataclasses.replace(
        rescaled(old, new), draft_constant=next(retimed_constants)))
    path = _estimated_study_config(tmp_path, tiny_llama_dir, n_trials=4)
    outcome = run_tune(load_study_config(path), show_progress=False)
    retimes = outcome.study.user_attrs["cost_model_retimes"]
    assert [record["after_trial"] for record in retimes] == [1, 3]
    assert outcome.study.user_attrs["cost_model"]["draft_constant"] == 102.0  # the last re-time's
    assert len(outcome.study.get_trials(states=(TrialState.COMPLETE,))) == 4
