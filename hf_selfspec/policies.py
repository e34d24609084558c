"""When to stop drafting (exit policies), whether the model drafts (gates), whether to
speculate at all (back-offs), how long a lookup proposal is (lookup lengths), and whether a
lookup proposal or the model's draft is verified (draft source choices).

All are tiny state machines, each learning from every verification's outcome through one
method (`learn`), so a strategy changes behaviour by choosing which ones to compose, never by
copying the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .decoding_types import MODEL_SOURCE, ExitPolicy, StepOutcome


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

    def learn(self, outcome: StepOutcome) -> None:
        if not outcome.draft.tokens:
            return
        accepted, drafted = outcome.verdict.accepted, len(outcome.draft.tokens)
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

    def should_draft(self) -> bool:
        return True

    def learn(self, outcome: StepOutcome) -> None:
        """Called after every verification."""


class TargetConfidenceGate(Gate):
    """Draft only while the verifier is sure of itself.

    Where the full model hesitates, a cheaper draft is unlikely to guess its choice, and a
    rejected draft costs more than the plain step it replaces; so below the threshold the next
    step decodes plainly, and drafting resumes once the verifier's confidence returns.
    """

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.confident = True

    def should_draft(self) -> bool:
        return self.confident

    def learn(self, outcome: StepOutcome) -> None:
        """Reads the verifier's probability of the newest token it committed."""
        verdict = outcome.verdict
        confidence = float(torch.softmax(verdict.scores[-1], dim=-1)[verdict.tokens[-1]])
        self.confident = confidence >= self.threshold


class Backoff:
    """Never back off: speculate at every step the room allows."""

    # Whether a verbatim repeat of the text (`PromptLookup.verbatim`) is verified even at a step
    # where this back-off says not to speculate; a back-off that refuses keeps decoding plain
    # unless it says so.
    verifies_verbatim = False

    def should_speculate(self) -> bool:
        return True

    def learn(self, outcome: StepOutcome) -> None:
        """Called after every verification; the prefill's (`seconds` None) tells nothing of a
        step's cost."""


@dataclass
class Throughput:
    """Smoothed seconds and tokens per step of one mode; their ratio is its cost per token.

    Smoothing seconds and tokens apart, rather than their ratio, weighs a step that commits
    twelve tokens twelve times as much as one that commits one, as throughput should. Until
    there are enough steps for the smoothing's memory, the estimate is their plain mean: an
    average that started from the first step alone would let that one step outweigh the next
    few together."""

    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0
    steps_since_run: int = 0

    @property
    def measured(self) -> bool:
        return self.tokens > 0

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens

    def add(self, committed: int, seconds: float, smoothing: float) -> None:
        keep = min(smoothing, self.steps / (self.steps + 1))
        self.seconds = keep * self.seconds + (1 - keep) * seconds
        self.tokens = keep * self.tokens + (1 - keep) * committed
        self.steps += 1
        self.steps_since_run = 0


class _CheaperOfTwo:
    """Which of two ways of taking a step commits tokens more cheaply, measured as it goes.

    The favoured way runs its first `first_favoured_steps` steps, then the other once, and from
    then on whichever costs fewer seconds per committed token runs, the loser probed now and
    then; `ThroughputBackoff` says why each rule is as it is.
    """

    _MAX_PROBE_INTERVAL = 64
    _SMOOTHING = 0.8
    _PROBE_BUDGET = 0.02  # the share of the winner's throughput that probing may cost

    def __init__(self, probe_interval: int, first_favoured_steps: int):
        self.base_interval = self.interval = probe_interval
        self.first_favoured_steps = first_favoured_steps
        self.favoured, self.other = Throughput(), Throughput()

    def _compared(self) -> bool:
        return self.favoured.measured and self.other.measured

    def _favoured_wins(self) -> bool:
        return self.favoured.seconds_per_token <= self.other.seconds_per_token

    def favoured_runs(self) -> bool:
        """Whether the next step should take the favoured way; changes nothing."""
        if self.favoured.steps < self.first_favoured_steps:  # measure before choosing
            return True
        if not self.other.measured:
            return False
        wins = self._favoured_wins()
        loser, winner = (self.other, self.favoured) if wins else (self.favoured, self.other)
        wait = self.interval
        if winner.seconds > 0:  # a winner priced at nothing (an estimate can be) leaves the loser hopeless
            margin = loser.seconds_per_token / winner.seconds_per_token - 1
            wait = min(wait, max(1, math.ceil(margin / self._PROBE_BUDGET)))
        return wins != (loser.steps_since_run >= wait)

    def measure(self, favoured_ran: bool, committed: int, seconds: float) -> None:
        ran, idle = (self.favoured, self.other) if favoured_ran else (self.other, self.favoured)
        compared = self._compared()
        wins_before = compared and self._favoured_wins()
        ran.add(committed, seconds, self._SMOOTHING)
        idle.steps_since_run += 1
        if not compared:
            return
        if self._favoured_wins() != wins_before:
            self.interval = self.base_interval
        elif favoured_ran != wins_before:  # a probe confirmed the loser
            self.interval = min(2 * self.interval, self._MAX_PROBE_INTERVAL)


