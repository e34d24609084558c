"""Timing the cost model on this machine: the verifier at a few widths, the draft's parts, plain
decodes, and our decoding loop's own overhead per step."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from transformers import LogitsProcessorList

from hf_selfspec.tuner_api import (
    PLAIN,
    DecodingState,
    DraftAwareCache,
    Drafter,
    DraftHeadsDrafter,
    ExitPolicy,
    HeadsShape,
    LayerSkipDrafter,
    RestrictedDraftHead,
    ShallowExitDrafter,
    SkippingDecoder,
    TokenSelector,
    forward_timings,
    load_adapter,
    read_adapter_shape,
    resolve_params,
    timed_generate,
    verifying,
)

from .. import progress
from ..studies.config import StudySettings
from .prices import CostModel, verification_knots, verification_prices
from .teacher_forcing import TeacherForcedPrompt, verifier_forward
from .timing import Timer, device_timer, interleaved_timings, typical_seconds

# Draft steps timed per calibration point. A typical time (`typical_seconds`) over the rounds of
# the interleaved timing, not the minimum: the estimate must match what decoding pays, not the
# machine's best moment.
_CALIBRATION_TOKENS = 6
# The verifier is timed at a few widths (`verification_knots`), each this many times a round: on a
# busy machine one forward pass may take several times another of the same width, and a price
# between two widths rests on both of their typical times.
_VERIFY_TIMINGS_PER_ROUND = 3
# Two restricted-head sizes pin down the head's cost as a line in the number of rows it keeps. A
# head is cheap enough for one call to drown in the timer's noise: each timing spans several.
_HEAD_SIZES = (2048, 16384)
_HEAD_CALLS = 4


def verification_runs(
    model, texts: Sequence[TeacherForcedPrompt], widths: Sequence[int]
) -> dict[int, Callable[[], Any]]:
    """By width: one forward pass of the full model over that many tokens after one of `texts`,
    the next one at each call, rolled back after each, as a verification step runs it."""
    turns = {tokens: itertools.cycle(texts) for tokens in widths}

    def verify(tokens: int) -> None:
        data = next(turns[tokens])
        verifier_forward(model, data.full_text[None, -tokens:], data.kv_length, data.cache, tokens)
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
    rounds: int = StudySettings.calibration_rounds,
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
    with progress.task("timing the cost model", total=rounds * len(runs), unit="timed runs"):
        timings = interleaved_timings(runs, rounds, progress.counted(timer))
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
        verifier_forward(model, prompt_ids, 0, prefill_cache, 1)

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

    # The head alone, timed directly: its share of a draft step is too small to read off
    # whole-step timings through their noise.
    hidden = torch.zeros((1, model.config.hidden_size), dtype=model.dtype, device=text.device)

    def adapter_draft(path: str) -> Callable[[], None]:
        adapter = load_adapter(model, path)
        if isinstance(adapter.shape, HeadsShape):
            heads = DraftHeadsDrafter(model, adapter)
            heads.features = hidden  # as a verification hands over; its cost depends on shapes alone
            return draft_run(heads, cache)
        # A prefill of its own, which the drafter continues from, so that the adapter's attention
        # spans the committed text as in a decode, and the prompt's teacher-forced KV stays untouched.
        own_cache = DraftAwareCache(model.config)
        verifier_forward(model, text[None, :kv_length], 0, own_cache, 1)
        return draft_run(ShallowExitDrafter(model, own_cache, adapter), own_cache)

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
        "adapter_draft_seconds": {path: seconds[path] / _drafted_tokens(path) for path in draft_adapters},
    }


def _drafted_tokens(path: str) -> int:
    """How many tokens a calibration run of the adapter at `path` drafts: draft heads no more
    than they are."""
    shape = read_adapter_shape(path)
    return min(shape.heads, _CALIBRATION_TOKENS) if isinstance(shape, HeadsShape) else _CALIBRATION_TOKENS


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
    for data in progress.counting(prompts, "timing the decoding loop", "prompts"):
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
