"""A fast stand-in for measuring a trial: teacher-forced acceptance and a calibrated cost model.

Under greedy decoding the verifier's tokens are known once plain decoding has run, so whether a
draft token is accepted depends only on whether the draft predicts that known continuation.
One forward pass of the draft over the continuation yields every prediction at once. The decoding
loop itself (`speculative_decode`) then runs over them with the strategy's own parts, the known
tokens standing in for the full model's forward pass and the predictions for the model's draft,
while a clock priced by a cost model timed on this machine stands in for wall time: the
counters are the ones a real decode reports, and a drafter, policy or adaptive rule added to the
loop is estimated with no second description of it. A trial then costs one draft pass per
prompt instead of two timed decodes, and its value carries no timing noise, which the sampler
needs more than it needs the last few percent of accuracy.

The pass masks attention so that the draft at each position reads the full model's KV for the
text before it, as a real draft does for committed text; its first proposal after every prefix
is therefore exact. A trained adapter's draft (Kangaroo) is exact further: its shallow layers
are the full model's own, so while its earlier tokens are right its later ones read exactly the
text the pass gives them, and past a wrong token its real continuation is drafted too, on side
branches. The draft's alternatives (`draft_alternatives`) are its runner-ups at each position,
kept from the same pass. What is approximated: a layer-skip draft's second and later tokens
read the KV of its own earlier draft tokens, here the full model's, and past a wrong token it
is taken to go on with the next positions' teacher-forced guesses; logits processors are not
applied; and the cost model is only as steady as the machine: it is timed in interleaved rounds
so that a burst of load bends no price against another, and re-checked during the study
(`CostModelWatch`), but a load that comes and goes between checks still moves it. So the
estimate ranks trials; the top ones are then confirmed by real decoding (`confirm_top`), and
only measured speedups are reported as such.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import optuna
import torch
from transformers import DynamicCache, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from hf_selfspec.adapter import DraftAdapter, load_adapter, read_adapter_shape
from hf_selfspec.cache import DraftAwareCache, cache_keyword
from hf_selfspec.decoding import DecodeRequest, Runtime, WallClock, speculative_decode
from hf_selfspec.decoding_types import MODEL_SOURCE, DecodingState, Draft, Drafter, ExitPolicy
from hf_selfspec.drafters import LayerSkipDrafter, RestrictedDraftHead, ShallowExitDrafter
from hf_selfspec.masks import additive_mask, check_hand_built_masks_supported, model_attention_mask
from hf_selfspec.layer_skip import SkippingDecoder, decoder_layers
from hf_selfspec.measure import forward_timings, timed, timed_generate
from hf_selfspec.narrow_linear import verifying
from hf_selfspec.params import SelfSpecParams, resolve_params
from hf_selfspec.selection import TokenSelector
from hf_selfspec.stats import StrategyStats
from hf_selfspec.strategies import PLAIN, Strategy, resolve_strategy

from .categories import CategorySpeedups
from .config import SearchConfig
from .objective import PreparedPrompt, begin_trial

logger = logging.getLogger(__name__)

# Draft steps timed per calibration point, and rounds of the interleaved timing. A typical time
# (`typical_seconds`), not the minimum: the estimate must match what decoding pays, not the
# machine's best moment.
_CALIBRATION_TOKENS = 6
_CALIBRATION_ROUNDS = 7
# The verifier is timed at a few widths (`verification_knots`), each this many times a round: on a
# busy machine one forward pass may take several times another of the same width, and a price
# between two widths rests on both of their typical times.
_VERIFY_TIMINGS_PER_ROUND = 3
# Two restricted-head sizes pin down the head's cost as a line in the number of rows it keeps. A
# head is cheap enough for one call to drown in the timer's noise: each timing spans several.
_HEAD_SIZES = (2048, 16384)
_HEAD_CALLS = 4
# The re-check during a study: every this many trials, the plain step and the widest verification
# are timed again side by side, and the whole cost model is timed again when their ratio has moved
# by more than the tolerance from the model's (the neighbours' load changed, and with it prices).
_PROBE_EVERY = 10
_PROBE_ROUNDS = 5
_DRIFT_TOLERANCE = 0.15

# Times one call of its argument, in seconds: the device's wall clock, or a test's simulation.
Timer = Callable[[Callable[[], Any]], float]


def device_timer(device: torch.device) -> Timer:
    return lambda run: timed(run, device)[1]


def interleaved_timings(runs: Mapping[Any, Callable[[], Any]], rounds: int, timer: Timer) -> dict[Any, list[float]]:
    """The seconds of each run in every round, timed in rounds that take every run once in turn.

    Timed one after another, a run that happens to share the machine's busy minute carries all
    of it while the others carry none, and the ratios between them, which are all an estimate
    reads, come out bent. In rounds, a burst of load lands on one round of every run alike.
    """
    timings: dict[Any, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            timings[name].append(timer(run))
    return timings


def interleaved_medians(runs: Mapping[Any, Callable[[], Any]], rounds: int, timer: Timer) -> dict[Any, float]:
    """The median seconds of each run timed in rounds (`interleaved_timings`): the median drops
    the round a burst of load fell on."""
    return {name: statistics.median(seconds) for name, seconds in interleaved_timings(runs, rounds, timer).items()}


def typical_seconds(seconds: Sequence[float]) -> float:
    """The mean of the middle two thirds of `seconds`: what a run costs in a decode that repeats it.

    A decode pays the mean of its forward passes. Where a neighbour keeps a core busy, each pass
    lands either on free cores or behind the neighbour, two modes far apart; where they are near
    even, the median falls in one mode or the other from one calibration to the next, while the
    mean of the middle follows their mix. Dropping the outer sixths keeps out a burst of load that
    fell on one round in seven."""
    ordered = sorted(seconds)
    cut = round(len(ordered) / 6)
    return statistics.fmean(ordered[cut : len(ordered) - cut] or ordered)


def verification_knots(max_tokens: int) -> tuple[int, ...]:
    """The widths the verifier is timed at: one token, two and three times every power of two,
    and `max_tokens`. Dense where a CPU's cost bends (one token takes the matrix-vector path),
    sparse where it runs nearly on a line; timing every width instead spreads the same rounds so
    thin that on a busy machine each width's typical time is mostly noise."""
    doubled = {base << shift for base in (2, 3) for shift in range(max_tokens.bit_length())}
    return tuple(sorted({1, max_tokens} | {width for width in doubled if width <= max_tokens}))


def nondecreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in least squares: every run of values that
    falls is pooled into its mean (pool adjacent violators)."""
    blocks: list[tuple[float, int]] = []  # (sum, count) of each pooled run
    for value in values:
        total, count = value, 1
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            previous_total, previous_count = blocks.pop()
            total, count = total + previous_total, count + previous_count
        blocks.append((total, count))
    return [total / count for total, count in blocks for _ in range(count)]


def verification_prices(typical: Mapping[int, float], max_tokens: int) -> tuple[float, ...]:
    """Index k: the price of verifying k tokens (0 for none). The timed widths' typical seconds
    are made non-decreasing, since checking more tokens never costs less, and a noisy one that
    undercuts a narrower one would otherwise price a longer proposal as cheaper; widths between
    two timed ones are priced on the line between them."""
    knots = sorted(typical)
    fitted = nondecreasing([typical[width] for width in knots])
    prices = [0.0]
    for width in range(1, max_tokens + 1):
        right = bisect.bisect_left(knots, width)
        if knots[right] == width:
            prices.append(fitted[right])
            continue
        share = (width - knots[right - 1]) / (knots[right] - knots[right - 1])
        prices.append(fitted[right - 1] + share * (fitted[right] - fitted[right - 1]))
    return tuple(prices)


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward pass, timed on this machine.

    Every decoder layer has the same shapes, so a draft step costs a constant plus a fixed amount
    per attention and per MLP sub-layer that runs, plus its LM head (a line in the rows kept
    when the head is restricted). The verifier has a price for every width it may check
    (`verification_prices`), because on a CPU it is far from linear: one token takes the
    matrix-vector path, and two may already cost nearly twice as much. Overheads are what a
    step spends beyond its forward passes: in plain `generate`, and in our decoding loop.
    """

    num_layers: int
    verify_seconds: tuple[float, ...]  # index k: one forward pass over k tokens
    plain_step_overhead: float
    draft_constant: float
    attention_seconds: float
    mlp_seconds: float
    restricted_head_constant: float  # relative to the full head
    restricted_head_per_row: float
    loop_step_overhead: float = 0.0
    # Plain decoding's forward pass over one token, on the stock kernels; the loop's own one-token
    # pass is `verify(1)`, on whichever kernel is faster here (`narrow_linear`). 0: the same.
    plain_forward_seconds: float = 0.0
    # A trained adapter's draft token with the full head, timed: its block, mask and rotary set-up
    # are not a decoder layer's, and the shallow layers are few enough for overheads to weigh.
    adapter_draft_seconds: dict[str, float] = field(default_factory=dict)

    def draft_token_seconds(self, params: SelfSpecParams) -> float:
        """An adapter calibration did not time (a cost model in units of a step, written by hand)
        is priced as the layers below its exit, run whole, and one more layer of the same shapes
        for its block (with or without its MLP)."""
        if params.draft_adapter in self.adapter_draft_seconds:
            seconds = self.adapter_draft_seconds[params.draft_adapter]
        else:
            if params.draft_adapter:
                shape = read_adapter_shape(params.draft_adapter)
                attention_run, mlp_run = shape.exit_layer + 1, shape.exit_layer + int(shape.mlp)
            else:
                attention_run = self.num_layers - len(params.attn_skip_layers)
                mlp_run = self.num_layers - len(params.mlp_skip_layers)
            seconds = self.draft_constant + attention_run * self.attention_seconds + mlp_run * self.mlp_seconds
        if params.draft_vocab_size:
            seconds += self.restricted_head_constant + params.draft_vocab_size * self.restricted_head_per_row
        return max(seconds, 0.0)

    def verify(self, tokens: int) -> float:
        return self.verify_seconds[min(tokens, len(self.verify_seconds) - 1)]

    def plain_forward(self) -> float:
        return self.plain_forward_seconds or self.verify(1)


