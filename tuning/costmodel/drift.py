"""Keeping the cost model true to the machine during a study, as neighbours' load comes and goes."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import optuna

from .prices import CostModel, record_cost_model
from .timing import Timer, interleaved_medians

logger = logging.getLogger(__name__)

# The re-check during a study: every this many trials, the plain step and the widest verification
# are timed again side by side, and the whole cost model is timed again when their ratio has moved
# by more than the tolerance from the model's (the neighbours' load changed, and with it prices).
_PROBE_EVERY = 10
_PROBE_ROUNDS = 5
_DRIFT_TOLERANCE = 0.15


class PricedObjective(Protocol):
    """What the watch keeps priced: an objective that reads its cost model on every trial."""

    cost: CostModel


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
        objective: PricedObjective,
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
