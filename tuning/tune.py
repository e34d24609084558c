"""Running a study: load the model once, then let Optuna ask for trials until the budget is spent.

Everything a study needs to survive is in the storage: finished trials are committed as they
end, a killed worker's running trial is failed by the next worker's heartbeat check, and the
warm-start trials wait there until some worker runs them. Re-running the same config therefore
resumes, and any number of processes on any number of machines can share one study.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import optuna
from optuna.trial import TrialState
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from hf_selfspec.tuner_api import adapter_digest, cache_root

from . import TuningError, progress
from .studies.categories import describe_categories, is_feasible
from .studies.config import ESTIMATED_BATCHES, StudyConfig, check_adapters_fit
from .studies.dashboard import best_trial, count_states, draft_figure, infeasible_trials, write_study_note
from .costmodel import check_supported, estimated_objective, record_cost_model, teacher_force
from .studies.objective import (
    PRUNED_AFTER_PROMPTS,
    LosslessViolation,
    SpeedupObjective,
    batch_members,
    prepare_prompts,
    save_learned_corpus,
)
from .studies.space import warm_start_trials
from .studies.study_prompts import batch_prompts, select_study_prompts
from .studies.storage import (
    StudyContext,
    create_or_load_study,
    derive_study_name,
    display_url,
    estimated_study_name,
    open_storage,
    resolve_storage_url,
)

logger = logging.getLogger(__name__)

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
# How long a worker joining a study without trials waits for its creator's warm starts.
CREATOR_GRACE_S = 10.0


@dataclass
class TuneOutcome:
    study: optuna.Study
    storage_url: str
    this_run: dict[TrialState, int]
    # With `objective = "estimated"`: the measured study the best estimates were confirmed in.
    confirmed: optuna.Study | None = None

    @property
    def best(self) -> optuna.trial.FrozenTrial | None:
        return best_trial(self.export_study)

    @property
    def export_study(self) -> optuna.Study:
        """The study whose best trial is worth exporting: measured speedups beat estimates."""
        return self.confirmed or self.study


def library_versions() -> dict[str, str]:
    versions = {}
    for distribution in ("hf-selfspec", "transformers", "torch", "optuna"):
        try:
            versions[distribution] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            versions[distribution] = "not installed (source tree)"
    return versions


def _sampler(config: StudyConfig, seed: int | None) -> optuna.samplers.BaseSampler:
    if config.study.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # constant_liar (the default) keeps concurrent workers from sampling the same point.
    return optuna.samplers.TPESampler(seed=seed)


def _pruner(config: StudyConfig) -> optuna.pruners.BasePruner:
    if config.study.pruner == "none":
        return optuna.pruners.NopPruner()
    # Each step is one prompt, the same prompt for every trial, so even the first compares like
    # with like; a skip set far behind the median there only costs more time on the rest.
    return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=0)


def trial_line(trial: optuna.trial.FrozenTrial) -> str:
    """A finished trial in one line: its speedup and draft, why it was pruned, or why it failed."""
    attrs = trial.user_attrs
    if trial.state == TrialState.COMPLETE:
        return (
            f"trial {trial.number}: {trial.value:.2f}x, acceptance {attrs['acceptance_rate']:.0%}, "
            + " ".join(draft_figure(attrs))
            + ("" if is_feasible(trial) else f"; infeasible, {_below_floor(trial)}")
        )
    if trial.state == TrialState.PRUNED:
        steps = trial.intermediate_values
        if not steps:
            return f"trial {trial.number}: pruned before measuring (it skips every layer whole)"
        decoded = attrs.get(PRUNED_AFTER_PROMPTS, len(steps))
        return f"trial {trial.number}: pruned after {decoded} prompt(s) at {steps[max(steps)]:.2f}x"
    violation = attrs.get("lossless_violation")
    reason = f"lossless violation on {violation['prompt']}" if violation else "error"
    return f"trial {trial.number}: FAILED ({reason})"


class _Progress:
    """A trial bar with the best speedup so far, one line per finished trial, and the study note
    refreshed whenever this worker finds a new best."""

    def __init__(self, total: int, enabled: bool):
        # disable=None: no bar when stderr is not a terminal (CI logs), the per-trial lines remain.
        self.bar = tqdm(total=total, unit="trial", desc="tuning", disable=None if enabled else True)
        self.this_run = {state: 0 for state in FINISHED}

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.this_run[trial.state] += 1
        self.bar.write(trial_line(trial))
        best = best_trial(study)
        if best is not None:
            self.bar.set_postfix_str(f"best {best.value:.2f}x (trial {best.number})")
            if best.number == trial.number:
                write_study_note(study)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _optimize(
    study: optuna.Study, objective, n_trials: int, timeout: float | None, callbacks, show_progress: bool,
    deadline: float | None = None,
):
    """Run trials with our progress bar and per-trial lines (and, while a trial runs long, a line
    at least every interval); returns this run's trial counts."""
    planned = None if deadline is None else max(deadline - progress.clock(), 0.0)
    with progress.task("trials", planned_seconds=planned):
        return _run_trials(study, objective, n_trials, timeout, callbacks, show_progress)


