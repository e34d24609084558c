"""The types the decoding loop is written against: the committed text, a draft, a verdict, and
the interface every drafter implements.

They live apart from the drafters and the verifier, so that the loop, the verifier and a user's
own drafter can name them without importing what drafts here (the layer skipper, the adapter,
the lookup corpus).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .policies import ExitPolicy
from .selection import TokenSelector

# Who proposed a draft: the model (a skip set, an adapter, an assistant) or prompt lookup.
MODEL_SOURCE = "model"
LOOKUP_SOURCE = "lookup"


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


class Drafter:
    def propose(self, state: DecodingState, max_tokens: int, exit_policy: ExitPolicy, selector: TokenSelector) -> Draft:
        raise NotImplementedError

    def propose_free(self, state: DecodingState, max_tokens: int) -> Draft:
        """Proposals that need no forward pass, offered even when the gate keeps the model from
        drafting; none by default."""
        return Draft()

    def propose_verbatim(self, state: DecodingState, max_tokens: int) -> Draft:
        """A proposal that repeats text verbatim, offered even while the back-off holds
        speculation off: none by default."""
        return Draft()

    def continue_from(self, state: DecodingState, cached_length: int) -> None:
        """The shared cache arrives holding the KV of the text's first `cached_length` tokens (a
        chat's earlier turns; 0 for a new text), computed before this drafter existed."""

    def rollback(self, committed_kv_length: int) -> None:
        """Forget draft state past the KV the verifier kept; the shared cache needs nothing."""

    def record(self, draft: Draft, accepted: int, committed: int, seconds: float | None) -> None:
        """After each verification: the `draft` (empty for a plain step), how many of its tokens
        the verifier accepted, how many tokens the step committed, and what drafting and
        verifying took (None for the prompt's prefill, whose forward pass says nothing of a
        step's cost)."""

    def keep_alternative(self, source_row: int, target_row: int) -> None:
        """The verifier accepted an alternative: what the last verification computed at its row
        `source_row` now stands at `target_row` (rows from the verification's first input), as
        the shared cache's entries do. Only drafters that offer alternatives receive this."""

    def verification_hidden_state(self) -> int | None:
        """Which of a verification's hidden states the drafter reads (transformers' numbering:
        `n` is the output of layer `n - 1`), handed to `verified`; None for none."""
        return None

    def verified(self, hidden_states: torch.Tensor) -> None:
        """The hidden states `verification_hidden_state` names, of every input of a verification."""
