"""Draft heads (Medusa-style): small residual blocks on the model's final hidden state, each
guessing one token further ahead through the model's own LM head.

The verification that commits a token has just computed the final hidden state its LM head
chose that token from. Head `k` reads the same state and guesses the token `k + 1` places after
the committed one. A draft is every head read from that one state: no layer of the model runs
and nothing enters the cache, so a draft costs a few small products, and a rejected one costs
only its verification's extra width, which is next to nothing where a forward pass is bound by
reading the weights (a GPU, a CPU with native bfloat16).

Chained heads (`DraftChain`, in the manner of Hydra and EAGLE) read the token as well: one
block takes a state and the input embedding of the token that state chose, and gives the state
that chooses the next token; it runs once per drafted token, on its own output and the token it
drafted last. A guess further ahead then knows the guesses before it, where separate heads
must each guess all the tokens in between at once.

On disk, heads are a pair of files like an adapter's (`files.adapter_files`) whose description
says `HEADS_FORMAT`; a profile's `draft_adapter` names either kind.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

HEADS_FORMAT = "hf-selfspec-draft-heads/1"


@dataclass(frozen=True)
class HeadsShape:
    """What a heads file must agree with before its weights can be trusted on a model."""

    model_type: str
    hidden_size: int
    heads: int
    # One block run once per token (`DraftChain`), in place of a block per head (`DraftHeads`).
    chained: bool = False

    @classmethod
    def for_model(cls, model: nn.Module, heads: int, chained: bool = False) -> HeadsShape:
        return cls(model.config.model_type, model.config.hidden_size, heads, chained)

    def to_json(self) -> dict:
        return {"format": HEADS_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, raw: dict, where: str) -> HeadsShape:
        try:
            shape = cls(**{key: value for key, value in raw.items() if key != "format"})
        except TypeError as error:
            raise ValueError(f"{where}: {error}") from None
        if not isinstance(shape.model_type, str):
            raise ValueError(f"{where}: model_type must be a string, got {shape.model_type!r}")
        for name in ("hidden_size", "heads"):
            value = getattr(shape, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
        if not isinstance(shape.chained, bool):
            raise ValueError(f"{where}: chained must be true or false, got {shape.chained!r}")
        return shape

    def check_fits(self, model: nn.Module, where: str) -> None:
        expected = HeadsShape.for_model(model, self.heads)
        for name in ("model_type", "hidden_size"):
            if getattr(self, name) != getattr(expected, name):
                raise ValueError(
                    f"{where}: the draft heads were trained for {name} {getattr(self, name)!r}, "
                    f"but the model has {getattr(expected, name)!r}"
                )


class DraftHeads(nn.Module):
    """`heads` blocks `h + silu(W h + b)`, each started at zero (the identity), so an untrained
    head guesses what the LM head already says, and training moves it from there."""

    def __init__(self, shape: HeadsShape):
        super().__init__()
        self.shape = shape
        self.blocks = nn.ModuleList(nn.Linear(shape.hidden_size, shape.hidden_size) for _ in range(shape.heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., hidden]` final states to `[..., heads, hidden]`: what the LM head reads for
        each of the tokens 1, 2, ... places after the one each state chose."""
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks], dim=-2)

    def trained_state(self) -> dict[str, torch.Tensor]:
        return self.state_dict()


class DraftChain(nn.Module):
    """One block `f + W2 silu(W1 [f; e] + b1) + b2` for every token of a draft: `f` is the state
    that chose a token (the model's final state for the committed one, then the block's own
    output), `e` that token's input embedding. `W2` and `b2` start at zero, so an untrained chain
    guesses what the LM head already says, as untrained heads do; the embedding goes in as the
    model's embedding layer gives it, whatever scale that has."""

    def __init__(self, shape: HeadsShape):
        super().__init__()
        self.shape = shape
        width = 2 * shape.hidden_size
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, shape.hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def step(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """`[..., hidden]` states and the embeddings of the tokens they chose to the states that
        choose the tokens after those."""
        return state + self.down(nn.functional.silu(self.up(torch.cat([state, embedded], dim=-1))))

    def forward(self, hidden: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: `[..., hidden]` final states and `[..., heads, hidden]` the embeddings
        of the token each state chose and of the `heads - 1` tokens after it, to `[..., heads,
        hidden]`: what the LM head reads for each of the tokens 1, 2, ... places after the chosen one."""
        states = []
        for ahead in range(self.shape.heads):
            hidden = self.step(hidden, following[..., ahead, :])
            states.append(hidden)
        return torch.stack(states, dim=-2)

    def trained_state(self) -> dict[str, torch.Tensor]:
        return self.state_dict()


def heads_for(shape: HeadsShape) -> DraftHeads | DraftChain:
    """New heads of `shape`'s kind, untrained."""
    return DraftChain(shape) if shape.chained else DraftHeads(shape)
