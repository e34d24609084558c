"""One KV cache shared by the layer-skip draft and the full-model verifier.

A draft forward that skips a layer's attention leaves that layer's cache untouched, so while
drafting the layers hold different lengths: rolling back after verification is done per layer,
to one committed length (the draft sizes its masks from layers that run, `SkippingDecoder`).

A verification that accepts one of the draft's alternatives (`alternatives.py`) computed its KV
past the chain; it moves to the place of the draft token it replaced before the rollback. A
sliding-window layer holds only the newest keys, so entries are found by counting from the end.

A batch keeps every row right-aligned, as plain `generate`'s left padding does: each row's text
ends at the cache's last column, and the columns before its first token are padding, masked out
(`starts`, `padding_mask`). After each verification the rows that committed fewer tokens than
the most move right by the difference (`realign`), so that a key's distance in columns stays its
distance in tokens, which a sliding window counts.

`generate` hands the loop a cache, the caller's own or one transformers made; the loop works in
that cache's layer objects (`rollback_view`), so the caller gets them back holding the decoded
text's KV, as plain decoding leaves them, and a chat can continue from them.

transformers 5.24 renamed the cache `past_key_values` to `cache`: in `generate`'s arguments, in what
it hands `_sample`, in its outputs and in every forward. We support 5.23 and 5.24, so whatever
names the cache asks `CACHE_ARGUMENT` here rather than spelling either name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

# The installed transformers' name for the cache, read from its output type.
CACHE_ARGUMENT = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def cache_keyword(cache: Cache | None) -> dict[str, Cache | None]:
    """`cache` as the keyword a model's forward takes it by."""
    return {CACHE_ARGUMENT: cache}


def cache_given_to(generate_kwargs: dict) -> Cache | None:
    """The cache a `generate` call was given. 5.24 still takes the old name, and maps it to the new
    after we have read the call."""
    return generate_kwargs.get(CACHE_ARGUMENT, generate_kwargs.get("past_key_values"))


# The layer kinds whose rollback and entry moves this module knows (quantised, offloaded and
# linear-attention layers keep their state elsewhere).
ROLLBACK_CAPABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


@dataclass(frozen=True)
class Realignment:
    """How a step of a batch leaves its rows' KV: row `r`'s entries move `shifts[r]` columns
    right (none where `shifts` is empty), every row is cut to `kv_length` columns, only
    `kept_rows` stay (all where None), and the first `dropped_columns` columns, padding in every
    row kept, go. A batch of one only rolls back: nothing else moves."""

    kv_length: int
    shifts: tuple[int, ...] = ()
    kept_rows: tuple[int, ...] | None = None
    dropped_columns: int = 0

    @property
    def moves_rows(self) -> bool:
        return any(self.shifts) or self.kept_rows is not None or self.dropped_columns > 0

    def realign_starts(self, starts: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """Each kept row's first column of text after the move, from each row's before it (None:
        no row has padding)."""
        if not self.moves_rows or (starts is None and not any(self.shifts)):
            return starts
        before = starts or (0,) * len(self.shifts)
        moved = [start + shift for start, shift in zip(before, self.shifts or (0,) * len(before))]
        kept = moved if self.kept_rows is None else [moved[row] for row in self.kept_rows]
        kept = tuple(start - self.dropped_columns for start in kept)
        return kept if any(kept) else None


def shift_rows(layers, shifts: tuple[int, ...]) -> None:
    """Move each row's entries `shifts[row]` columns right in every layer, over the entries the
    layer holds (a window's recorded past included): what falls off the end is the row's
    rejected draft, and the columns opened at the start keep what they held, as padding. Only
    the rows that move are copied, in place."""
    moving = [(row, by) for row, by in enumerate(shifts) if by]
    for layer in layers:
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        for row, by in moving:
            for entries in (layer.keys, layer.values):
                entries[row, :, by:] = entries[row, :, :-by].clone()


def drop_columns(layers, columns: int) -> None:
    """Drop the first `columns` columns of every layer (padding in every row)."""
    if columns <= 0:
        return
    for layer in layers:
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        if layer.is_sliding:  # it holds only the newest of its columns, counted in `cumulative_length`
            layer.cumulative_length -= columns
            keep = min(layer.keys.shape[-2], layer.cumulative_length)
        else:
            keep = layer.keys.shape[-2] - columns
        first = layer.keys.shape[-2] - keep
        layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]


