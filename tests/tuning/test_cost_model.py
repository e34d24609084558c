"""The estimate's cost model under a changing load: timed in rounds, and re-timed when it drifts.

No real clock: a timer that prices each run by its name, and a load the test switches on and off.
"""

from __future__ import annotations

import statistics
import types

import optuna
import pytest

from hf_selfspec.tuning.costmodel.drift import CostModelWatch, rescaled_overheads
from hf_selfspec.tuning.costmodel.prices import (
    CostModel,
    nondecreasing,
    verification_knots,
    verification_prices,
)
from hf_selfspec.tuning.costmodel.timing import interleaved_medians, typical_seconds

BASE = {"plain step": 1.0, "wide verification": 3.0, "draft": 0.5}
ROUNDS = 5


class LoadedTimer:
    """Prices a run (which returns its own name) at its base cost, times `factor` during calls
    `spike` (counted from 0), as a neighbour's burst of work would slow it."""

    def __init__(self, prices: dict, spike: range = range(0), factor: float = 4.0):
        self.prices, self.spike, self.factor, self.calls = prices, spike, factor, 0

    def __call__(self, run) -> float:
        seconds = self.prices[run()] * (self.factor if self.calls in self.spike else 1.0)
        self.calls += 1
        return seconds


def _named_runs(names):
    return {name: (lambda name=name: name) for name in names}


