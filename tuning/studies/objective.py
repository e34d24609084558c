"""Measuring one trial: its speedup over plain greedy decoding, on the study's prompts.

For every prompt the trial runs plain `generate` (`strategy="plain"`) and the candidate back to
back, alternating which goes first, so drift in clock speed, thermal state or a neighbour's load
hits both alike and cancels in the ratio of their seconds per generated token, taken per
category of the prompts; over several categories the trial's value is the geometric mean of
those ratios (`categories`). Trials confirmed together (`measure_side_by_side`) share the plain
decodes of each prompt, the order rotating over all of them. Every candidate's tokens are
compared with plain greedy decoding's: the strategies are lossless by design, so a difference
is a bug, and the trial fails loudly instead of reporting a speed that was bought with wrong
output.

A study at a batch size above one measures batches instead of prompts (`PreparedBatch`): plain
batched `generate` against the candidate on the whole batch, in the tokens of all its rows, every
row held to its own row of plain batched greedy decoding. At batch size one each batch is one
prompt, and everything above reads as it says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch

from hf_selfspec.tuner_api import (
    NEAR_TIE,
    PLAIN,
    OnlineCorpus,
    Consistency,
    Prompt,
    StrategyStats,
    TimedRun,
    check_greedy_consistency,
    encode_batch,
    encode_prompt,
    online_corpus,
    resolve_params,
    timed_generate,
)

from .categories import CategorySpeedups, alternating_order, rotation_offsets
from .config import SearchConfig
from .space import ADAPTER_PARAM, skip_ratio, suggest_params, uses_online_corpus

logger = logging.getLogger(__name__)
# A pruned trial's user attribute: how many prompts it decoded (its steps count batches).
PRUNED_AFTER_PROMPTS = "pruned_after_prompts"


class LosslessViolation(Exception):
    """A candidate produced tokens that plain greedy decoding did not: the trial is FAILED."""


@dataclass(frozen=True)
class PreparedPrompt:
    id: str
    inputs: dict[str, torch.Tensor]
    # Plain greedy decoding's new tokens and raw logits (in a batch, its row's of the plain batched
    # decode): deterministic, so computed once per process; the logits judge a reduced-precision
    # near-tie (`hf_selfspec.consistency`).
    reference_tokens: list[int]
    reference_logits: torch.Tensor
    category: str | None = None


@dataclass(frozen=True)
class PreparedBatch:
    """Prompts of one category that a trial decodes at once, as one `generate` call: its rows, in
    order, and their left-padded `inputs`. A study at batch size one has one prompt in each."""

    prompts: tuple[PreparedPrompt, ...]
    inputs: dict[str, torch.Tensor]

    @property
    def category(self) -> str | None:
        return self.prompts[0].category


def as_batch(unit: PreparedPrompt | PreparedBatch) -> PreparedBatch:
    """A prompt as the batch of one it is decoded as; a batch as it is."""
    return unit if isinstance(unit, PreparedBatch) else PreparedBatch((unit,), unit.inputs)


def prepare_prompts(
    model, tokenizer, batches: Iterable[Sequence[Prompt]], generate_kwargs: dict[str, Any]
) -> tuple[list[PreparedBatch], float]:
    """Encode the prompts, batch by batch (`study_prompts.batch_prompts`; at batch size one, a
    prompt each), and decode each batch plainly once.

    That pass warms up the process (first calls allocate and pick kernels, which no trial should
    pay for), yields each row's reference tokens for the lossless check, and measures the plain
    tokens/s that the study note reports. A row's reference is plain batched greedy's in its own
    batch, the decode a candidate's row is compared with, not the prompt decoded alone.
    """
    prepared, tokens, seconds = [], 0, 0.0
    for members in batches:
        inputs = encode_batch(tokenizer, list(members))
        run = timed_generate(model, inputs, strategy=PLAIN, output_logits=True, **generate_kwargs)
        rows = tuple(
            PreparedPrompt(prompt.id, dict(encode_prompt(tokenizer, prompt)), row, logits, prompt.category)
            for prompt, row, logits in zip(members, run.rows, run.row_logits, strict=True)
        )
        prepared.append(PreparedBatch(rows, inputs))
        tokens += sum(len(row) for row in run.rows)
        seconds += run.seconds
    return prepared, tokens / seconds if seconds > 0 else 0.0


def batch_members(batches: Sequence[PreparedBatch]) -> list[PreparedPrompt]:
    """Every prompt of the batches, in the order they are decoded."""
    return [prompt for batch in batches for prompt in batch.prompts]


def save_learned_corpus(model, prompts: Sequence[PreparedPrompt], path: Path) -> Path:
    """Save what a trial's online corpus holds once it has decoded every prompt: each prompt and
    plain greedy's text after it (the trial's own, as it decodes losslessly), in order, bounded
    as the trial's was. `export` ships it beside a profile whose trial learned with it."""
    corpus = OnlineCorpus(model.get_output_embeddings().weight.shape[0])
    for prompt in prompts:
        corpus.add(prompt.inputs["input_ids"][0].tolist() + prompt.reference_tokens)
    return corpus.save(path, f"what an online corpus learned from {len(prompts)} study prompts")


