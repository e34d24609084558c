"""The types the decoding loop is written against: the committed text, a draft, a verdict, the
outcome of a verification, the exit rule, and the interface every drafter implements.

They live apart from the drafters, the policies and the verifier, so that the loop, the verifier,
every part that learns from a verification and a user's own drafter can name them without
importing what drafts here (the layer skipper, the adapter, the lookup corpus).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

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


@dataclass
class Verdict:
    tokens: list[int]  # accepted draft tokens, then the verifier's own token
    accepted: int
    scores: torch.Tensor  # [len(tokens), vocab] processed scores at each committed position
    logits: torch.Tensor  # [len(tokens), vocab] raw float32 logits at each committed position
    # The logits row of the alternative that replaced the first rejected draft token, if any:
    # its KV must move to that token's place.
    alternative_row: int | None = None


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
    """What the loop asks for a draft: `propose`, `learn` after each verification, `rollback`
    after each verification's KV is trimmed, and `continue_from` once, before the first."""

    # Which of a verification's hidden states the drafter reads (transformers' numbering: `n` is
    # the output of layer `n - 1`), handed over in `StepOutcome.hidden`; None for none.
    hidden_layer: int | None = None

    def propose(self, state: DecodingState, max_tokens: int, exit_policy: ExitPolicy, selector: TokenSelector) -> Draft:
        """Up to `max_tokens` tokens, written into `state.sequence` right after the committed text."""
        raise NotImplementedError

    def learn(self, outcome: StepOutcome) -> None:
        """After every verification, whoever proposed (prompt lookup, the model, nobody)."""

    def rollback(self, committed_kv_length: int) -> None:
        """Forget draft state past the KV the verifier kept; the shared cache needs nothing."""

    def continue_from(self, state: DecodingState, cached_length: int) -> None:
        """The shared cache arrives holding the KV of the text's first `cached_length` tokens (a
        chat's earlier turns; 0 for a new text), computed before this drafter existed."""