def keep_rows(layers, rows: tuple[int, ...] | None) -> None:
    if rows is None:
        return
    for layer in layers:
        if layer.is_initialized and layer.keys.numel():
            layer.batch_select_indices(torch.tensor(rows, device=layer.keys.device))


class DraftAwareCache(DynamicCache):
    def __init__(self, config=None):
        # Without the model's config every layer keeps every key, sliding-window layers too: for
        # a pass whose rows reach back further than the window from the end of the text (the
        # tuner's teacher-forced draft), the window is then the mask's to apply.
        super().__init__(config=config)
        # Sliding-window layers normally drop what falls out of the window; keeping it until the
        # next rollback is what makes rejected drafts undoable once the text outgrows the window.
        self.activate_past_recording()
        # Per row, the first column holding its text; None where every row's starts at column 0.
        self.starts: tuple[int, ...] | None = None

    def padding_mask(self, width: int, device: torch.device) -> torch.Tensor | None:
        """The 2-D attention mask `[rows, width]` over the first `width` columns: 0 on each row's
        padding. None without padding, as plain `generate` passes none then."""
        if self.starts is None:
            return None
        columns = torch.arange(width, device=device)[None, :]
        return (columns >= torch.tensor(self.starts, device=device)[:, None]).long()

    def realign(self, realignment: Realignment) -> None:
        """Leave the rows as `realignment` says, rolled back to its `kv_length` columns."""
        shift_rows(self.layers, realignment.shifts)
        self.rollback(realignment.kv_length)
        keep_rows(self.layers, realignment.kept_rows)
        drop_columns(self.layers, realignment.dropped_columns)
        self.starts = realignment.realign_starts(self.starts)

    def sliding_keys(self, query_length: int) -> int | None:
        """How many keys a sliding-window layer attends over with `query_length` new ones: those
        it keeps and the new. None without such layers."""
        for index, layer in enumerate(self.layers):
            if layer.is_sliding:
                return self.get_mask_sizes(query_length, index)[0]
        return None

    def rollback(self, length: int) -> None:
        """Truncate every layer to `length` tokens, however far each one grew."""
        for layer in self.layers:
            if not layer.is_initialized:  # no forward has reached it yet (an assistant's before it drafts)
                continue
            excess = layer.get_seq_length() - length
            # crop(0) is not a no-op on sliding layers: it trims the recorded past to the window.
            layer.crop(-max(excess, 0))

    def move_entry(self, source: int, target: int) -> None:
        """Copy entry `source`'s keys and values over entry `target`'s, in every layer (entries
        counted from the start of the text)."""
        for layer in self.layers:
            dropped = layer.get_seq_length() - layer.keys.shape[-2]  # a window's oldest, gone
            layer.keys[:, :, target - dropped] = layer.keys[:, :, source - dropped]
            layer.values[:, :, target - dropped] = layer.values[:, :, source - dropped]


def why_not_rollback_capable(cache) -> str | None:
    """Why decoding cannot continue in `cache`'s layers, or None."""
    if not isinstance(cache, DynamicCache):
        return f"continue from a {type(cache).__name__}: a strategy rolls back the layers of a DynamicCache"
    if cache.offloading:
        return "continue from an offloaded DynamicCache"
    for layer in cache.layers:
        if type(layer) not in ROLLBACK_CAPABLE_LAYERS:
            return f"continue from a cache with {type(layer).__name__} layers"
    return None


@contextmanager
def rollback_view(cache: DynamicCache) -> Iterator[DraftAwareCache]:
    """A `DraftAwareCache` over `cache`'s own layer objects, lazily added ones included.

    Sliding-window layers record their past while the view is open, so that rejected drafts can
    be undone; on closing they stop, as a cache for plain decoding must not keep growing.
    """
    view = DraftAwareCache()
    view.layers, view.layer_class_to_replicate = cache.layers, cache.layer_class_to_replicate
    recording = [getattr(layer, "record_past", None) for layer in cache.layers]
    view.activate_past_recording()
    try:
        yield view
    finally:
        for layer, recorded in zip(cache.layers, recording):
            if recorded is False:
                layer.record_past = False