def fresh_corpus_key(model, values: dict[str, Any], candidate: int = 0, round_: int = 0) -> str | None:
    """The key of the online corpus a trial (its Optuna parameters `values`) decodes its prompts
    with, emptied now; None where the trial does not switch the corpus on. One per candidate
    measured at once and per round of its decodes, so a trial learns neither from another's
    decodes nor from its own earlier round of the same prompt, only from the prompts before."""
    if not uses_online_corpus(values):
        return None
    key = f"tuning/candidate-{candidate}/round-{round_}"
    online_corpus(model, key).clear()
    return key


def begin_trial(trial: optuna.trial.BaseTrial, search: SearchConfig, num_layers: int, worker: str) -> dict[str, Any]:
    """Sample the trial's parameters and record what every trial records about its draft;
    returns them as `generate` keyword arguments."""
    params = suggest_params(trial, search, num_layers)
    trial.set_user_attr("worker", worker)
    if ADAPTER_PARAM in trial.params:
        trial.set_user_attr("draft_adapter", trial.params[ADAPTER_PARAM])
    else:
        trial.set_user_attr("attn_skip_layers", params["attn_skip_layers"])
        trial.set_user_attr("mlp_skip_layers", params["mlp_skip_layers"])
        trial.set_user_attr("skip_ratio", skip_ratio(params, num_layers))
    return params