@dataclass(frozen=True)
class TeacherForcedPrompt:
    """What every trial reads for one prompt: plain decoding's tokens, the full model's
    confidence in each, and the full model's KV of the whole text, which a real draft reads for
    every token already committed."""

    prompt: PreparedPrompt
    prompt_length: int
    full_text: torch.Tensor  # [P + n]: prompt and plain decoding's continuation
    verifier_confidence: tuple[float, ...]  # the full model's probability of each continuation token
    cache: DraftAwareCache  # full-model KV of full_text[:-1]; rolled back to that after every use
    prefill_seconds: float
    max_new_tokens: int
    # exit layer -> what enters that layer at every position of full_text[:-1]; filled on first use
    shallow_states: dict[int, torch.Tensor] = field(default_factory=dict, compare=False)

    @property
    def reference(self) -> list[int]:
        return self.prompt.reference_tokens

    @property
    def kv_length(self) -> int:
        return self.full_text.shape[0] - 1


@torch.no_grad()
def _forward(
    model,
    input_ids: torch.Tensor,
    start: int,
    cache: DraftAwareCache,
    logits_to_keep: int,
    **kwargs,
):
    """The full model's forward pass over `input_ids` from position `start`, as the decoding
    loop verifies (`model_forward`), on the same kernels: outside autograd, as `generate` runs,
    whoever calls it (the cost-model watch probes from an Optuna callback)."""
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    with verifying(model):
        return model(
            input_ids=input_ids,
            position_ids=positions,
            **cache_keyword(cache),
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )


def check_supported(model) -> None:
    check_hand_built_masks_supported(model, 'objective = "estimated"', 'use objective = "measured"')


@torch.no_grad()
def teacher_force(model, prompt: PreparedPrompt, max_new_tokens: int) -> TeacherForcedPrompt:
    prompt_ids = prompt.inputs["input_ids"].to(model.device)
    length = prompt_ids.shape[1]
    reference = torch.tensor(prompt.reference_tokens, device=model.device)
    full_text = torch.cat([prompt_ids[0], reference])
    cache = DraftAwareCache()  # no windows: the draft pass reads back from every row
    prefill = {"prefill": lambda: (cache.rollback(0), _forward(model, prompt_ids, 0, cache, 1))}
    prefill_seconds = interleaved_medians(prefill, 2, device_timer(model.device))["prefill"]
    # The verifier's probabilities of its own tokens, for the gate: row j scores continuation token j.
    cache.rollback(length - 1)
    logits = _forward(model, full_text[None, length - 1 : -1], length - 1, cache, 0).logits[0]
    confidence = torch.softmax(logits.float(), dim=-1).gather(-1, reference[:, None])[:, 0]
    return TeacherForcedPrompt(
        prompt, length, full_text, tuple(confidence.tolist()), cache, prefill_seconds, max_new_tokens
    )


def verification_runs(
    model, texts: Sequence[TeacherForcedPrompt], widths: Sequence[int]
) -> dict[int, Callable[[], Any]]:
    """By width: one forward pass of the full model over that many tokens after one of `texts`,
    the next one at each call, rolled back after each, as a verification step runs it."""
    turns = {tokens: itertools.cycle(texts) for tokens in widths}

    def verify(tokens: int) -> None:
        data = next(turns[tokens])
        _forward(model, data.full_text[None, -tokens:], data.kv_length, data.cache, tokens)
        data.cache.rollback(data.kv_length)

    return {tokens: partial(verify, tokens) for tokens in widths}


@torch.no_grad()
def calibrate(
    model,
    sample: TeacherForcedPrompt,
    num_layers: int,
    max_verify_tokens: int,
    draft_adapters: Sequence[str] = (),
    timer: Timer | None = None,
    generate_kwargs: Mapping[str, Any] = {},
    verified_after: Sequence[TeacherForcedPrompt] = (),
) -> CostModel:
    """Time the verifier at a few widths (`verification_knots`, priced between them by
    `verification_prices`), the draft at a few skip sets, the LM head, each trained adapter's
    draft and plain decodes of `sample` on the stock kernels and on the verifier's, after
    `sample`'s text, all interleaved (`interleaved_timings`), so that every price is relative to
    the same plain step under the same load.

    The verifier is timed after each text of `verified_after` in turn (`sample`'s alone where
    none are given): what a pass costs grows with the text it attends to, and not alike at every
    width, so widths timed after one long or short text alone would price the workload's
    verifications against each other and against plain's step as its decodes, spread over
    their own lengths, do not pay them.

    Plain's step is the verifier's one-token pass times the ratio of a plain decode's step on the
    stock kernels to one on the verifier's, each the mean of a whole decode's steps. Every trial's
    estimate reads plain's step against the verifications; timed as a few short calls like them,
    on a busy machine each call lands on free cores or behind the neighbour by chance, and that
    ratio swung from one calibration to the next where a decode's hundreds of steps hold it. The
    ratio of two decodes' steps, not one of them, is what enters: a decode's forward passes and
    a few short calls of them take different times on a busy machine (below).

    Plain's per-step overhead is what the plain decode on the stock kernels spends beyond its
    forward passes, both timed within it (`forward_timings`), in the cost model's units
    (`overhead_per_step`). Read instead as the decode's time beyond its forward passes at their
    prices, it would take in the gap between what a decode's many forward passes take and what a
    few short timed calls of them take, which a busy machine opens wide: plain would be priced at
    its decode's average and every verification at a few calls, and the gap, whatever its sign,
    would move every trial's estimate.
    """
    timer = timer or device_timer(model.device)
    # The seconds of every forward pass in each timed plain decode: on the stock kernels, as plain
    # decoding runs, and on the verifier's.
    plain_forwards: list[list[float]] = []
    verifier_forwards: list[list[float]] = []
    verifications = verification_runs(model, verified_after or (sample,), verification_knots(max_verify_tokens))
    runs: dict[Any, Callable[[], Any]] = {
        # every width once, then again, so that a width's timings within a round are apart
        **{
            ("verify", width, repeat): run
            for repeat in range(_VERIFY_TIMINGS_PER_ROUND)
            for width, run in verifications.items()
        },
        **_draft_runs(model, sample, num_layers, draft_adapters),
        **_plain_runs(model, sample, generate_kwargs, plain_forwards, verifier_forwards),
    }
    timings = interleaved_timings(runs, _CALIBRATION_ROUNDS, timer)
    seconds = {name: typical_seconds(timed) for name, timed in timings.items()}
    widths = {
        width: typical_seconds(
            [timing for repeat in range(_VERIFY_TIMINGS_PER_ROUND) for timing in timings["verify", width, repeat]]
        )
        for width in verifications
    }
    verify_seconds = verification_prices(widths, max_verify_tokens)
    plain_forward_seconds = verify_seconds[1] * decoded_step(plain_forwards) / decoded_step(verifier_forwards)
    steps = len(sample.reference)
    priced_plain = seconds["prefill"] + (steps - 1) * plain_forward_seconds
    plain_step_overhead = statistics.median(
        overhead_per_step(total - sum(forwards), sum(forwards), priced_plain, steps)
        for total, forwards in zip(timings["plain"], plain_forwards, strict=True)
    )
    return CostModel(
        num_layers=num_layers,
        verify_seconds=verify_seconds,
        plain_step_overhead=plain_step_overhead,
        plain_forward_seconds=plain_forward_seconds,
        **_draft_prices(seconds, num_layers, draft_adapters),
    )