class ThroughputBackoff(Backoff):
    """Decode plainly while speculating commits tokens more slowly than plain steps do.

    Whether a draft pays depends on the text (chat repeats itself far less than code) and on the
    machine: on a CPU, verifying even two tokens costs nearly two plain steps, so a draft that is
    mostly rejected loses, while on a GPU the same draft may still win. Comparing the two modes'
    measured seconds per committed token needs no machine-specific threshold. The losing mode is
    probed every `probe_interval` steps, since text changes character; each probe that confirms
    the loser doubles the wait (up to `_MAX_PROBE_INTERVAL`), so a hopeless draft costs little.

    A loser that is close is probed sooner: a probe costs the margin by which the loser is slower,
    so waiting `margin / _PROBE_BUDGET` steps keeps the probes' cost near that budget. This is what
    keeps free proposals paying in bfloat16, where a rejected verification costs little more than
    a plain step: a streak of rejections makes speculating lose by a few percent, and a wait of 16
    to 64 steps then missed most of the repetitive stretches that follow, while probing every few
    steps finds them at once.
    For the same reason the smoothing keeps about five steps of memory rather than two: free
    proposals pay in rare long accepted runs between many short rejections, and a two-step
    memory forgot the runs and backed off, verifying far fewer of the proposals that pay. On
    chat prompts the back-off still backs a layer-skip draft off early: its first measured
    steps already lose by half.

    Speculation is measured over its first `first_speculative_steps` steps (eight unless told;
    averaged as `Throughput` says) before the two modes are first compared. One step says
    little: a draft accepted at 40% per token has its first token rejected more often than not,
    and judged by that step alone a draft that pays was backed off at the start of most texts,
    to be probed back only slowly (docs/results/ has the comparison). A draft that loses at
    every step pays for those steps once.
    Where speculation loses, a verbatim repeat of the text (`VERBATIM_REACH` tokens or more) is
    still verified: the average says proposals are rejected, but a repeat's acceptance shows
    before verifying it (a reply quoting the question, a list going on as it began), and a
    wait for the next probe missed it.
    In a batch it weighs the batch's steps (`StepOutcome.of_batch`): the tokens every row
    committed against the step's seconds, where a step without proposals is a step of plain
    batched decoding, so speculation goes on only while it commits the batch's tokens faster
    than plain batched decoding does.
    Lossless either way: it only decides whether to propose.
    """

    verifies_verbatim = True
    _FIRST_SPECULATIVE_STEPS = 8

    def __init__(self, probe_interval: int, first_speculative_steps: int = _FIRST_SPECULATIVE_STEPS):
        self.modes = _CheaperOfTwo(probe_interval, first_speculative_steps)

    def should_speculate(self) -> bool:
        return self.modes.favoured_runs()

    def learn(self, outcome: StepOutcome) -> None:
        if outcome.seconds is not None:
            self.modes.measure(bool(outcome.draft.tokens), outcome.committed, outcome.seconds)


class LookupLength:
    """A fixed lookup length: every lookup proposes up to `tokens` tokens."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    @property
    def max_proposal_tokens(self) -> int:
        """The most tokens one proposal can take."""
        return self.tokens

    def tokens_for(self, reach: int) -> int:
        """How many tokens to propose from a match whose reach is `reach`: that many of the
        text's last tokens equal those before the matched continuation."""
        return self.tokens

    def learn(self, outcome: StepOutcome) -> None:
        """Called after each verification of a proposal of this length's source only."""