class SpeedupObjective:
    """`study.optimize`'s objective: suggest a skip set and knobs, measure them, return the speedup.

    `prompts` are the study's batches (`prepare_prompts`); a prompt given alone is a batch of one.
    Intermediate speedups (over the categories measured so far) are reported after every batch,
    so the pruner can stop a hopeless skip set after a prompt or two. A skip set that drops every
    layer entirely is pruned before measuring: `generate` rejects it, and pruned trials teach
    the sampler to avoid it. With a `category_floor`, a complete trial whose
    speedup in some category is below it is marked infeasible (`categories`).
    """

    def __init__(
        self,
        model,
        prompts: Sequence[PreparedPrompt | PreparedBatch],
        search: SearchConfig,
        num_layers: int,
        generate_kwargs: dict[str, Any],
        worker: str,
        category_floor: float | None = None,
    ):
        self.model = model
        self.batches = [as_batch(unit) for unit in prompts]
        self.search = search
        self.num_layers = num_layers
        self.generate_kwargs = generate_kwargs
        self.worker = worker
        self.category_floor = category_floor
        self.candidate_first = alternating_order([batch.category for batch in self.batches])

    def __call__(self, trial: optuna.Trial) -> float:
        params = begin_trial(trial, self.search, self.num_layers, self.worker)
        try:
            resolve_params(self.num_layers, params)
        except ValueError as error:
            raise optuna.TrialPruned(f"invalid skip set: {error}") from None
        params = {**params, "online_corpus": fresh_corpus_key(self.model, trial.params)}
        totals = CategorySpeedups([batch.category for batch in self.batches])
        near_ties: list[str] = []  # prompts whose output left plain greedy's at a near-tie
        trial.set_user_attr("near_tie_prompts", near_ties)
        for step, (batch, candidate_first) in enumerate(zip(self.batches, self.candidate_first, strict=True)):
            baseline, candidate = self._measure(batch, params, candidate_first)
            self._score(trial, params, totals, near_ties, batch, [baseline], [candidate])
            trial.report(totals.value, step)
            if trial.should_prune():
                totals.record(trial)
                decoded = len(batch_members(self.batches[: step + 1]))
                trial.set_user_attr(PRUNED_AFTER_PROMPTS, decoded)  # a step is a batch of prompts
                raise optuna.TrialPruned(
                    f"pruned after {decoded} of {len(batch_members(self.batches))} prompts at {totals.value:.2f}x"
                )
        totals.record(trial, self.category_floor)
        return totals.value

    def measure_side_by_side(
        self,
        trials: Sequence[optuna.trial.BaseTrial],
        on_prompt: Callable[[], None] = lambda: None,
        rounds: int = 1,
    ) -> list[float | LosslessViolation]:
        """Measure fixed trials (an estimated study's best, to confirm) together: each prompt (each
        batch) is decoded plainly and by every trial, `rounds` times over, in an order rotated
        from prompt to prompt and from round to round.

        k trials then cost k + 1 decodes of a prompt a round instead of 2k, and all of them are
        compared with the same plain decodes, so load that comes and goes cannot favour one over
        another. More rounds weigh one decode that a neighbour's burst slowed less: with one prompt
        a category, a single decode is the category's whole measurement. A trial whose output
        leaves plain greedy decoding's is decoded no further; its entry is the
        `LosslessViolation`. `on_prompt` is called after each prompt (batch), for a progress bar.
        """
        params = [begin_trial(trial, self.search, self.num_layers, self.worker) for trial in trials]
        by_round = [
            [{**values, "online_corpus": fresh_corpus_key(self.model, trial.params, index, round_)} for round_ in range(rounds)]
            for index, (trial, values) in enumerate(zip(trials, params, strict=True))
        ]
        totals = [CategorySpeedups([batch.category for batch in self.batches]) for _ in trials]
        near_ties: list[list[str]] = [[] for _ in trials]
        for trial, prompts in zip(trials, near_ties, strict=True):
            trial.set_user_attr("near_tie_prompts", prompts)
        violations: dict[int, LosslessViolation] = {}
        offsets = rotation_offsets([batch.category for batch in self.batches], len(trials) + 1)
        for batch, offset in zip(self.batches, offsets, strict=True):
            live = [index for index in range(len(trials)) if index not in violations]
            order: list[int | None] = [None, *live]  # None: the plain decode
            runs: dict[int | None, list[TimedRun]] = {index: [] for index in order}
            for round_ in range(rounds):
                shift = (offset + round_) % len(order)
                for index in order[shift:] + order[:shift]:
                    runs[index].append(self._decode(batch, None if index is None else by_round[index][round_]))
            for index in live:
                try:
                    self._score(
                        trials[index], params[index], totals[index], near_ties[index], batch, runs[None], runs[index]
                    )
                except LosslessViolation as violation:
                    violations[index] = violation
            on_prompt()
        outcomes: list[float | LosslessViolation] = []
        for index, trial in enumerate(trials):
            if index in violations:
                outcomes.append(violations[index])
                continue
            totals[index].record(trial, self.category_floor)
            outcomes.append(totals[index].value)
        return outcomes

    def _decode(self, batch: PreparedBatch, params: dict[str, Any] | None) -> TimedRun:
        """One timed decode of the batch: plain with `params` None, else the candidate's."""
        if params is None:
            return timed_generate(self.model, batch.inputs, strategy=PLAIN, **self.generate_kwargs)
        strategy = self.search.strategy
        return timed_generate(self.model, batch.inputs, strategy=strategy, **params, **self.generate_kwargs)

    def _measure(
        self, batch: PreparedBatch, params: dict[str, Any], candidate_first: bool
    ) -> tuple[TimedRun, TimedRun]:
        if candidate_first:
            candidate_run = self._decode(batch, params)
            return self._decode(batch, None), candidate_run
        baseline_run = self._decode(batch, None)
        return baseline_run, self._decode(batch, params)

    def _score(
        self,
        trial: optuna.trial.BaseTrial,
        params: dict[str, Any],
        totals: CategorySpeedups,
        near_ties: list[str],
        batch: PreparedBatch,
        baselines: Sequence[TimedRun],
        candidates: Sequence[TimedRun],
    ) -> None:
        """Add one batch's decodes, plain's and the candidate's over every round, to the trial's
        totals; a `LosslessViolation` (the totals so far recorded on the trial) if any row of the
        candidate's decodes is not its row of plain greedy's tokens."""
        (baseline, _), (candidate, stats) = _pooled(baselines), _pooled(candidates)
        totals.add(batch.category, baseline, candidate, stats, len(batch.prompts))
        for run in candidates:
            for prompt, tokens in zip(batch.prompts, run.rows, strict=True):
                consistency = check_greedy_consistency(
                    tokens, prompt.reference_tokens, prompt.reference_logits, self.model.dtype
                )
                if not consistency.consistent:
                    totals.record(trial)
                    raise self._violation(trial, prompt, tokens, params, consistency)
                if consistency.verdict == NEAR_TIE and prompt.id not in near_ties:
                    near_ties.append(prompt.id)
                    trial.set_user_attr("near_tie_prompts", near_ties)

    def _violation(
        self,
        trial: optuna.trial.BaseTrial,
        prompt: PreparedPrompt,
        tokens: list[int],
        params: dict[str, Any],
        consistency: Consistency,
    ) -> LosslessViolation:
        position = consistency.first_difference

        def token_at(sequence: list[int]) -> int | None:
            return sequence[position] if position < len(sequence) else None

        expected, actual = token_at(prompt.reference_tokens), token_at(tokens)
        message = (
            f"LOSSLESS VIOLATION in trial {trial.number}: strategy {self.search.strategy!r} changed the output "
            f"of prompt {prompt.id} at new token {position} (plain greedy: {expected}, strategy: {actual}"
            + (f", {consistency.gap_ulps:g} ulp apart in plain's logits" if consistency.gap_ulps is not None else "")
            + f") with params {params}. This is a bug in the strategy; the trial is marked FAILED."
        )
        logger.error(message)
        trial.set_user_attr(
            "lossless_violation", {"prompt": prompt.id, "position": position, "expected": expected, "actual": actual}
        )
        return LosslessViolation(message)


def _pooled(runs: Sequence[TimedRun]) -> tuple[tuple[float, int], StrategyStats | None]:
    """Decodes of one prompt or batch as one: (their seconds, their generated tokens, every row's)
    and their draft counters summed (None for plain decodes, which keep none)."""
    pooled = None
    for run in runs:
        if run.stats is not None:
            pooled = pooled or StrategyStats()
            pooled.add(run.stats)
    return (sum(run.seconds for run in runs), sum(len(row) for run in runs for row in run.rows)), pooled