def _plain_runs(
    model,
    sample: TeacherForcedPrompt,
    generate_kwargs: Mapping[str, Any],
    plain_forwards: list[list[float]],
    verifier_forwards: list[list[float]],
) -> dict[str, Callable[[], None]]:
    """`calibrate`'s runs of the prompt's prefill and of plain decodes of `sample`, each decode
    appending the seconds of its forward passes to `plain_forwards` (on the stock kernels) or
    `verifier_forwards` (on the verifier's)."""
    inputs = {name: tensor.to(model.device) for name, tensor in sample.prompt.inputs.items()}
    prompt_ids = inputs["input_ids"]
    prefill_cache = DraftAwareCache()

    def prefill() -> None:
        prefill_cache.rollback(0)
        _forward(model, prompt_ids, 0, prefill_cache, 1)

    def decode_plainly(kernels: Callable[[], contextlib.AbstractContextManager]) -> list[float]:
        # Stopped where plain decoding stopped, so that it decodes exactly the sample's reference.
        kwargs = {"do_sample": False, **generate_kwargs, "max_new_tokens": len(sample.reference)}
        with kernels(), forward_timings(model) as forwards:
            model.generate(**inputs, strategy=PLAIN, **kwargs)
        return [seconds for _, seconds in forwards]

    def plain_decode() -> None:
        plain_forwards.append(decode_plainly(contextlib.nullcontext))

    def plain_decode_on_verifier_kernels() -> None:
        verifier_forwards.append(decode_plainly(partial(verifying, model)))

    return {"prefill": prefill, "plain": plain_decode, "plain on the verifier's kernels": plain_decode_on_verifier_kernels}


def _draft_runs(
    model, sample: TeacherForcedPrompt, num_layers: int, draft_adapters: Sequence[str]
) -> dict[Any, Callable[[], None]]:
    """`calibrate`'s runs of the draft after `sample`'s text: the full model, one attention and
    one MLP sub-layer, the LM head whole and restricted, and each trained adapter's draft."""
    cache, text, kv_length = sample.cache, sample.full_text, sample.kv_length

    def draft_run(drafter: Drafter, cache: DraftAwareCache) -> Callable[[], None]:
        sequence = torch.zeros((1, kv_length + 1 + _CALIBRATION_TOKENS), dtype=text.dtype, device=text.device)
        sequence[0, : kv_length + 1] = text
        state = DecodingState(sequence, torch.arange(sequence.shape[1], device=text.device)[None], kv_length + 1)
        selector, never_exit = TokenSelector(LogitsProcessorList(), do_sample=False), ExitPolicy(0.0)
        drafter.continue_from(state, kv_length)

        def run():
            drafter.propose(state, _CALIBRATION_TOKENS, never_exit, selector)
            cache.rollback(kv_length)
            drafter.rollback(kv_length)

        run()  # untimed: an adapter's first draft also takes in the committed text
        return run

    def skipping(attn_skip: Sequence[int], mlp_skip: Sequence[int]) -> Callable[[], None]:
        return draft_run(LayerSkipDrafter(model, cache, SkippingDecoder(model, attn_skip, mlp_skip)), cache)

    def adapter_draft(path: str) -> Callable[[], None]:
        # A prefill of its own, which the drafter continues from, so that the adapter's attention
        # spans the committed text as in a decode, and the prompt's teacher-forced KV stays untouched.
        own_cache = DraftAwareCache(model.config)
        _forward(model, text[None, :kv_length], 0, own_cache, 1)
        return draft_run(ShallowExitDrafter(model, own_cache, load_adapter(model, path)), own_cache)

    # The head alone, timed directly: its share of a draft step is too small to read off
    # whole-step timings through their noise.
    hidden = torch.zeros((1, model.config.hidden_size), dtype=model.dtype, device=text.device)

    def head_run(head: Callable[[torch.Tensor], Any]) -> Callable[[], None]:
        return lambda: [head(hidden) for _ in range(_HEAD_CALLS)]

    all_but_first = tuple(range(1, num_layers))
    return {
        "full": skipping((), ()),
        "one attention": skipping(all_but_first, ()),
        "one mlp": skipping((), all_but_first),
        "full head": head_run(model.get_output_embeddings()),
        **{("head", size): head_run(RestrictedDraftHead(model, size, text[:1])) for size in _HEAD_SIZES},
        **{path: adapter_draft(path) for path in draft_adapters},
    }


