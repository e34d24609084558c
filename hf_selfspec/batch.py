"""The rows a decode commits to: one text, or a batch of left-padded texts, each drafted,
verified and committed on its own.

The rows share one KV cache and stay right-aligned in it, as plain `generate`'s left padding
leaves them: every row's text ends at the cache's last column, and the columns before its first
token are padding, masked out. A verification feeds every row its newest committed token and
its draft, the shorter drafts padded at the end (nothing attends to what follows a row's
draft); a row that then committed fewer tokens than the most moves right by the difference
(`Realignment`), its rejected draft falling off the end. So a key's distance in columns stays
its distance in tokens, and a sliding window holds in each row exactly the tokens it holds in
plain batched decoding, at the price of one copy of the cache for each step whose rows
committed unequal counts. Columns that become padding in every row are dropped.

A row stops where plain `generate` would stop it: at its own EOS or stopping criterion (where
the criteria hold an EOS, its later tokens are padding); without one, every row runs on until
the last has stopped, as plain decoding runs them. A row that has stopped leaves the cache, so
the rows still going decode without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteriaList

from .alternatives import verification_inputs
from .cache import DraftAwareCache, Realignment
from .decoding_types import DecodingState, Draft, Verdict
from .selection import TokenSelector


@dataclass
class Row:
    """One text of the batch: its committed tokens (`state`, a view of the batch's buffer, its
    left padding included) and what it decided on its own."""

    state: DecodingState
    parts: object  # the row's `RowParts`
    selector: TokenSelector  # how the row's tokens are chosen, as plain decoding chooses that row's
    index: int  # its row in the input and in the output
    padding: int  # its left padding in the prompt
    end: int  # the length it stops at, at the latest
    stopped_at: int | None = None  # the length at which the stopping criteria first stopped it
    scores: list[torch.Tensor] | None = None  # each committed token's scores `[1, vocab]`, if kept
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return min(self.state.length, self.end)


def quorum_rows(quorum: float, rows: int) -> int:
    """How many of a batch's `rows` must want a longer proposal for the batch to have one
    (`batch_quorum`): one in a batch of one."""
    return max(1, math.ceil(quorum * rows))


def within_quorum(drafts: list[Draft], quorum: float) -> list[Draft]:
    """The batch's proposals, each cut to the length that `quorum_rows` of them reach: the
    verification is as wide as its longest proposal, and every row pays for that width."""
    if len(drafts) == 1:
        return drafts
    lengths = sorted((len(draft.tokens) for draft in drafts), reverse=True)
    cap = lengths[quorum_rows(quorum, len(drafts)) - 1]
    for draft in drafts:
        del draft.tokens[cap:], draft.distributions[cap:], draft.alternatives[cap:]
    return drafts


def why_not_left_padded(attention_mask, input_ids) -> str | None:
    """What is wrong with a batch's `attention_mask` for `input_ids`, in a few words, or None:
    it must be 2-D, one 0 or 1 per input token, each row's zeros (its padding) before all its
    ones, and every row must have a one."""
    if not isinstance(attention_mask, torch.Tensor) or not isinstance(input_ids, torch.Tensor):
        return None
    if attention_mask.shape != input_ids.shape:
        return (
            f"its shape {tuple(attention_mask.shape)} is not input_ids' {tuple(input_ids.shape)}; "
            "pass one 0 or 1 per input token"
        )
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        return "it holds values other than 0 and 1"
    ones = attention_mask != 0
    empty = torch.nonzero(~ones.any(dim=-1)).flatten().tolist()
    if empty:
        return f"row {empty[0]} is all zeros: every row needs a token to attend to"
    padded_inside = torch.nonzero((ones.long().cummax(dim=-1).values > ones.long()).any(dim=-1)).flatten().tolist()
    if padded_inside:
        return (
            f"row {padded_inside[0]} has zeros after its first one (right or inner padding); "
            "pad on the left (tokenizer.padding_side = 'left'), as decoder-only generation needs"
        )
    return None


def left_padding(attention_mask: torch.Tensor | None, rows: int) -> list[int]:
    """Each row's count of leading zeros in its attention mask (0 for each of `rows` without a
    mask)."""
    if attention_mask is None:
        return [0] * rows
    return (attention_mask.cumsum(dim=1) == 0).sum(dim=1).tolist()


class Batch:
    """The rows of one decode, in one buffer of `max_length` tokens each, and the ones still
    decoding (`active`), in the order the cache holds them."""

    def __init__(self, request, row_parts: list, cache: DraftAwareCache):
        input_ids, attention_mask, max_length = request.input_ids, request.attention_mask, request.max_length
        keep_scores = request.keep_scores
        self.pad_token_id = 0 if request.pad_token_id is None else int(request.pad_token_id)
        count, prompt_length = input_ids.shape
        self.prompt_length = prompt_length
        self.sequences = input_ids.new_zeros((count, max_length))
        self.sequences[:, :prompt_length] = input_ids
        paddings = left_padding(attention_mask, count)
        offsets = torch.tensor(paddings, device=input_ids.device)[:, None]
        positions = (torch.arange(max_length, device=input_ids.device)[None, :] - offsets).clamp(min=0)
        self.rows = [
            Row(DecodingState(self.sequences[i : i + 1], positions[i : i + 1], prompt_length), parts,
                request.selector.for_row(i), i, paddings[i], max_length, scores=[] if keep_scores else None)
            for i, parts in enumerate(row_parts)
        ]
        self.active = [row for row in self.rows if row.state.length < row.end]
        # The padding every row of the prompt shares stays, as plain decoding keeps it: a
        # batch of one is left as plain decoding leaves it.
        self.common_padding = min(paddings)
        cache.starts = tuple(paddings) if any(paddings) else None
        self.streamed = prompt_length  # the columns a streamer has had
        self.fresh = prompt_length - cache.get_seq_length()  # committed tokens without KV, in every row

    def limits(self, max_proposal_tokens: int) -> list[int]:
        """How many tokens each active row may propose: its room before its end, one of which
        the verifier's own token takes."""
        return [min(max_proposal_tokens, row.end - row.state.length - 1) for row in self.active]

    def verification_inputs(self, drafts: list[Draft], kv_length: int, model, cache: DraftAwareCache):
        """`(input_ids, position_ids, attention_mask)` verifying each active row's committed
        tokens without KV and its draft, at the cache's columns from `kv_length` on. A batch's
        drafts are verified without their runner-ups, which are dropped here."""
        if len(self.rows) == 1:
            state, draft = self.active[0].state, drafts[0]
            return verification_inputs(
                state.sequence, state.positions, kv_length, state.length, len(draft.tokens), draft.alternatives,
                model, cache,
            )
        fresh, device = self.fresh, self.sequences.device
        width = fresh + max(len(draft.tokens) for draft in drafts)
        rows, columns, positions = [], [], []
        for row, draft in zip(self.active, drafts):
            draft.alternatives = []
            first, last = row.state.length - fresh, fresh + len(draft.tokens) - 1
            # a row whose draft is shorter repeats its last input: its later inputs are padding
            columns.append([first + min(step, last) for step in range(width)])
            positions.append([max(first + step - row.padding, 0) for step in range(width)])
            rows.append([row.index])
        input_ids = self.sequences[torch.tensor(rows, device=device), torch.tensor(columns, device=device)]
        position_ids = torch.tensor(positions, device=device)
        return input_ids, position_ids, cache.padding_mask(kv_length + width, device)

    def commit(self, verdicts: list[Verdict], stopping_criteria: StoppingCriteriaList, keep_scores: bool) -> list[int]:
        """Commit each active row's verdict, each stopping where plain decoding would stop it:
        how many tokens each committed."""
        committed = []
        for row, verdict in zip(self.active, verdicts):
            count, stopped = commit(row.state, verdict, stopping_criteria, row.scores)
            if stopped and row.stopped_at is None:
                row.stopped_at = row.state.length
            if keep_scores:
                row.logits.extend(verdict.logits[:count, None])
            committed.append(count)
        return committed

    def settle(self, committed: list[int], kv_length: int, pads_stopped: bool, starts) -> Realignment:
        """After a verification from column `kv_length`: which rows go on, and how the cache's
        rows move so that theirs stay right-aligned (`starts`: each row's first column)."""
        if pads_stopped:
            for row in self.active:
                if row.stopped_at is not None:
                    row.end = row.stopped_at
        elif all(row.stopped_at is not None for row in self.rows):
            end = max(row.stopped_at for row in self.rows)
            for row in self.rows:
                row.end = min(row.end, end)
        going = [i for i, row in enumerate(self.active) if row.state.length < row.end]
        kept = going or list(range(len(self.active)))  # the last rows stay in the cache, as plain leaves it
        top = max(committed[i] for i in kept)
        new_length = kv_length + self.fresh - 1 + top  # the KV of every kept row's text but its newest token
        self.fresh = 1
        if len(self.active) == 1:
            self.active = [self.active[i] for i in going]
            return Realignment(new_length)
        shifts = tuple(top - committed[i] if i in kept else 0 for i in range(len(self.active)))
        starts = [0] * len(self.active) if starts is None else starts
        dropped = min(starts[i] + shifts[i] for i in kept) - self.common_padding
        kept_rows = tuple(kept) if len(kept) < len(self.active) else None
        self.active = [self.active[i] for i in going]
        return Realignment(new_length, shifts, kept_rows, dropped)

    def stream(self, streamer, committed: list[int]) -> None:
        """Hand `streamer` what plain decoding would have handed it by now: one text's new tokens
        as they come; a batch's columns (a token of every row, padding where a row has stopped)
        once every row still going has reached them, since plain decoding puts one at a time."""
        if len(self.rows) == 1:
            state = self.rows[0].state
            streamer.put(state.sequence[0, state.length - committed[0] : state.length].cpu())
            return
        ready = min((row.state.length for row in self.active), default=self.width)
        if ready <= self.streamed:
            return
        block = self.sequences[:, self.streamed : ready].clone()
        for row in self.rows:
            block[row.index, max(row.length - self.streamed, 0) :] = self.pad_token_id
        for column in block.T.cpu():
            streamer.put(column)
        self.streamed = ready

    @property
    def width(self) -> int:
        """The length of the output: of its longest row."""
        return max(row.length for row in self.rows)

    def output_sequences(self) -> torch.Tensor:
        """Every row's text, padded after its end to the longest, as plain `generate` returns them."""
        sequences = self.sequences[:, : self.width].clone()
        for row in self.rows:
            sequences[row.index, row.length :] = self.pad_token_id
        return sequences

    def kept(self, name: str) -> tuple[torch.Tensor, ...]:
        """The kept scores or logits (`name`), one `[rows, vocab]` tensor per new token. A row
        that stopped before a token has, there, padding that was certain: 0 at the pad token,
        -inf elsewhere."""
        steps = self.width - self.prompt_length
        per_row = [getattr(row, name) for row in self.rows]
        if len(per_row) == 1:
            return tuple(per_row[0][:steps])
        if not any(per_row):
            return ()
        vocab = next(kept[0] for kept in per_row if kept).shape[-1]
        padding = torch.full((1, vocab), -float("inf"), device=self.sequences.device)
        padding[0, self.pad_token_id] = 0.0
        return tuple(
            torch.cat([kept[step] if step < row.length - self.prompt_length else padding
                       for row, kept in zip(self.rows, per_row)])
            for step in range(steps)
        )


def commit(
    state: DecodingState, verdict: Verdict, stopping_criteria: StoppingCriteriaList, kept_scores: list[torch.Tensor] | None
) -> tuple[int, bool]:
    """Append the verdict's tokens one by one, stopping exactly where plain decoding would. As in
    plain decoding, the criteria see the scores kept so far, so one that reads the newest token's
    scores (transformers' `ConfidenceCriteria`) works when scores are kept."""
    for count, token in enumerate(verdict.tokens, start=1):
        state.sequence[0, state.length] = token
        state.length += 1
        if kept_scores is not None:
            kept_scores.append(verdict.scores[count - 1, None])
        scores = None if kept_scores is None else tuple(kept_scores)
        if bool(stopping_criteria(state.sequence[:, : state.length], scores).any()):
            return count, True
    return len(verdict.tokens), False
