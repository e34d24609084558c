"""Choosing a token from logits exactly as plain `generate` would.

Draft and verifier both go through here, so the logits processors (penalties, warpers,
min-length...) see the same prefix at every position that plain decoding would give them.
"""

from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor


class TokenSelector:
    def __init__(self, logits_processor: LogitsProcessorList, do_sample: bool):
        self.logits_processor = logits_processor
        self.do_sample = do_sample

    def for_row(self, row: int) -> TokenSelector:
        """The selector of row `row` of a batch, which scores that row alone: a processor holding
        a value per row (the repetition penalty's prompt padding, which it ignores) holds that
        row's."""
        processors = [_for_row(processor, row) for processor in self.logits_processor]
        if all(mine is theirs for mine, theirs in zip(processors, self.logits_processor)):
            return self
        return TokenSelector(LogitsProcessorList(processors), self.do_sample)

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


def _for_row(processor, row: int):
    ignored = getattr(processor, "prompt_ignore_length", None)
    if not isinstance(processor, RepetitionPenaltyLogitsProcessor) or not isinstance(ignored, torch.Tensor):
        return processor
    own = copy.copy(processor)
    own.prompt_ignore_length = int(ignored[row])
    return own