def _draft_prices(seconds: Mapping[Any, float], num_layers: int, draft_adapters: Sequence[str]) -> dict[str, Any]:
    """The cost model's draft prices from the typical `seconds` of `_draft_runs`' runs: each
    sub-layer's, read off the full draft against one with a single attention or MLP left; the
    restricted head's, as a line between its two timed sizes."""
    full, one_attention, one_mlp = (seconds[name] / _CALIBRATION_TOKENS for name in ("full", "one attention", "one mlp"))
    heads = ("full head", *(("head", size) for size in _HEAD_SIZES))
    full_head, small_head, large_head = (seconds[name] / _HEAD_CALLS for name in heads)
    spread = max(num_layers - 1, 1)
    attention_seconds = (full - one_attention) / spread
    mlp_seconds = (full - one_mlp) / spread
    per_row = (large_head - small_head) / (_HEAD_SIZES[1] - _HEAD_SIZES[0])
    return {
        "draft_constant": full - num_layers * (attention_seconds + mlp_seconds),
        "attention_seconds": attention_seconds,
        "mlp_seconds": mlp_seconds,
        "restricted_head_constant": small_head - full_head - _HEAD_SIZES[0] * per_row,
        "restricted_head_per_row": per_row,
        "adapter_draft_seconds": {path: seconds[path] / _CALIBRATION_TOKENS for path in draft_adapters},
    }


# The loop's probe: the full model drafting for itself, so that it drafts and verifies at every
# step, as a trial does, with nothing left to the back-off's timing.
_LOOP_PROBE = {
    "attn_skip_layers": [],
    "mlp_skip_layers": [],
    "max_draft_tokens": 3,
    "draft_exit_threshold": 0.0,
    "backoff_probe_interval": 0,
}


def decoded_step(decodes: Sequence[Sequence[float]]) -> float:
    """A one-token step's seconds in plain decodes, from the forward passes of each (its prefill
    first): the typical of each decode's mean step."""
    return typical_seconds([statistics.fmean(forwards[1:] or forwards) for forwards in decodes])


def overhead_per_step(outside: float, timed_forwards: float, priced_forwards: float, steps: float) -> float:
    """A decode's seconds `outside` its forward passes, per step, in the cost model's units: at the
    ratio of those forward passes' prices to their seconds timed in the same decode, so that a
    load that slowed the whole decode reads as on an idle machine. Never below zero."""
    if timed_forwards <= 0 or steps <= 0:
        return 0.0
    return max(outside, 0.0) * priced_forwards / timed_forwards / steps


def calibrate_loop(
    model, cost: CostModel, prompts: Sequence[TeacherForcedPrompt], generate_kwargs: dict[str, Any]
) -> CostModel:
    """Add our decoding loop's own per-step overhead: what a real decode of every prompt spent
    beyond drafting and the full model's forward passes, all three timed within that decode
    (`forward_timings`), and read in the cost model's units (the forward passes' priced seconds
    over their timed ones). Read instead as the decode's time beyond what the cost model prices
    its steps at, it would be the difference of two large numbers timed at different moments: a
    neighbour's load in one and not the other, or a draft timed a little cheap, would come out
    as overhead and be charged to every step of every trial."""
    params = resolve_params(cost.num_layers, _LOOP_PROBE)
    outside = priced = timed_forwards = steps = 0.0
    for data in prompts:
        with forward_timings(model) as forwards:
            run = timed_generate(
                model, data.prompt.inputs, strategy="self_speculative", **params.as_dict(), **generate_kwargs
            )
        forward_seconds = sum(seconds for _, seconds in forwards)
        outside += run.seconds - run.stats.draft_seconds - forward_seconds
        timed_forwards += forward_seconds
        # the first forward pass is the prompt's prefill
        priced += data.prefill_seconds + sum(cost.verify(width) for width, _ in forwards[1:])
        steps += run.stats.verification_steps + run.stats.plain_steps + 1
    return dataclasses.replace(cost, loop_step_overhead=overhead_per_step(outside, timed_forwards, priced, steps))


def _committed_kv_mask(model, data: TeacherForcedPrompt) -> torch.Tensor | dict[str, torch.Tensor]:
    """Draft query j (at position P + j) sees the full model's KV before it, as a real draft
    does for committed text, and its own KV, which the pass appends after the full model's."""
    rows, kv_length = data.kv_length - data.prompt_length, data.kv_length
    query = torch.arange(rows, device=data.full_text.device)[:, None]
    key = torch.arange(kv_length + rows, device=data.full_text.device)[None, :]
    visible = (key < data.prompt_length + query) | (key == kv_length + query)
    query_positions = data.prompt_length + query[:, 0]
    key_positions = torch.cat([key[0, :kv_length], query_positions])
    return model_attention_mask(model.config, visible, query_positions, key_positions, model.dtype)


