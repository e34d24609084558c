"""Who decides: the full model's logits at every drafted position, turned into committed tokens.

Greedy keeps the longest prefix of the draft that matches the verifier's own choices.
Sampling uses speculative sampling (accept with min(1, p/q), resample a rejection from
norm(max(0, p - q))), which leaves the output distributed exactly as plain sampling.
Either way the verifier adds one token of its own, so every verification makes progress.

Where the chain is rejected, the draft's alternatives there (`alternatives.py`) are offered
first. Greedy takes one that is the verifier's own choice. Sampling draws the replacement from
the residual by offering each alternative in turn as a one-token draft of its own: accepted
with its probability under what is left, else struck from it. That leaves the replacement
distributed exactly as the residual, whatever the alternatives are, so the output keeps plain
sampling's distribution. An accepted alternative's row then gives the verifier's next token.
"""

from __future__ import annotations

import torch

from .alternatives import alternative_rows
from .decoding_types import DecodingState, Draft, Verdict
from .selection import TokenSelector


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected draft token's replacement is drawn from: norm(max(0, p - q))."""
    residual = torch.clamp(p - q, min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


def _draw_offering(residual: torch.Tensor, offered: list[int]) -> tuple[int, bool]:
    """A draw from `residual` that takes one of `offered` where it can: `(token, was offered)`."""
    left = residual.clone()
    for token in offered:
        total = float(left.sum())
        if total > 0 and float(torch.rand(())) * total < float(left[token]):
            return token, True
        left[token] = 0
    total = left.sum()
    return int(torch.multinomial(left / total if total > 0 else residual, 1)), False


def verify(selector: TokenSelector, state: DecodingState, draft: Draft, logits: torch.Tensor) -> Verdict:
    """`logits` `[len(draft) + 1 + alternatives, vocab]`: the full model's logits after the last
    committed token and after each drafted one, then after each alternative."""
    logits = logits.float()
    drafted = draft.tokens
    if not selector.do_sample and not selector.has_processors:
        # Nothing depends on the prefix: choose every position at once.
        targets = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafted) and targets[accepted] == drafted[accepted]:
            accepted += 1
        target = targets[accepted]
        row = _alternative_row(draft, accepted, target) if accepted < len(drafted) else None
        if row is not None:
            prefix = state.sequence[:, : state.length + accepted]
            return _with_alternative(selector, prefix, accepted, target, row, draft, [logits[: accepted + 1]], logits)
        rows = logits[: accepted + 1]
        return Verdict(drafted[:accepted] + [target], accepted, rows, rows)

    score_rows = []
    for position in range(len(drafted) + 1):
        prefix = state.sequence[:, : state.length + position]
        scores = selector.scores(prefix, logits[position : position + 1])
        score_rows.append(scores)
        token, p = selector.pick(scores)
        if position == len(drafted):
            break
        proposal = drafted[position]
        offered = draft.alternatives[position] if position < len(draft.alternatives) else []
        if selector.do_sample:
            q_proposal = float(draft.distributions[position][proposal]) if draft.distributions else 1.0
            if float(torch.rand(())) < float(p[proposal]) / q_proposal:
                continue
            if draft.distributions:
                q = draft.distributions[position]
            else:  # a proposal without a distribution (prompt lookup) is certain
                q = torch.zeros_like(p)
                q[proposal] = 1.0
            token, was_offered = _draw_offering(_residual(p, q), offered)
        elif token == proposal:
            continue
        else:
            was_offered = token in offered
        if was_offered:
            row = _alternative_row(draft, position, token)
            return _with_alternative(selector, prefix, position, token, row, draft, score_rows, logits)
        break
    accepted = len(score_rows) - 1
    return Verdict(drafted[:accepted] + [token], accepted, torch.cat(score_rows), logits[: accepted + 1])


def _alternative_row(draft: Draft, position: int, token: int) -> int | None:
    """The logits row of `token` verified as an alternative at drafted `position`, if it was."""
    branches = alternative_rows(draft.alternatives)
    if (position, token) not in branches:
        return None
    return len(draft.tokens) + 1 + branches.index((position, token))


def _with_alternative(
    selector: TokenSelector,
    prefix: torch.Tensor,
    position: int,
    token: int,
    row: int,
    draft: Draft,
    score_rows: list[torch.Tensor],
    logits: torch.Tensor,
) -> Verdict:
    """The chain up to `position`, the alternative `token` there (verified in logits row `row`),
    and the verifier's next token, chosen from that row as plain decoding would after that text."""
    branch_prefix = torch.cat([prefix, prefix.new_tensor([[token]])], dim=1)
    scores = selector.scores(branch_prefix, logits[row : row + 1])
    next_token, _ = selector.pick(scores)
    rows = torch.cat([logits[: position + 1], logits[row, None]])
    return Verdict(
        draft.tokens[:position] + [token, next_token], position + 1, torch.cat([*score_rows, scores]), rows,
        alternative_row=row,
    )
