"""A study for a model nobody wrote one for: search ranges from the model's shape and the measured
cost of verifying several tokens at once.

What pays in speculative decoding depends on two things a tuner can read off any model and device:
how many layers there are to skip or exit after, and how much more a verification of `w` tokens
costs than one of a single token. Where a wide verification is nearly free (a GPU, a large model
on a CPU with matrix units) long drafts and long lookups pay; where it costs `w` times as much,
only short ones can. Nothing here is tuned to one model: every range follows from those inputs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from hf_selfspec.tuner_api import (
    TUNE_SPLIT,
    WORKLOAD,
    DraftAwareCache,
    cache_keyword,
    encode_prompt,
    read_jsonl_prompts,
    timed,
    timed_generate,
    verifying,
)

from .studies.config import DEFAULT_N_PROMPTS, PromptConfig, SearchConfig, StudyConfig, StudySettings
from .studies.knobs import strategy_knobs
from .studies.toml_reader import ModelConfig

# Verification widths timed on the device; the draft and lookup ranges reach the widest of them
# up to which each added position costs at most `_AFFORDABLE_MARGINAL_RATIO` of a single token.
VERIFY_WIDTHS = (1, 2, 4, 8, 16, 32)
_AFFORDABLE_MARGINAL_RATIO = 0.5
# Runner-ups are searched only where a verification this wide costs at most this many single ones.
_AFFORDABLE_VERIFY_RATIO = 2.0
# Verifying runner-ups multiplies the width: searched only where a width this wide is that cheap,
# and then up to as many as fill it beside a drafted token and the one before it.
_ALTERNATIVES_WIDTH = 16
_PREFIX_TOKENS = 64
_TIMING_ROUNDS = 3
# Below this vocabulary the LM head is a small part of a draft step, so restricting it is not searched.
_SMALL_VOCABULARY = 8192
DEFAULT_NEW_TOKENS = 64
# Best estimates measured by real decoding; the best of those on held-out prompts is exported.
CONFIRM_TOP = 2


@dataclass(frozen=True)
class DerivedSpace:
    """Search ranges by knob name, the warm-start skip ratios, and why, in words."""

    ranges: dict[str, tuple[float, float]]
    warm_start_skip_ratios: tuple[float, ...]
    reasons: tuple[str, ...]


def affordable_width(verify_seconds: Mapping[int, float]) -> int:
    """The widest timed verification up to which every added position costs at most
    `_AFFORDABLE_MARGINAL_RATIO` of a single token: one accepted at least that often pays for itself.

    Counted from width 2, the narrowest verification a draft makes. The step from 1 to 2 is the
    price of speculating at all, which the tuner weighs; on a CPU it is often a change of matrix
    kernel (a vector product to a matrix product) that costs as much as a second token, while
    every width after it comes nearly free.
    """
    single = verify_seconds[1]
    widths = sorted(width for width in verify_seconds if width >= 2)
    reach = widths[0] if widths else 1
    for narrower, wider in zip(widths, widths[1:]):
        if verify_seconds[wider] - verify_seconds[narrower] > _AFFORDABLE_MARGINAL_RATIO * single * (wider - narrower):
            break
        reach = wider
    return reach


def derive_space(num_layers: int, vocab_size: int, verify_seconds: Mapping[int, float]) -> DerivedSpace:
    """The search space for a model of `num_layers` decoder layers and `vocab_size` tokens whose
    verification of `w` tokens takes `verify_seconds[w]` (width 1 must be among them)."""
    if num_layers < 2 or vocab_size < 2 or 1 not in verify_seconds:
        raise ValueError(
            f"need at least 2 layers, 2 tokens and a timing at width 1, got {num_layers}, {vocab_size}, "
            f"{sorted(verify_seconds)}"
        )
    width = affordable_width(verify_seconds)
    draft = max(2, min(width - 1, 16))
    # A lookup grows within a request while the text copies and shrinks where it stops
    # (`AdaptiveLookupLength`): it starts at most a third of the way and grows up to the reach.
    lookup = max(2, width - 1)
    lookup_start = max(1, lookup // 3)
    alternatives_ratio = verify_seconds.get(_ALTERNATIVES_WIDTH, math.inf) / verify_seconds[1]
    alternatives = _ALTERNATIVES_WIDTH - 2 if alternatives_ratio <= _AFFORDABLE_VERIFY_RATIO else 0
    head = 0 if vocab_size <= _SMALL_VOCABULARY else vocab_size // 2
    ratios = (0.25, 0.5) if num_layers < 8 else (0.25, 0.4, 0.5)
    ranges: dict[str, tuple[float, float]] = {
        "max_draft_tokens": (0, draft),  # 0: lookup alone, where no draft of the model pays
        "prompt_lookup_tokens": (1, lookup_start),
        "prompt_lookup_max_tokens": (lookup_start, lookup),
        "prompt_lookup_min_tokens": (1, lookup_start),
        "prompt_lookup_min_ngram": (1, 2),
        "prompt_lookup_ngram": (2, 4),
        "draft_source_probe_interval": (0, 16),
        "draft_vocab_size": (0, head),
        "draft_alternatives": (0, alternatives),
        "backoff_probe_interval": (0, 32),
    }
    reasons = (
        f"up to a verification of {width} tokens each added token costs at most {_AFFORDABLE_MARGINAL_RATIO:g}x "
        f"one token's ({verify_seconds[width] / verify_seconds[1]:.2f}x for all {width}), "
        f"so drafts up to {draft} tokens are searched, and lookups that start at up to {lookup_start} "
        f"and grow while the text copies up to {lookup} or fewer",
        f"up to {alternatives} runner-up alternatives are searched: wide verifications are cheap"
        if alternatives
        else "runner-up alternatives are not searched: they widen verifications that are not cheap here",
        f"draft_vocab_size up to {head} of {vocab_size} tokens"
        if head
        else f"the draft keeps its whole head: a vocabulary of {vocab_size} is small",
    )
    return DerivedSpace(ranges, ratios, reasons)


@torch.inference_mode()
def time_verification(model, widths: tuple[int, ...] = VERIFY_WIDTHS, rounds: int = _TIMING_ROUNDS) -> dict[int, float]:
    """Median seconds of one forward pass over `w` new tokens after a short prefix, per width,
    in the model's own dtype; widths are timed round-robin so drift spreads over all of them."""
    vocab_size = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(vocab_size, (1, _PREFIX_TOKENS + max(widths)), generator=generator).to(model.device)
    cache = DraftAwareCache(model.config)
    model(text[:, :_PREFIX_TOKENS], **cache_keyword(cache), use_cache=True)
    timings: dict[int, list[float]] = {width: [] for width in widths}
    for _ in range(rounds + 1):  # the first round warms up, uncounted
        for width in widths:
            new_tokens = text[:, _PREFIX_TOKENS : _PREFIX_TOKENS + width]
            with verifying(model):
                _, seconds = timed(partial(model, new_tokens, **cache_keyword(cache), use_cache=True), model.device)
            timings[width].append(seconds)
            cache.rollback(_PREFIX_TOKENS)
    return {width: statistics.median(seconds[1:]) for width, seconds in timings.items()}