def _shallow_states(model, data: TeacherForcedPrompt, exit_layer: int) -> torch.Tensor:
    """`[1, kv_length, hidden]`: the output of layer `exit_layer - 1` over the text, which is what
    a real decode's verifications hand an adapter for committed tokens. Kept per exit layer, so
    the trials that choose the same adapter share one pass."""
    if exit_layer not in data.shallow_states:
        outputs = model.get_decoder()(
            input_ids=data.full_text[None, :-1], use_cache=False, output_hidden_states=[exit_layer]
        )
        data.shallow_states[exit_layer] = outputs.hidden_states[exit_layer]
    return data.shallow_states[exit_layer]


def _adapter_hidden(model, data: TeacherForcedPrompt, adapter: DraftAdapter) -> tuple[torch.Tensor, DynamicCache]:
    """The adapter's output after each committed continuation token, from one causal pass of
    its block over the shallow states of the whole text, and the block's KV of that text."""
    shallow = _shallow_states(model, data, adapter.shape.exit_layer)
    positions = torch.arange(shallow.shape[1], device=shallow.device)[None]
    cache = DynamicCache()
    return adapter(shallow, positions, cache)[0, data.prompt_length :], cache


@torch.no_grad()
def _adapter_drafts_past_misses(
    model,
    data: TeacherForcedPrompt,
    adapter: DraftAdapter,
    adapter_cache: DynamicCache,
    head: RestrictedDraftHead,
    guesses: list[int],
    depth: int,
) -> dict[int, list[tuple[int, float]]]:
    """Where the adapter guesses wrong (row j: its guess at continuation token j + 1), what a
    real draft then goes on to propose: up to `depth` tokens and the draft's confidence in each.

    Every row's text before its wrong guess is right, so each continuation is a side branch off
    the committed text: all of them are drafted at once, one token deep per pass, each branch
    seeing the text up to its guess and its own tokens (one mask), through the model's own
    shallow layers and the adapter, as a decode runs them.
    """
    misses = [row for row, guess in enumerate(guesses) if guess != data.reference[row + 1]]
    if not misses or depth < 1:
        return {}
    device = data.full_text.device
    rows = torch.tensor(misses, device=device)
    committed = torch.arange(data.kv_length, device=device)
    sees_text = committed[None, :] <= data.prompt_length + rows[:, None]  # up to the wrong guess's input
    own_branch = torch.eye(len(misses), dtype=torch.bool, device=device)
    above = tuple(range(adapter.shape.exit_layer, len(decoder_layers(model))))
    shallow_layers = SkippingDecoder(model, above, above)
    tokens = torch.tensor([guesses[row] for row in misses], device=device)
    key_positions, drafted = [committed], [[] for _ in misses]
    try:
        for step in range(1, depth + 1):
            positions = data.prompt_length + rows + step
            key_positions.append(positions)
            visible = torch.cat([sees_text, own_branch.repeat(1, step)], dim=1)
            shallow = shallow_layers.hidden_states(
                tokens[None],
                positions[None],
                data.cache,
                attention_mask=model_attention_mask(model.config, visible, positions, torch.cat(key_positions), model.dtype),
            )
            hidden = adapter(shallow, positions[None], adapter_cache, additive_mask(visible, model.dtype))
            best = torch.softmax(head.subset_logits(hidden[0]).float(), dim=-1).max(dim=-1)
            tokens = head.token_ids[best.indices]
            for branch, token, confidence in zip(drafted, tokens.tolist(), best.values.tolist()):
                branch.append((token, confidence))
    finally:
        data.cache.rollback(data.kv_length)
    return dict(zip(misses, drafted))


def _layer_skip_hidden(model, data: TeacherForcedPrompt, params: SelfSpecParams) -> torch.Tensor:
    """The skipped model's final hidden state after each committed continuation token, from one
    pass over the continuation that reads the full model's KV for the text before each token."""
    continuation = data.full_text[None, data.prompt_length : -1]
    positions = torch.arange(data.prompt_length, data.kv_length, device=continuation.device)[None]
    decoder = SkippingDecoder(model, params.attn_skip_layers, params.mlp_skip_layers)
    try:
        return decoder(continuation, positions, data.cache, attention_mask=_committed_kv_mask(model, data))[0]
    finally:
        data.cache.rollback(data.kv_length)


@dataclass(frozen=True)
class DraftPredictions:
    """Entry j of each list: the draft's guess at continuation token j + 1, after token j."""

    tokens: list[int]
    confidence: list[float]
    alternatives: list[list[int]]  # its `draft_alternatives` runner-ups there
    # Row j where the guess is wrong -> the tokens a real draft goes on to propose after it, and
    # its confidence in each; computed for adapters. Elsewhere (a layer-skip draft, whose later
    # tokens are approximate anyway) the draft is taken to go on with the next rows' guesses.
    past_misses: dict[int, list[tuple[int, float]]] = field(default_factory=dict)

    def chain(self, row: int, limit: int) -> list[tuple[int, float]]:
        """What a real draft starting at `row` proposes, at most `limit` tokens, each with its
        confidence (the exit policy's input)."""
        proposed = []
        for guess_row in range(row, min(row + limit, len(self.tokens))):
            proposed.append((self.tokens[guess_row], self.confidence[guess_row]))
            if guess_row in self.past_misses:
                return proposed + self.past_misses[guess_row][: limit - len(proposed)]
        return proposed


