"""The estimated objective: a trial's speedup per category of the prompts from the priced
decoding loop, instead of from timed decodes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optuna

from hf_selfspec.tuner_api import online_corpus, resolve_params

from ..studies.categories import CategorySpeedups
from ..studies.config import SearchConfig, StudySettings
from ..studies.objective import begin_trial, fresh_corpus_key
from .calibration import calibrate, calibrate_loop, verification_runs
from .drift import CostModelWatch
from .predictions import draft_predictions
from .priced_decode import estimate_decode, plain_seconds
from .prices import CostModel
from .teacher_forcing import TeacherForcedPrompt
from .timing import device_timer


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
        key = fresh_corpus_key(self.model, trial.params)
        corpus = online_corpus(self.model, key) if key is not None else None
        categories = CategorySpeedups([data.prompt.category for data in self.prompts])
        for data in self.prompts:
            predicted = draft_predictions(self.model, data, params)
            seconds, stats = estimate_decode(
                self.model, data, params, self.search.strategy, predicted, self.cost, corpus
            )
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


def estimated_objective(
    model,
    prompts: Sequence[TeacherForcedPrompt],
    search: SearchConfig,
    num_layers: int,
    max_verify_tokens: int,
    generate_kwargs: dict[str, Any],
    worker: str,
    category_floor: float | None = None,
    rounds: int = StudySettings.calibration_rounds,
) -> tuple[EstimatedSpeedupObjective, CostModelWatch]:
    """The estimated objective with its cost model timed for `prompts`, and the callback that
    re-checks that cost model during the study (to pass to `study.optimize`)."""

    def time_cost_model() -> CostModel:
        return calibrate(
            model, prompts[0], num_layers, max_verify_tokens, search.draft_adapters.values(),
            generate_kwargs=generate_kwargs, verified_after=prompts, rounds=rounds,
        )

    cost = calibrate_loop(model, time_cost_model(), prompts, generate_kwargs)
    objective = EstimatedSpeedupObjective(model, prompts, cost, search, worker, category_floor)
    probe = verification_runs(model, prompts[:1], (1, max_verify_tokens))
    return objective, CostModelWatch(objective, probe, time_cost_model, device_timer(model.device))
