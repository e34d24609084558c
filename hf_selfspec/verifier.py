"""Who decides: the full model's logits at every drafted position, turned into committed tokens.

Greedy keeps the longest prefix of the draft that matches the verifier's own choices.
Sampling uses speculative sampling (accept with min(1, p/q), resample a rejection from
norm(max(0, p - q))), which leaves the output distributed exactly as plain sampling.
Either way the verifier adds one token of its own, so every verification makes progress.
Greedy also checks the draft's alternatives (`alternatives.py`) where the chain was rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .alternatives import alternative_rows
from .drafters import DecodingState, Draft
from .selection import TokenSelector


@dataclass
class Verdict:
    tokens: list[int]  # accepted draft tokens, then the verifier's own token
    accepted: int
    scores: torch.Tensor  # [len(tokens), vocab] processed scores at each committed position
    logits: torch.Tensor  # [len(tokens), vocab] raw float32 logits at each committed position
    # The logits row of the alternative that replaced the first rejected draft token, if any:
    # its KV must move to that token's place.
    alternative_row: int | None = None


def _resample_rejected(p: torch.Tensor, q: torch.Tensor) -> int:
    residual = torch.clamp(p - q, min=0)
    total = residual.sum()
    return int(torch.multinomial(residual / total if total > 0 else p, 1))


def verify(selector: TokenSelector, state: DecodingState, draft: Draft, logits: torch.Tensor) -> Verdict:
    """`logits` `[len(draft) + 1 + alternatives, vocab]`: the full model's logits after the last
    committed token and after each drafted one, then after each alternative (greedy only)."""
    logits = logits.float()
    drafted = draft.tokens
    if not selector.do_sample and not selector.has_processors:
        # Nothing depends on the prefix: choose every position at once.
        targets = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafted) and targets[accepted] == drafted[accepted]:
            accepted += 1
        for row, (index, token) in enumerate(alternative_rows(draft.alternatives), start=len(drafted) + 1):
            if index == accepted and token == targets[accepted]:
                rows = torch.cat([logits[: accepted + 1], logits[row, None]])
                tokens = drafted[:accepted] + [token, targets[row]]
                return Verdict(tokens, accepted + 1, rows, rows, alternative_row=row)
        rows = logits[: accepted + 1]
        return Verdict(drafted[:accepted] + [targets[accepted]], accepted, rows, rows)

    score_rows = []
    for position in range(len(drafted) + 1):
        scores = selector.scores(state.sequence[:, : state.length + position], logits[position : position + 1])
        score_rows.append(scores)
        token, p = selector.pick(scores)
        if position == len(drafted):
            break
        proposal = drafted[position]
        if selector.do_sample:
            q_proposal = float(draft.distributions[position][proposal]) if draft.distributions else 1.0
            if float(torch.rand(())) < float(p[proposal]) / q_proposal:
                continue
            q = draft.distributions[position] if draft.distributions else torch.nn.functional.one_hot(
                torch.tensor(proposal), p.numel()
            ).to(p.dtype)
            token = _resample_rejected(p, q)
        elif token == proposal:
            continue
        break
    accepted = len(score_rows) - 1
    return Verdict(drafted[:accepted] + [token], accepted, torch.cat(score_rows), logits[: accepted + 1])
