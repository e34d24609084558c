"""Draft heads (Medusa-style): small residual blocks on the model's final hidden state, each
guessing one token further ahead through the model's own LM head.

The verification that commits a token has just computed the final hidden state its LM head
chose that token from. Head `k` reads the same state and guesses the token `k + 1` places after
the committed one. A draft is every head read from that one state: no layer of the model runs
and nothing enters the cache, so a draft costs a few small products, and a rejected one costs
only its verification's extra width, which is next to nothing where a forward pass is bound by
reading the weights (a GPU, a CPU with native bfloat16).

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

    @classmethod
    def for_model(cls, model: nn.Module, heads: int) -> HeadsShape:
        return cls(model.config.model_type, model.config.hidden_size, heads)

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