def test_a_load_spike_during_calibration_leaves_the_interleaved_medians_unbent():
    spike = range(ROUNDS)  # as long as one item's timings when timed one item after another
    interleaved = interleaved_medians(_named_runs(BASE), ROUNDS, LoadedTimer(BASE, spike))
    assert interleaved == BASE

    # The same spike against the old order, each item timed in full before the next: the first
    # item carries all of it, and the ratios the estimate reads come out bent.
    timer = LoadedTimer(BASE, spike)
    runs = _named_runs(BASE)
    sequential = {name: sorted(timer(run) for _ in range(ROUNDS))[ROUNDS // 2] for name, run in runs.items()}
    assert sequential["plain step"] == 4 * BASE["plain step"]
    assert sequential["wide verification"] / sequential["plain step"] != BASE["wide verification"] / BASE["plain step"]


def _cost(plain: float, wide: float, overhead: float = 0.1) -> CostModel:
    """A cost model whose 1-token verification costs `plain` and 8-token one `wide`."""
    return CostModel(
        num_layers=4,
        verify_seconds=(0.0, plain, *(wide,) * 7),
        plain_step_overhead=overhead,
        draft_constant=0.1,
        attention_seconds=0.01,
        mlp_seconds=0.02,
        restricted_head_constant=0.0,
        restricted_head_per_row=0.0,
        loop_step_overhead=2 * overhead,
    )


def _study_with_watch(prices_by_trial, every=10, n_trials=30, tolerance=0.15, probed_at_start=(1.0, 3.0)):
    """Runs `n_trials` trivial trials under a watch probing the 1- and 8-token verifications,
    priced at `probed_at_start` when the watch starts (just after the model, priced (1, 3), was
    timed) and at `prices_by_trial(number)` while trial `number` is the latest; returns the
    study, the objective the watch keeps and the cost models it timed again."""
    prices = dict(zip((1, 8), probed_at_start))
    objective = types.SimpleNamespace(cost=_cost(1.0, 3.0))
    retimed = []

    def retime():
        retimed.append(_cost(prices[1], prices[8]))
        return retimed[-1]

    watch = CostModelWatch(
        objective, _named_runs((1, 8)), retime, LoadedTimer(prices), every=every, tolerance=tolerance
    )

    def trial_value(trial):
        prices.update(prices_by_trial(trial.number))
        return 0.0

    study = optuna.create_study()
    study.optimize(trial_value, n_trials=n_trials, callbacks=[watch])
    return study, objective, retimed


def test_a_steady_ratio_is_not_timed_again_even_when_everything_slows_alike():
    study, objective, retimed = _study_with_watch(lambda n: {1: 1.0, 8: 3.0} if n < 15 else {1: 2.0, 8: 6.0})
    assert retimed == []
    assert objective.cost == _cost(1.0, 3.0)
    assert "cost_model_retimes" not in study.user_attrs


def test_a_probe_that_reads_steadily_apart_from_the_model_is_not_timed_again():
    # The probe times one prompt's verification, the model all prompts': on an idle machine the
    # two ratios differ by a constant, which is no drift (the model prices 3.0, the probe reads 3.6).
    _, objective, retimed = _study_with_watch(lambda n: {1: 1.0, 8: 3.6}, probed_at_start=(1.0, 3.6))
    assert retimed == []
    assert objective.cost == _cost(1.0, 3.0)


def test_a_drift_within_the_tolerance_is_not_timed_again():
    _, objective, retimed = _study_with_watch(lambda n: {1: 1.0, 8: 3.0 * 1.1})
    assert retimed == []
    assert objective.cost == _cost(1.0, 3.0)


def test_a_ratio_that_drifts_past_the_tolerance_times_the_model_again_once_and_records_it():
    # From trial 12 the wide verification costs 4 plain steps instead of 3: the probes after
    # trials 19 and 29 both see it; the model timed then prices it so, and the probes after
    # trials 39 and 49 agree with it.
    study, objective, retimed = _study_with_watch(
        lambda n: {1: 1.0, 8: 3.0} if n < 12 else {1: 1.0, 8: 4.0}, n_trials=50
    )
    assert retimed == [_cost(1.0, 4.0)]
    assert objective.cost.verify_seconds == retimed[0].verify_seconds
    [record] = study.user_attrs["cost_model_retimes"]
    assert record["after_trial"] == 29
    assert record["probe_ratio"] == record["previous_probe_ratio"] == 4.0 and record["reference_ratio"] == 3.0


def _wide_at(prices: dict[int, float]):
    """Prices for `_study_with_watch`: the wide verification at `prices[n]` while trial n is the
    latest, 3 plain steps otherwise; the probe after trial n reads it."""
    return lambda n: {1: 1.0, 8: prices.get(n, 3.0)}


def test_one_probe_slowed_by_a_passing_episode_of_load_times_nothing_again():
    study, objective, retimed = _study_with_watch(_wide_at({9: 4.0}), n_trials=20)
    assert retimed == []
    assert objective.cost == _cost(1.0, 3.0)
    assert "cost_model_retimes" not in study.user_attrs


def test_two_probes_running_past_the_tolerance_on_either_side_time_nothing_again():
    _, _, retimed = _study_with_watch(_wide_at({9: 4.0, 19: 2.0}), n_trials=20)  # a swinging load, not a new price
    assert retimed == []


def test_probes_past_the_tolerance_with_one_within_it_between_time_nothing_again():
    _, _, retimed = _study_with_watch(_wide_at({9: 4.0, 29: 4.0}), n_trials=30)
    assert retimed == []


def test_two_probes_running_past_the_tolerance_the_same_way_time_the_model_again():
    study, _, retimed = _study_with_watch(_wide_at({9: 4.0, 19: 3.6}), n_trials=20)
    assert retimed == [_cost(1.0, 3.6)]
    [record] = study.user_attrs["cost_model_retimes"]
    assert record["after_trial"] == 19
    assert (record["previous_probe_ratio"], record["probe_ratio"], record["reference_ratio"]) == (4.0, 3.6, 3.0)


def test_the_probe_runs_only_every_so_many_trials():
    _, _, retimed = _study_with_watch(lambda n: {1: 1.0, 8: 4.0}, every=10, n_trials=19)
    assert retimed == []
    _, _, retimed = _study_with_watch(lambda n: {1: 1.0, 8: 4.0}, every=10, n_trials=20)
    assert len(retimed) == 1


def test_a_retimed_model_keeps_the_loops_overhead_in_proportion_to_the_plain_step():
    old, new = _cost(1.0, 3.0, overhead=0.1), _cost(2.0, 8.0, overhead=0.05)
    rescaled = rescaled_overheads(old, new)
    assert rescaled.verify_seconds == new.verify_seconds
    assert rescaled.plain_step_overhead == 0.05  # timed again, in the re-time's own rounds
    assert rescaled.loop_step_overhead == 0.4


def test_the_verifier_is_timed_densely_where_its_cost_bends_and_at_its_widest():
    assert verification_knots(33) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33)
    assert verification_knots(4) == (1, 2, 3, 4)
    assert verification_knots(1) == (1,)


def test_a_noisy_timing_never_prices_a_wider_verification_below_a_narrower_one():
    """A burst that fell on a narrow width's timings, or spared a wide one's, must not make a
    longer proposal look cheaper than a shorter one: prices are pooled until they never fall,
    and widths between two timed ones lie on the line between them."""
    typical = {1: 1.0, 2: 1.4, 4: 1.2, 8: 2.0, 16: 1.8}
    prices = verification_prices(typical, 16)
    assert len(prices) == 17 and prices[0] == 0.0
    assert all(narrower <= wider for narrower, wider in zip(prices[1:], prices[2:]))
    assert prices[1] == 1.0
    assert prices[2] == prices[3] == prices[4] == pytest.approx(1.3)  # 1.4 and 1.2 pooled
    assert prices[8] == prices[16] == pytest.approx(1.9)
    assert prices[6] == pytest.approx((1.3 + 1.9) / 2)
    assert prices[12] == pytest.approx(1.9)


def test_prices_that_already_rise_are_kept_and_joined_by_lines():
    prices = verification_prices({1: 1.0, 2: 1.1, 4: 1.5}, 4)
    assert prices == pytest.approx((0.0, 1.0, 1.1, 1.3, 1.5))
    assert nondecreasing([3.0, 1.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])


def test_a_pass_that_lands_now_on_free_cores_and_now_behind_a_neighbour_is_priced_at_their_mix():
    """With a neighbour keeping a core busy, a forward pass takes one of two times far apart.
    Where the slow one is a little more frequent, the median is the slow time, though a decode
    repeating the pass pays their mix: the price is the mean of the middle, near that mix."""
    timings = [3.0 if call % 2 == 0 else 1.0 for call in range(21)]  # 11 slow, 10 fast
    assert statistics.median(timings) == 3.0
    assert typical_seconds(timings) == pytest.approx(statistics.fmean(timings), rel=0.05)
    fewer_slow = [3.0 if call % 2 else 1.0 for call in range(21)]  # 10 slow, 11 fast
    assert statistics.median(fewer_slow) == 1.0
    assert typical_seconds(fewer_slow) == pytest.approx(statistics.fmean(fewer_slow), rel=0.05)


def test_a_burst_of_load_on_one_round_in_seven_leaves_the_typical_time_unbent():
    assert typical_seconds([1.0] * 6 + [10.0]) == 1.0
    assert typical_seconds([1.0] * 18 + [10.0] * 3) == 1.0  # three timings a round, the burst on one round
    assert typical_seconds([2.0]) == 2.0 and typical_seconds([1.0, 3.0]) == 2.0