@torch.no_grad()
def draft_predictions(model, data: TeacherForcedPrompt, params: SelfSpecParams) -> DraftPredictions:
    """The draft's token, confidence and runner-ups after each committed continuation token,
    all read from one pass."""
    if data.kv_length == data.prompt_length:  # a one-token continuation leaves nothing to draft
        return DraftPredictions([], [], [])
    adapter = load_adapter(model, params.draft_adapter) if params.draft_adapter else None
    if adapter is not None:
        hidden, adapter_cache = _adapter_hidden(model, data, adapter)
    else:
        hidden = _layer_skip_hidden(model, data, params)
    # The head a real draft builds: the lowest ids plus the prompt and the first token (with
    # draft_vocab_size 0, the whole head).
    head = RestrictedDraftHead(model, params.draft_vocab_size, data.full_text[: data.prompt_length + 1])
    probabilities = torch.softmax(head.subset_logits(hidden).float(), dim=-1)
    ranked = probabilities.topk(min(1 + params.draft_alternatives, probabilities.shape[-1]), dim=-1)
    ranked_tokens = head.token_ids[ranked.indices].tolist()
    guesses = [row[0] for row in ranked_tokens]
    past_misses = {}
    if adapter is not None:
        past_misses = _adapter_drafts_past_misses(
            model, data, adapter, adapter_cache, head, guesses, params.max_draft_tokens - 1
        )
    return DraftPredictions(guesses, ranked.values[:, 0].tolist(), [row[1:] for row in ranked_tokens], past_misses)


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
        return logits, None


class PricedClock(WallClock):
    """The decoding loop's clock in an estimate: every stage priced by the cost model instead of
    timed. A verification costs the forward pass over its inputs (the first one, the prompt's
    prefill, what the prompt's prefill was timed at) and the loop's overhead per step; a draft,
    its model-drafted tokens (a lookup's cost nothing). The back-off and the draft source choice
    learn from these prices as they learn from wall time in a real decode."""

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
) -> tuple[float, StrategyStats]:
    """The priced seconds and the counters of decoding `data`'s prompt with `strategy`: the
    decoding loop itself (`speculative_decode`), with plain greedy's known tokens for the full
    model's verdicts, `draft`'s predictions for the model's draft, and `cost`'s prices for its
    clock. Everything else is the strategy's own composition: prompt lookup and its corpus, the
    gate, the exit policy, the back-off, a drafter of its own."""
    strategy = resolve_strategy(strategy)
    cache = DraftAwareCache()  # stays empty: the known verifier writes no KV
    # The model's draft would cost forward passes, which the estimate exists to save: wherever
    # the strategy builds it, it gets the prediction instead.
    parts = strategy.build(model, params, cache, model_drafter=_PredictedDraft(draft, data.prompt_length))
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
    return clock.seconds, result.stats


def plain_seconds(data: TeacherForcedPrompt, cost: CostModel) -> float:
    """Plain decoding in the same units: the prefill, then one forward and overhead per token."""
    steps = len(data.reference)
    return data.prefill_seconds + steps * cost.plain_step_overhead + (steps - 1) * cost.plain_forward()


class EstimatedSpeedupObjective:
    """`study.optimize`'s objective when the study config says `objective = "estimated"`: the
    estimated speedup per category of the prompts, made one value (and judged against a
    `category_floor`) as the measured objective does (`categories`)."""

    def __init__(
        self,
        model,
        prompts: Sequence[TeacherForcedPrompt],
        cost: CostModel,
        search: SearchConfig,
        worker: str,
        category_floor: float | None = None,
    ):
        self.model, self.prompts, self.cost, self.search, self.worker = model, prompts, cost, search, worker
        self.category_floor = category_floor

    def __call__(self, trial: optuna.Trial) -> float:
        num_layers = self.cost.num_layers
        values = begin_trial(trial, self.search, num_layers, self.worker)
        try:
            params = resolve_params(num_layers, values)
        except ValueError as error:
            raise optuna.TrialPruned(f"invalid skip set: {error}") from None
        categories = CategorySpeedups([data.prompt.category for data in self.prompts])
        for data in self.prompts:
            predicted = draft_predictions(self.model, data, params)
            seconds, stats = estimate_decode(self.model, data, params, self.search.strategy, predicted, self.cost)
            plain = plain_seconds(data, self.cost)
            if not stats.accepted_tokens:
                # Every token then took a forward pass of the full model, as in plain decoding,
                # and any drafting only added to it: whatever the cost model prices a step at (one
                # timed while the machine was busy prices them wrong), this is no faster than plain.
                seconds = max(seconds, plain)
            tokens = len(data.reference)  # the estimate decodes plain's own tokens
            categories.add(data.prompt.category, (plain, tokens), (seconds, tokens), stats)
        trial.set_user_attr("objective", "estimated")
        trial.set_user_attr("draft_token_seconds", self.cost.draft_token_seconds(params))
        categories.record(trial, self.category_floor)
        return categories.value

    def reprice(self, trial: optuna.trial.FrozenTrial) -> float:
        """`trial`'s estimate at the cost model's prices as they are now, which may have been
        timed again (`CostModelWatch`) since it ran."""
        return self(optuna.trial.FixedTrial(trial.params))


