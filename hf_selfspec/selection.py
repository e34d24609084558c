"""Choosing a token from logits exactly as plain `generate` would.

Draft and verifier both go through here, so the logits processors (penalties, warpers,
min-length...) see the same prefix at every position that plain decoding would give them.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList


class TokenSelector:
    def __init__(self, logits_processor: LogitsProcessorList, do_sample: bool):
        self.logits_processor = logits_processor
        self.do_sample = do_sample

    @property
    def has_processors(self) -> bool:
        return len(self.logits_processor) > 0

    def scores(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Processed float32 scores `[1, vocab]` for the position after `prefix` `[1, n]`."""
        logits = logits.float()
        return self.logits_processor(prefix, logits) if self.has_processors else logits

    def pick(self, scores: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The chosen token and the distribution it was chosen from (`[vocab]` probabilities)."""
        probabilities = torch.softmax(scores[0], dim=-1)
        if self.do_sample:
            return int(torch.multinomial(probabilities, 1)), probabilities
        return int(torch.argmax(scores[0])), probabilities
