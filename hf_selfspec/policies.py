"""When to stop drafting (exit policies) and whether to draft at all (gates).

Both are tiny state machines fed by the decoding loop after every verification, so a strategy
changes behaviour by choosing which ones to compose, never by copying the loop.
"""

from __future__ import annotations


class ExitPolicy:
    """A fixed exit: stop drafting once the draft's top probability falls under `threshold`."""

    def __init__(self, threshold: float):
        self.threshold = threshold

    def update(self, accepted: int, drafted: int) -> None:
        """Called after each verification of a non-empty draft."""


class AdaptiveExitPolicy(ExitPolicy):
    """The Draft & Verify rule: move the threshold so the acceptance rate tracks a target.

    A draft that is accepted less often than `target_acceptance` was too bold, so the threshold
    rises (drafts end sooner); one accepted more often than that was too timid, so it falls.
    Both the acceptance rate and the threshold are smoothed, so one unlucky verification does
    not swing the draft length. The rate starts at the target, i.e. with no opinion either way.
    """

    def __init__(
        self,
        threshold: float,
        target_acceptance: float,
        threshold_step: float,
        acceptance_ema: float,
        threshold_ema: float,
    ):
        super().__init__(threshold)
        self.target_acceptance = target_acceptance
        self.threshold_step = threshold_step
        self.acceptance_ema = acceptance_ema
        self.threshold_ema = threshold_ema
        self.acceptance_rate = target_acceptance

    def update(self, accepted: int, drafted: int) -> None:
        self.acceptance_rate = self.acceptance_ema * self.acceptance_rate + (1 - self.acceptance_ema) * (
            accepted / drafted
        )
        if self.acceptance_rate <= self.target_acceptance:
            proposal = self.threshold + self.threshold_step
        else:
            proposal = self.threshold - self.threshold_step
        self.threshold = self.threshold_ema * self.threshold + (1 - self.threshold_ema) * proposal


class Gate:
    """Always draft."""

    needs_confidence = False

    def should_draft(self) -> bool:
        return True

    def update(self, confidence: float) -> None:
        """Called with the verifier's probability of the token it just committed."""


class TargetConfidenceGate(Gate):
    """Draft only while the verifier is sure of itself.

    Where the full model hesitates, a cheaper draft is unlikely to guess its choice, and a
    rejected draft costs more than the plain step it replaces; so below the threshold the next
    step decodes plainly, and drafting resumes once the verifier's confidence returns.
    """

    needs_confidence = True

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.confident = True

    def should_draft(self) -> bool:
        return self.confident

    def update(self, confidence: float) -> None:
        self.confident = confidence >= self.threshold