def _run_trials(study: optuna.Study, objective, n_trials: int, timeout: float | None, callbacks, show_progress: bool):
    trials = _Progress(n_trials, show_progress)
    optuna_logger = logging.getLogger("optuna")
    previous_verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our per-trial line replaces Optuna's
    try:
        with logging_redirect_tqdm(loggers=[logging.getLogger(__package__), optuna_logger]):
            study.optimize(
                objective,
                n_trials=n_trials,
                timeout=timeout,
                catch=(LosslessViolation,),
                callbacks=[trials, *callbacks],
            )
    finally:
        trials.close()
        optuna.logging.set_verbosity(previous_verbosity)
        with contextlib.suppress(Exception):  # a note is a courtesy; never mask the real error
            write_study_note(study)
    return trials.this_run


def run_tune(
    config: StudyConfig,
    storage_url: str | None = None,
    n_trials: int | None = None,
    timeout: float | None = None,
    show_progress: bool = True,
    deadline: float | None = None,
) -> TuneOutcome:
    """Tune until `n_trials` more trials ran in this process, or, without it, until the study
    holds the config's trial budget of finished trials (counted over all workers). An estimated
    study then measures its `confirm_top` best trials for real in the config's measured study.
    With `deadline` (a `progress.clock()` instant), no trial starts after it (one trial runs at
    least), however long the model load and the cost model's timing took before the first."""
    from hf_selfspec.tuner_api import available_strategies, choose_layouts, decoder_layers, device_profile_key

    storage_url = resolve_storage_url(storage_url or config.study.storage)
    # Opened before the model loads, so an unreachable server costs seconds, not a model load.
    storage = open_storage(storage_url, config.study.heartbeat_interval, config.study.grace_period)
    if config.search.strategy not in available_strategies():
        raise TuningError(f"strategy {config.search.strategy!r} is not available; have {available_strategies()}")
    if config.study.objective == "estimated" and config.prompts.batch_size > 1:  # a config built in Python
        raise TuningError(f"prompts.batch_size = {config.prompts.batch_size}: {ESTIMATED_BATCHES}")
    try:
        prompts = select_study_prompts(config.prompts)
    except ValueError as error:
        raise TuningError(str(error)) from None
    model, tokenizer = config.model.load()
    choose_layouts(model)  # not inside the first trial, estimated or measured, to meet a width
    num_layers = len(decoder_layers(model))
    device_key = device_profile_key(model.device, model.dtype)
    context = _study_context(config, model, device_key, num_layers, len(prompts))
    check_adapters_fit(config.search, model)

    estimated = config.study.objective == "estimated"
    if estimated:
        try:
            check_supported(model)
        except ValueError as error:
            raise TuningError(str(error)) from None
    measured_name = derive_study_name(config, device_key, len(prompts))
    study_name = estimated_study_name(measured_name) if estimated else measured_name
    study = _open_study(storage, study_name, config, context, num_layers)
    print(f"Study {study.study_name!r} in {display_url(storage_url)}", flush=True)

    generate_kwargs = {
        "max_new_tokens": config.prompts.max_new_tokens,
        "do_sample": False,
        "pad_token_id": tokenizer.pad_token_id,
    }
    prepared, context = _prepare(model, tokenizer, config, prompts, generate_kwargs, context, measured_name)
    context.save(study)
    write_study_note(study)
    worker = f"{socket.gethostname()}:{os.getpid()}"
    callbacks: list[Callable] = []
    n_trials = _trials_to_run(study, config, n_trials, callbacks)

    this_run = {state: 0 for state in FINISHED}
    floor = config.study.category_floor
    reprice = None  # the estimate at the cost model's prices as they are now, once timed in this run
    if n_trials > 0:
        if estimated:  # the cost model takes a minute to time: only for trials that will run
            objective, reprice = _estimating(model, prepared, config, num_layers, generate_kwargs, worker, study, callbacks)
        else:
            objective = SpeedupObjective(model, prepared, config.search, num_layers, generate_kwargs, worker, floor)
        timeout = timeout if timeout is not None else config.study.timeout
        if deadline is not None:
            callbacks.append(_stop_at(deadline))
        this_run = _optimize(study, objective, n_trials, timeout, callbacks, show_progress, deadline)
    outcome = TuneOutcome(study, storage_url, this_run)
    if estimated and config.study.confirm_top:
        measuring = SpeedupObjective(model, prepared, config.search, num_layers, generate_kwargs, worker, floor)
        outcome.confirmed = confirm_estimates(
            storage, measured_name, study, context, config, measuring, show_progress, reprice
        )
    return outcome