def time_plain_step(model, tokenizer, prompt, tokens: tuple[int, int] = (4, 20)) -> tuple[float, float]:
    """Seconds of one plain decoding step, and of `prompt`'s prefill, after an untimed decode:
    what every budgeted stage is sized from, timed before any of them. Two decodes of `prompt`,
    of a few new tokens and of many more, differ by steps alone (far enough apart that a
    shared host's jitter moves the step little); where noise hides that difference, the longer
    decode's seconds per token stand for a step, its prefill included."""
    inputs = encode_prompt(tokenizer, prompt)
    kwargs = {"strategy": "plain", "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    timed_generate(model, inputs, max_new_tokens=tokens[0], **kwargs)  # warm-up
    short, long = (timed_generate(model, inputs, max_new_tokens=n, **kwargs) for n in tokens)
    steps = len(long.new_tokens) - len(short.new_tokens)
    step = (long.seconds - short.seconds) / steps if steps > 0 else 0.0
    if step <= 0:
        return long.seconds / max(len(long.new_tokens), 1), 0.0
    return step, max(short.seconds - len(short.new_tokens) * step, 0.0)


def default_prompts(source: str | None, max_new_tokens: int = DEFAULT_NEW_TOKENS) -> PromptConfig:
    """The tune split of the general workload, one prompt per category (so every kind of text
    counts, in little time); or, from a JSONL file, its tune split if it marks one, else its first
    prompts; request streams by category too (each stream's first, in order), so that every
    stream is tuned on and an online corpus learns each as it goes."""
    if source is None:
        return PromptConfig(source=WORKLOAD, split=TUNE_SPLIT, per_category=1, max_new_tokens=max_new_tokens)
    marked = any(prompt.split == TUNE_SPLIT for prompt in read_jsonl_prompts(source))
    streams = has_streams(source)
    return PromptConfig(
        source=str(Path(source).resolve()),
        n_prompts=None if streams else DEFAULT_N_PROMPTS,
        split=TUNE_SPLIT if marked else None,
        max_new_tokens=max_new_tokens,
        per_category=1 if streams else None,
    )


def has_streams(source: str | None) -> bool:
    """Whether a prompt file holds request streams (prompts marked with their `stream`): text
    that repeats across requests, which an online corpus learns."""
    return source is not None and any(prompt.stream for prompt in read_jsonl_prompts(source))


def online_corpus_ranges(space: DerivedSpace) -> dict[str, tuple[float, float]]:
    """The online corpus's knobs, for a study that may switch it on: proposals as long as the
    device verifies cheaply (the lookups' reach), agreement from a loose tenth to a strict
    majority, contexts from any match to a long one."""
    return {
        "online_corpus_min_prob": (0.1, 0.6),
        "online_corpus_max_tokens": (2, int(space.ranges["prompt_lookup_max_tokens"][1])),
        "online_corpus_min_context": (1, 12),
    }


def objective_for(model) -> str:
    """Estimated where the estimate can run on this architecture (many trials for the time of a
    few), measured where it cannot."""
    from .costmodel import check_supported

    try:
        check_supported(model)
    except ValueError:
        return "measured"
    return "estimated"


def default_study_config(
    model: ModelConfig,
    space: DerivedSpace,
    prompts: PromptConfig,
    *,
    name: str,
    objective: str,
    storage: str | None = None,
    draft_adapters: Mapping[str, str] | None = None,
    lookup_corpus: str = "",
    online_corpus: bool = False,
) -> StudyConfig:
    """A study over `space` (estimated ones have their best estimates confirmed by real decoding):
    the layer-skip draft, or, given trained adapters, Kangaroo choosing among them; prompt lookup
    always on, into `lookup_corpus` if there is one; with `online_corpus`, trials choose whether
    to learn across the prompts too."""
    strategy = "kangaroo" if draft_adapters else "self_speculative"
    knobs = strategy_knobs(strategy)
    ranges = {**space.ranges, **(online_corpus_ranges(space) if online_corpus else {})}
    return StudyConfig(
        model=model,
        prompts=prompts,
        search=SearchConfig(
            strategy=strategy,
            ranges={knob: span for knob, span in ranges.items() if knob in knobs},
            online_corpus=(False, True) if online_corpus else (False,),
            warm_start_skip_ratios=space.warm_start_skip_ratios,
            draft_adapters=dict(draft_adapters or {}),
            lookup_corpus=lookup_corpus,
        ),
        study=StudySettings(name=name, storage=storage, objective=objective, confirm_top=CONFIRM_TOP, seed=0),
    )


def study_for_model(model: ModelConfig, storage: str | None = None, prompts: str | None = None) -> StudyConfig:
    """The study `tune --model` runs: the defaults `optimize` tunes with, measured on this device,
    without a lookup corpus or an adapter (neither exists yet for a model without a study), and
    with the online corpus searched on request streams."""
    from hf_selfspec.tuner_api import decoder_layers

    loaded, _ = model.load()
    space = derive_space(
        len(decoder_layers(loaded)), loaded.get_output_embeddings().weight.shape[0], time_verification(loaded)
    )
    objective = objective_for(loaded)
    del loaded
    return default_study_config(model, space, default_prompts(prompts), name=f"default:{Path(model.name).name}",
                                objective=objective, storage=storage, online_corpus=has_streams(prompts))
