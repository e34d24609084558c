"""A seeded study draws the same points of the search space from one release to the next: the
values below were drawn before the tuner was split into rooms, so a change to how the space is
defined, named or decoded that would move a reproduced study fails here first."""

from __future__ import annotations

import optuna

from hf_selfspec.tuning.studies.config import SearchConfig
from hf_selfspec.tuning.studies.knobs import strategy_knobs
from hf_selfspec.tuning.studies.space import skip_ratio, suggest_params, warm_start_trials

NUM_LAYERS = 4
STRATEGY = "adaptive_draft_exit"  # it searches the most knobs of the built-in strategies
WARM_STARTS = [
    ([2], [2]),
    ([1], [1]),
    ([1, 2], [1, 2]),
    ([], []),
]
# (attention skips, MLP skips, the knobs whose range is wider than one value), rounded
DRAWN = [
    ([1, 2], [1], {"max_draft_tokens": 9, "draft_exit_threshold": 0.631565, "target_acceptance": 0.539409, "threshold_step": 0.038244}),
    ([1, 2], [0, 1, 2], {"max_draft_tokens": 12, "draft_exit_threshold": 0.071776, "target_acceptance": 0.762497, "threshold_step": 0.018873}),
    ([1, 2], [0, 1, 2, 3], {"max_draft_tokens": 2, "draft_exit_threshold": 0.152218, "target_acceptance": 0.699641, "threshold_step": 0.051588}),
    ([1, 2, 3], [0, 1, 2], {"max_draft_tokens": 4, "draft_exit_threshold": 0.259182, "target_acceptance": 0.921434, "threshold_step": 0.003865}),
    ([1, 3], [0, 1, 2], {"max_draft_tokens": 1, "draft_exit_threshold": 0.576335, "target_acceptance": 0.94192, "threshold_step": 0.002295}),
    ([1, 2, 3], [0, 1], {"max_draft_tokens": 12, "draft_exit_threshold": 0.111113, "target_acceptance": 0.901267, "threshold_step": 0.001628}),
    ([1, 2, 3], [0, 1], {"max_draft_tokens": 5, "draft_exit_threshold": 0.24217, "target_acceptance": 0.735128, "threshold_step": 0.005517}),
    ([1, 2, 3], [0, 1], {"max_draft_tokens": 11, "draft_exit_threshold": 0.167409, "target_acceptance": 0.826247, "threshold_step": 0.001093}),
]  # fmt: skip


def _rounded(value):
    return round(value, 6) if isinstance(value, float) else value


def test_a_seeded_tpe_study_draws_the_recorded_values():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    search = SearchConfig(strategy=STRATEGY)
    varying = [name for name in strategy_knobs(STRATEGY) if len(set(search.range_of(name))) > 1]
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=4))
    for params in warm_start_trials(search, NUM_LAYERS):
        study.enqueue_trial(params)
    drawn = []

    def objective(trial: optuna.Trial) -> float:
        params = suggest_params(trial, search, NUM_LAYERS)
        knobs = {name: _rounded(params[name]) for name in varying}
        drawn.append((list(params["attn_skip_layers"]), list(params["mlp_skip_layers"]), knobs))
        # any fixed function of the point will do, as long as it gives TPE something to follow
        knob_sum = sum(float(params[name]) for name in varying)
        return skip_ratio(params, NUM_LAYERS) - 0.1 * len(params["mlp_skip_layers"]) + knob_sum / 100

    study.optimize(objective, n_trials=len(WARM_STARTS) + len(DRAWN))
    assert [(attn, mlp) for attn, mlp, _ in drawn[: len(WARM_STARTS)]] == WARM_STARTS
    assert drawn[len(WARM_STARTS) :] == DRAWN