def _prepare(model, tokenizer, config: StudyConfig, prompts, generate_kwargs, context: StudyContext, measured_name: str):
    """The study's prompts in its batches, each decoded plainly once (`prepare_prompts`), and the
    context with plain decoding's speed and, where trials may learn online, what a corpus learns
    from the prompts (`save_learned_corpus`)."""
    batches = batch_prompts(prompts, config.prompts.batch_size)
    unit = "prompts" if config.prompts.batch_size == 1 else "batches"
    prepared, baseline_tps = prepare_prompts(
        model, tokenizer, progress.counting(batches, "decoding the prompts plainly", unit), generate_kwargs
    )
    context = dataclasses.replace(context, baseline_tokens_per_second=baseline_tps)
    if True in config.search.online_corpus:
        corpus_path = cache_root() / "online-corpora" / re.sub(r"[^\w.-]+", "-", measured_name)
        learned = save_learned_corpus(model, batch_members(prepared), corpus_path)
        context = dataclasses.replace(context, online_corpus_file=str(learned), online_corpus_digest=adapter_digest(learned))
    return prepared, context


def _stop_at(deadline: float) -> Callable[[optuna.Study, optuna.trial.FrozenTrial], None]:
    """A callback that stops the study once a trial ends at or after `deadline` (`progress.clock`)."""

    def stop(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if progress.clock() >= deadline:
            study.stop()

    return stop


def _study_context(config: StudyConfig, model, device_key: str, num_layers: int, n_prompts: int) -> StudyContext:
    """What the study measures, as every worker must agree on it; the baseline is measured later."""
    return StudyContext(
        model=config.model.name,
        gguf_file=config.model.gguf_file,
        dtype=str(model.dtype).removeprefix("torch."),  # what "auto" settled on
        device_key=device_key,
        strategy=config.search.strategy,
        num_layers=num_layers,
        prompt_source=Path(config.prompts.source).name,  # `humaneval`, `workload`, or the file's name
        n_prompts=n_prompts,
        prompt_offset=config.prompts.offset,
        max_new_tokens=config.prompts.max_new_tokens,
        baseline_tokens_per_second=0.0,
        versions=library_versions(),
        draft_adapters=config.search.draft_adapters,
        draft_adapter_digests={name: adapter_digest(path) for name, path in config.search.draft_adapters.items()},
        lookup_corpus=config.search.lookup_corpus,
        lookup_corpus_digest=adapter_digest(config.search.lookup_corpus) if config.search.lookup_corpus else "",
        online_corpus_choices=list(config.search.online_corpus),
        prompt_split=config.prompts.split or "",
        prompts_per_category=config.prompts.per_category or 0,
        category_floor=config.study.category_floor or 0.0,
        batch_size=config.prompts.batch_size,
    )


def _open_study(storage, name: str, config: StudyConfig, context: StudyContext, num_layers: int) -> optuna.Study:
    """The study `name`, created with its context and warm-start trials, or loaded when its
    context matches this run's."""
    study, created = create_or_load_study(storage, name, _sampler(config, config.study.seed), _pruner(config))
    if not created:
        _await_first_trials(study)
    context.check_matches(study)
    if created or not study.get_trials(deepcopy=False):
        # With the study, at once: what it measures and the likeliest good trials. A worker
        # killed in between leaves a study without trials, which the next run repairs here.
        context.save(study)
        for params in warm_start_trials(config.search, num_layers):
            study.enqueue_trial(params, skip_if_exists=True)
    if not created:
        # The seed makes a fresh single-worker study reproducible. A worker joining or resuming
        # a study must not replay that random sequence, or it would repeat trials already run.
        study.sampler = _sampler(config, seed=None)
    return study


def _await_first_trials(study: optuna.Study) -> None:
    """Give the worker that created `study` a moment to enqueue its warm starts: a worker that
    loaded it in between would otherwise enqueue them too, and the study would run them twice.
    A study still without trials after the wait was left so by a killed worker."""
    deadline = time.monotonic() + CREATOR_GRACE_S
    while not study.get_trials(deepcopy=False) and time.monotonic() < deadline:
        time.sleep(0.2)


def _trials_to_run(study: optuna.Study, config: StudyConfig, n_trials: int | None, callbacks: list) -> int:
    """`n_trials`, or without it what is left of the config's budget, counted over all workers
    (with the callback that stops this worker once the study has spent it)."""
    if n_trials is not None:
        return n_trials
    finished = len(study.get_trials(deepcopy=False, states=FINISHED))
    # Other workers spend the same budget; stop when the study as a whole has spent it.
    callbacks.append(optuna.study.MaxTrialsCallback(config.study.n_trials, states=FINISHED))
    if finished < config.study.n_trials:
        return config.study.n_trials - finished
    print(
        f"The study already holds {finished} finished trials (budget {config.study.n_trials}); "
        "pass --n-trials to run more."
    )
    return 0


def _estimating(model, prepared, config: StudyConfig, num_layers: int, generate_kwargs, worker: str, study, callbacks):
    """The estimated objective with its cost model timed now and kept with the study, its watch
    added to `callbacks`; and the way to reprice a trial at the latest prices."""
    print("Timing the forward passes for the cost model...", flush=True)
    forced = [
        teacher_force(model, prompt, config.prompts.max_new_tokens)
        for prompt in progress.counting(batch_members(prepared), "teacher-forcing the prompts", "prompts")
    ]
    max_draft = int(config.search.range_of("max_draft_tokens")[1])
    max_alternatives = int(config.search.range_of("draft_alternatives")[1])
    lookups = ("prompt_lookup_max_tokens", *(("online_corpus_max_tokens",) if True in config.search.online_corpus else ()))
    longest_lookup = int(max(config.search.range_of(name)[1] for name in lookups))
    beside_lookup = int(config.search.range_of("lookup_alternatives")[1])
    widest = max(max_draft * (1 + max_alternatives), longest_lookup + beside_lookup) + 1
    objective, cost_watch = estimated_objective(
        model, forced, config.search, num_layers, widest, generate_kwargs, worker, config.study.category_floor,
        config.study.calibration_rounds,
    )
    record_cost_model(study, objective.cost)
    callbacks.append(cost_watch)
    return objective, objective.reprice


def confirm_estimates(
    storage, measured_name: str, estimated: optuna.Study, context: StudyContext, config: StudyConfig,
    measuring: SpeedupObjective, show_progress: bool,
    reprice: Callable[[optuna.trial.FrozenTrial], float] | None = None,
) -> optuna.Study:
    """Measure the best feasible estimated trials by real decoding, as trials of the measured study.

    With `reprice`, the best are chosen again from twice as many, each estimated afresh at the
    cost model's prices as they are now. A study's values carry the prices of the moment each
    trial ran; once the cost model has been re-timed on a machine whose load changed, the values
    before and after were priced apart, and the highest are likeliest those of the cheapest
    stretch. The prices now are the ones timed nearest the confirmation, so they are the ones its
    measurement can be compared with.

    They are decoded side by side, beside plain decodes of each prompt, `confirm_rounds` of each
    (`SpeedupObjective.measure_side_by_side`), and each is added to the measured study only once
    measured whole, so a killed run leaves nothing half-done and the next run measures what is
    missing. A trial with the same parameters already there is not measured again. Each remembers
    the estimate it came from, so the two can be compared side by side. An estimate below the
    category floor is not confirmed: the measurement would only find it below too.
    """
    measured, _ = create_or_load_study(storage, measured_name, _sampler(config, None), optuna.pruners.NopPruner())
    context.check_matches(measured)
    context.save(measured)
    complete = [t for t in estimated.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if is_feasible(t)]
    ranked = sorted(complete, key=lambda t: t.value, reverse=True)
    if reprice is None:
        candidates = [(trial, trial.value) for trial in ranked]
    else:
        candidates = [(trial, reprice(trial)) for trial in ranked[: 2 * config.study.confirm_top]]
    best = sorted(candidates, key=lambda candidate: candidate[1], reverse=True)[: config.study.confirm_top]
    already = [trial.params for trial in measured.get_trials(deepcopy=False, states=FINISHED)]
    pending = [(trial, value) for trial, value in best if trial.params not in already]
    if not pending:
        return measured
    print(
        f"Confirming {len(pending)} estimated trial(s) by real decoding, side by side, in study {measured_name!r}",
        flush=True,
    )
    fixed = [optuna.trial.FixedTrial(trial.params) for trial, _ in pending]
    disable = None if show_progress else True  # None: no bar where stderr is not a terminal
    with tqdm(total=len(measuring.batches), unit="prompt", desc="confirming", disable=disable) as bar, \
            progress.task("confirming", total=len(measuring.batches), unit="prompts"):
        outcomes = measuring.measure_side_by_side(
            fixed, lambda: (bar.update(1), progress.advance()), config.study.confirm_rounds
        )
    trials = _Progress(len(pending), show_progress)
    for (estimate, value), trial, outcome in zip(pending, fixed, outcomes, strict=True):
        failed = isinstance(outcome, LosslessViolation)
        repriced = {"estimated_speedup_in_study": estimate.value} if value != estimate.value else {}
        measured.add_trial(
            optuna.trial.create_trial(
                state=TrialState.FAIL if failed else TrialState.COMPLETE,
                value=None if failed else outcome,
                params=estimate.params,
                distributions=estimate.distributions,
                user_attrs={
                    **trial.user_attrs, "estimated_speedup": value, "estimated_trial": estimate.number, **repriced
                },
                constraints=trial.constraints or None,
            )
        )
        trials(measured, measured.get_trials(deepcopy=False)[-1])
    trials.close()
    write_study_note(measured)
    return measured


def _below_floor(trial: optuna.trial.FrozenTrial) -> str:
    """`<category> <speedup>x, ... below the category floor`, for an infeasible trial."""
    below = trial.user_attrs.get("below_category_floor") or {}
    return ", ".join(f"{name} {speedup:.2f}x" for name, speedup in below.items()) + " below the category floor"


def _best_rows(label: str, study: optuna.Study) -> list[str]:
    best = best_trial(study)
    if best is None:
        missing = "no trial met the category floor yet" if infeasible_trials(study) else "no trial completed yet"
        return [f"{label:<18}({missing})"]
    verdict = "" if best.value > 1 else "  (no faster than plain decoding)"
    categories = describe_categories(best.user_attrs)
    return [
        f"{label:<18}{best.value:.2f}x  (trial {best.number}){verdict}",
        *([f"{'by category':<18}{categories}"] if categories else []),
        f"{'acceptance rate':<18}{best.user_attrs['acceptance_rate']:.0%}",
        "{:<18}{}".format(*draft_figure(best.user_attrs)),
    ]


def _infeasible_rows(study: optuna.Study) -> list[str]:
    infeasible = infeasible_trials(study)
    if not infeasible:
        return []
    return [
        "",
        f"Below the category floor in {study.study_name} (never taken as the best):",
        *(f"  trial {trial.number}: {trial.value:.2f}x, {_below_floor(trial)}" for trial in infeasible),
    ]


def format_summary(outcome: TuneOutcome) -> str:
    study = outcome.study
    in_study = count_states(study.get_trials(deepcopy=False))
    estimated = study.study_name.endswith(estimated_study_name(""))
    rows = [f"Study    {study.study_name}", f"Storage  {display_url(outcome.storage_url)}", ""]
    rows += _best_rows("best estimate" if estimated else "best speedup", study)
    rows += ["", f"{'trials':<12}{'this run':>10}{'study':>10}"]
    rows.append(f"{'ran':<12}{sum(outcome.this_run.values()):>10}{sum(in_study.values()):>10}")
    for state, label in ((TrialState.COMPLETE, "complete"), (TrialState.PRUNED, "pruned"), (TrialState.FAIL, "failed")):
        rows.append(f"{label:<12}{outcome.this_run.get(state, 0):>10}{in_study[state]:>10}")
    rows += _infeasible_rows(study)
    if outcome.confirmed is not None:
        rows += ["", f"Measured by real decoding in {outcome.confirmed.study_name}:"]
        for trial in outcome.confirmed.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            estimate = trial.user_attrs.get("estimated_speedup")
            came_from = f" (estimated {estimate:.2f}x)" if estimate is not None else ""
            rows.append(f"  trial {trial.number}: {trial.value:.2f}x{came_from}")
        rows += _best_rows("best measured", outcome.confirmed)
        rows += _infeasible_rows(outcome.confirmed)
    return "\n".join(rows)
