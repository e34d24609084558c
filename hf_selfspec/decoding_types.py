"""The types the decoding loop is written against: the committed text, a draft, a verdict, the
outcome of a verification, the exit rule, and the interface every drafter implements.

They live apart from the drafters, the policies and the verifier, so that the loop, the verifier,
every part that learns from a verification and a user's own drafter can name them without
importing what drafts here (the layer skipper, the adapter, the lookup corpus).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from .cache import Realignment
from .selection import TokenSelector

# Who proposed a draft: the model (a skip set, an adapter, an assistant, a strategy's own
# drafter), or prompt lookup from the text itself, from a lookup corpus or from the online corpus
# of the model's earlier calls.
MODEL_SOURCE = "model"
TEXT_SOURCE = "text"
CORPUS_SOURCE = "corpus"
ONLINE_SOURCE = "online"


@dataclass
class DecodingState:
    """The committed text: `sequence[:, :length]`, of which the last token has no KV yet."""

    sequence: torch.Tensor  # [1, max_length] buffer
    positions: torch.Tensor  # [1, max_length] arange, sliced for explicit position ids
    length: int


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # One `[vocab]` distribution per token; empty for deterministic proposals (prompt lookup),
    # which speculative sampling treats as one-hot.
    distributions: list[torch.Tensor] = field(default_factory=list)
    # Per token, the draft's runner-up tokens there, verified beside the chain (`alternatives.py`);
    # empty where the drafter offers none.
    alternatives: list[list[int]] = field(default_factory=list)
    source: str = MODEL_SOURCE

    @staticmethod
    def joined(drafts: list[Draft]) -> Draft:
        """A batch's drafts as one: every row's tokens, from the model if it drafted any row's
        (what costs a draft's time), else from the source of the first row that proposed; in a
        batch of one, that row's own draft."""
        if len(drafts) == 1:
            return drafts[0]
        proposed = [draft for draft in drafts if draft.tokens]
        by_model = not proposed or any(draft.source == MODEL_SOURCE for draft in proposed)
        tokens = [token for draft in proposed for token in draft.tokens]
        return Draft(tokens=tokens, source=MODEL_SOURCE if by_model else proposed[0].source)


@dataclass
class Verdict:
    tokens: list[int]  # accepted draft tokens, then the verifier's own token
    accepted: int
    scores: torch.Tensor  # [len(tokens), vocab] processed scores at each committed position
    logits: torch.Tensor  # [len(tokens), vocab] raw float32 logits at each committed position
    # The logits row of the alternative that replaced the first rejected draft token, if any:
    # its KV must move to that token's place.
    alternative_row: int | None = None


class JoinedVerdict:
    """A batch's verdicts as one (`StepOutcome.of_batch`): the rows' tokens one after another;
    their scores and logits are joined only where read."""

    alternative_row = None

    def __init__(self, rows: list[StepOutcome]):
        self._verdicts = [row.verdict for row in rows]
        self.tokens = [token for verdict in self._verdicts for token in verdict.tokens]
        self.accepted = sum(verdict.accepted for verdict in self._verdicts)

    @cached_property
    def scores(self) -> torch.Tensor:
        return torch.cat([verdict.scores for verdict in self._verdicts])

    @cached_property
    def logits(self) -> torch.Tensor:
        return torch.cat([verdict.logits for verdict in self._verdicts])


@dataclass(frozen=True)
class StepOutcome:
    """What one verification did, built once by the loop and handed to every part that learns
    (`learn`), each reading what concerns it: one record, so that a new part needs no new hook."""

    draft: Draft  # what was verified: empty for a plain step
    verdict: Verdict
    committed: int  # tokens the step committed: fewer than the verdict's where a stop fell inside
    # What drafting and verifying took; None for the prompt's prefill, whose forward pass says
    # nothing of a step's cost.
    seconds: float | None
    # The hidden states `Drafter.hidden_layer` names, of every input of the verification.
    hidden: torch.Tensor | None = None
    # `(source_row, target_row)` where the verifier accepted an alternative: what the
    # verification computed at row `source_row` (rows from its first input) now stands at
    # `target_row`, as the shared cache's entries do.
    moved_row: tuple[int, int] | None = None
    # A batch's step (`of_batch`): each row's own outcome, in the order of the batch's rows.
    rows: tuple[StepOutcome, ...] = ()
    # The verification's input row of the newest token committed before it, whose logits judged
    # the first drafted token (`hidden` and `moved_row` count rows from the first input).
    first_row: int = 0

    @property
    def newest_row(self) -> int:
        """The input row whose logits chose the newest committed token: the last accepted draft
        token's, or the accepted alternative's."""
        offset = self.verdict.accepted if self.verdict.alternative_row is None else self.verdict.alternative_row
        return self.first_row + offset

    @classmethod
    def of_batch(cls, rows: list[StepOutcome], hidden: torch.Tensor | None) -> StepOutcome:
        """A step of a batch as the parts that serve every row hear it (the drafter, the
        back-off): the rows' drafts and verdicts joined, the tokens committed in all, and the
        hidden states of every row; in a batch of one, that row's own outcome."""
        if len(rows) == 1:
            return rows[0]
        draft = Draft.joined([row.draft for row in rows])
        committed = sum(row.committed for row in rows)
        return cls(draft, JoinedVerdict(rows), committed, rows[0].seconds, hidden, rows=tuple(rows))

    def proposed_by(self, source: str) -> bool:
        """Whether `source` proposed the verified draft (a plain step has no proposer)."""
        return bool(self.draft.tokens) and self.draft.source == source

    def as_seen_by(self, source: str) -> StepOutcome:
        """The outcome as a part that governs `source` alone sees it: a step that another source
        proposed is, to it, a step without its proposal."""
        return self if self.draft.source == source else replace(self, draft=Draft())


class ExitPolicy:
    """A fixed exit: stop drafting once the draft's top probability falls under `threshold`.

    The exit rule (`exits_after`) is in this one place for every draft, real or predicted (the
    tuner's estimate), so that the two cannot come to stop at different tokens."""

    def __init__(self, threshold: float):
        self.threshold = threshold

    def exits_after(self, confidence: float) -> bool:
        """Whether drafting stops after a token the draft gave top probability `confidence`. That
        token is kept: its forward pass is already paid for, and keeping it guarantees every
        drafting round gives an adaptive policy feedback to learn from."""
        return confidence < self.threshold

    def learn(self, outcome: StepOutcome) -> None:
        """Called after every verification."""


class Drafter:
    """What the loop asks for a draft: `propose` (`propose_rows` for a batch), `learn` after each
    verification, `realign` after each verification's KV is trimmed (`rollback` in a batch of
    one), and `continue_from` once, before the first."""

    # Which of a verification's hidden states the drafter reads (transformers' numbering: `n` is
    # the output of layer `n - 1`), handed over in `StepOutcome.hidden`; None for none.
    hidden_layer: int | None = None

    def propose(self, state: DecodingState, max_tokens: int, exit_policy: ExitPolicy, selector: TokenSelector) -> Draft:
        """Up to `max_tokens` tokens, written into `state.sequence` right after the committed text."""
        raise NotImplementedError

    def propose_rows(
        self,
        states: list[DecodingState],
        limits: list[int],
        exit_policies: list[ExitPolicy],
        selectors: list[TokenSelector],
    ) -> list[Draft]:
        """A draft for each row of a batch, of up to its `limits` tokens (none where that is 0),
        with the row's own exit policy and selector. This default drafts each row alone through
        `propose`, which is right for a drafter that keeps nothing in the shared cache; one that
        drafts with the model drafts every row in each forward pass."""
        return [
            self.propose(state, limit, exit_policy, selector) if limit > 0 else Draft()
            for state, limit, exit_policy, selector in zip(states, limits, exit_policies, selectors)
        ]

    def guesses(self, state: DecodingState, count: int) -> list[int]:
        """The draft's `count` likeliest first tokens after the committed text, where it can name
        them without running a layer (draft heads), for verifying beside another source's
        proposal; none where it cannot (this default)."""
        return []

    def learn(self, outcome: StepOutcome) -> None:
        """After every verification, whoever proposed (prompt lookup, the model, nobody); in a
        batch, the step's outcome joins its rows' (`StepOutcome.of_batch`)."""

    def rollback(self, committed_kv_length: int) -> None:
        """Forget draft state past the KV the verifier kept; the shared cache needs nothing."""

    def realign(self, realignment: Realignment) -> None:
        """After every verification: the shared cache was cut to `realignment.kv_length` and, in
        a batch, its rows moved as `realignment` says. A drafter with KV of its own moves it
        alike; this default only rolls back, all a drafter without it needs."""
        self.rollback(realignment.kv_length)

    def continue_from(self, state: DecodingState, cached_length: int) -> None:
        """The shared cache arrives holding the KV of the text's first `cached_length` tokens (a
        chat's earlier turns; 0 for a new text), computed before this drafter existed."""
