"""Sampling settings for a bench run: one set for every contender, the baseline included, and one
seed per repeat.

Each timed call starts from the repeat's seed, so every contender on a prompt draws from the same
random stream: a contender that decodes exactly as plain sampling does returns plain's tokens, and
differences between contenders come from their decoding, not from luck of the draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Sampling:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampling temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be above 0 and at most 1, got {self.top_p}")
        if self.seed < 0:
            raise ValueError(f"sampling seed must be at least 0, got {self.seed}")

    def generate_kwargs(self) -> dict[str, Any]:
        """What every contender's `generate` call gets on top of its own arguments."""
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}

    def seed_for(self, repeat: int) -> int:
        return self.seed + repeat

    def reseed(self, repeat: int) -> None:
        """Reset torch's generators (every device's) to the repeat's seed, right before a call."""
        torch.manual_seed(self.seed_for(repeat))

    def to_json(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