class CostModelWatch:
    """An Optuna callback that keeps the objective's cost model true to the machine as it is now.

    A neighbour's load that starts or stops during a study changes what a forward pass costs,
    and not alike at every width: the cost model timed at the start would then price every
    later trial wrong. Every `every` trials the plain step and the widest verification are timed
    again side by side (`probe`, in rounds); when their ratio has moved by more than `tolerance`
    from what the same probe read when the cost model was last timed, at two probes running and
    the same way, the whole model is timed again (`retime`) and the objective prices the trials
    after it with that. One reading, or two taken back to back, is not enough: on a shared host
    a neighbour's load comes and goes in episodes of seconds to a minute, which move a probe's
    ratio as far as a lasting change does, while a re-time costs a whole calibration and leaves
    the values before it and after it priced apart. The probe is compared with itself, not with
    the cost model's ratio: the cost model times its widths and drafts interleaved in more
    rounds, so the two read the same load a little differently, and only a change in the probe's
    own reading is the load's. Each re-time is recorded in the study's user attrs
    (`cost_model_retimes`) and logged, so a study's values can be read with it in mind.
    """

    def __init__(
        self,
        objective: EstimatedSpeedupObjective,
        probe: Mapping[int, Callable[[], Any]],
        retime: Callable[[], CostModel],
        timer: Timer,
        every: int = _PROBE_EVERY,
        tolerance: float = _DRIFT_TOLERANCE,
    ):
        self.objective, self.probe, self.retime, self.timer = objective, probe, retime, timer
        self.every, self.tolerance = every, tolerance
        self.narrow, self.wide = min(probe), max(probe)
        self.trials = 0
        self.reference = self.probe_ratio()  # the cost model was timed just before
        self.previous_drift: float | None = None  # the last probe's ratio, if past the tolerance

    def probe_ratio(self) -> float:
        """What the widest probed verification costs now, in plain steps."""
        seconds = interleaved_medians(self.probe, _PROBE_ROUNDS, self.timer)
        return seconds[self.wide] / seconds[self.narrow]

    def _drift(self, ratio: float) -> int:
        """1 or -1 where `ratio` is past the tolerance above or below the reference, else 0."""
        change = ratio / self.reference - 1
        return 0 if abs(change) <= self.tolerance else (1 if change > 0 else -1)

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.trials += 1
        if self.trials % self.every:
            return
        measured, previous = self.probe_ratio(), self.previous_drift
        drift = self._drift(measured)
        self.previous_drift = measured if drift else None
        if not drift or previous is None or self._drift(previous) != drift:
            return
        self.objective.cost = rescaled_overheads(self.objective.cost, self.retime())
        record_cost_model(study, self.objective.cost)
        retimes = [
            *study.user_attrs.get("cost_model_retimes", []),
            {
                "after_trial": trial.number,
                "probe_ratio": measured,
                "previous_probe_ratio": previous,
                "reference_ratio": self.reference,
            },
        ]
        study.set_user_attr("cost_model_retimes", retimes)
        logger.info(
            "The cost model was timed again after trial %d: a %d-token verification now costs %.2f plain steps, "
            "%.2f at the probe before, %.2f when the model was last timed",
            trial.number,
            self.wide,
            measured,
            previous,
            self.reference,
        )
        self.previous_drift = None
        self.reference = self.probe_ratio()


def rescaled_overheads(old: CostModel, new: CostModel) -> CostModel:
    """`new`, with `old`'s loop overhead carried over in proportion to its plain step.

    The loop's overhead comes from whole decodes of every prompt (`calibrate_loop`), too slow to
    repeat mid-study; held as a share of the plain step, it follows the load as the re-timed
    forward passes do. Plain's overhead is `new`'s own: `calibrate` times it in the same rounds."""
    scale = new.verify(1) / old.verify(1) if old.verify(1) > 0 else 1.0
    return dataclasses.replace(new, loop_step_overhead=old.loop_step_overhead * scale)


def record_cost_model(study: optuna.Study, cost: CostModel) -> None:
    """Keep the prices the study's estimates are made at with the study, so that an estimate
    far from its confirmation can be traced to the price that misled it."""
    study.set_user_attr("cost_model", dataclasses.asdict(cost))


def estimated_objective(
    model,
    prompts: Sequence[TeacherForcedPrompt],
    search: SearchConfig,
    num_layers: int,
    max_verify_tokens: int,
    generate_kwargs: dict[str, Any],
    worker: str,
    category_floor: float | None = None,
) -> tuple[EstimatedSpeedupObjective, CostModelWatch]:
    """The estimated objective with its cost model timed for `prompts`, and the callback that
    re-checks that cost model during the study (to pass to `study.optimize`)."""

    def time_cost_model() -> CostModel:
        return calibrate(
            model, prompts[0], num_layers, max_verify_tokens, search.draft_adapters.values(),
            generate_kwargs=generate_kwargs, verified_after=prompts,
        )

    cost = calibrate_loop(model, time_cost_model(), prompts, generate_kwargs)
    objective = EstimatedSpeedupObjective(model, prompts, cost, search, worker, category_floor)
    probe = verification_runs(model, prompts[:1], (1, max_verify_tokens))
    return objective, CostModelWatch(objective, probe, time_cost_model, device_timer(model.device))