# A lookup match whose text agrees with the end of the text for this many tokens or more (its
# reach) is a verbatim repeat, not a chance match: a translation looping on itself, a quoted line.
VERBATIM_REACH = 4


class AdaptiveLookupLength(LookupLength):
    """The lookup length follows how far the text has been copying in this request.

    A proposal taken whole doubles the length, up to `max_tokens`; one cut short halves the
    distance to what was accepted, never below `min_tokens` (nor below the starting length, if
    that is shorter). Copying runs long and ends abruptly:
    a translation or a quoted passage goes on for dozens of tokens, so the length must reach
    a long proposal within a few steps, where transformers' schedule (+2 per whole acceptance)
    spends most of a copied stretch getting there. A cut is often one changed word inside a
    copied stretch that resumes right after, so a single cut only halves the way down rather
    than dropping to the accepted count; on free text, where cuts come at the first token, a
    few of them bring the length down to the floor. One token is the smallest floor: its
    verification costs barely more than a plain step, and it keeps the lookup watching for the
    next copied stretch. Where a verification of a few tokens costs about what one token's does
    (bfloat16 on a CPU with native bfloat16 matrix units), a higher floor is nearly free and
    catches the start of a copied stretch at once, where climbing back from one token took three
    or four verifications each time; the tuner weighs the two on the machine's own costs.
    The length only decides how much of the match is proposed, so decoding stays lossless.

    A match that reaches `VERBATIM_REACH` or more tokens back is evidence enough on its own: the
    text is repeating a stretch it wrote or read verbatim, so the length jumps to the reach
    rather than climbing there from one token by doubling, which cost a copied stretch three or
    four verifications each time it resumed.
    A short match (one or two tokens, which free text matches by chance) leaves it as it is.
    """

    def __init__(self, tokens: int, max_tokens: int, min_tokens: int = 1):
        super().__init__(tokens)
        self.max_tokens = max_tokens
        self.min_tokens = max(1, min(min_tokens, tokens))

    @property
    def max_proposal_tokens(self) -> int:
        return self.max_tokens

    def tokens_for(self, reach: int) -> int:
        if reach >= VERBATIM_REACH:
            self.tokens = max(self.tokens, min(reach, self.max_tokens))
        return self.tokens

    def learn(self, outcome: StepOutcome) -> None:
        proposed, accepted = len(outcome.draft.tokens), outcome.verdict.accepted
        if accepted >= proposed:
            self.tokens = min(2 * self.tokens, self.max_tokens)
        else:
            self.tokens = max(self.min_tokens, (self.tokens + accepted) // 2)


class DraftSourceChoice:
    """Lookup first: wherever prompt lookup has a proposal, it is verified, not the model's draft."""

    def lookup_first(self) -> bool:
        """Asked only where lookup has a proposal and the model may draft; changes nothing."""
        return True

    def learn(self, outcome: StepOutcome) -> None:
        """Called after every verification."""


class CheaperDraftSource(DraftSourceChoice):
    """Verify whichever source has committed tokens more cheaply so far in this request.

    A lookup proposal costs no forward pass, so lookup goes first until both sources are
    measured, as it always did. But on free text a lookup matches by chance and is cut at once,
    while the model's own draft, which costs a few shallow passes, keeps being accepted; and on
    copied text the reverse holds. Seconds per committed token weigh a source's acceptance
    against what its drafting costs on this machine, with no threshold to tune per machine. The
    losing source is probed as `ThroughputBackoff` probes plain decoding, since the text changes
    character within a request. Lossless either way: it only decides which proposal is verified.
    """

    _FIRST_LOOKUP_STEPS = 8

    def __init__(self, probe_interval: int):
        self.sources = _CheaperOfTwo(probe_interval, self._FIRST_LOOKUP_STEPS)  # lookup is the favoured one

    def lookup_first(self) -> bool:
        return self.sources.favoured_runs()

    def learn(self, outcome: StepOutcome) -> None:
        """Measures every verified proposal but the prefill's, whichever way it was chosen."""
        if outcome.draft.tokens and outcome.seconds is not None:
            self.sources.measure(outcome.draft.source != MODEL_SOURCE, outcome.committed, outcome.seconds)
