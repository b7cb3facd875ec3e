"""Caches for many sequences in one pass, each row at its own length (decoder/batch.py).

mlx-lm's `BatchKVCache` keeps B rows of keys in one buffer, left-padded so that every row ends
at the same physical position, and trims every row alike. A speculative batch keeps a different
number of each row's verified positions, so here a row's rejected positions stay in the buffer
as holes: `Holes` says, per row, which physical key positions are real, and `RowKVCache` (a
BatchKVCache: its buffer, growth, `extend` and `filter` are mlx-lm's) masks the rest and keeps
each row's own RoPE offset. Trimming the buffer's tail by what every row rejected keeps the
holes few; a row's holes cost attention work like mlx-lm's left padding does, never exactness.

Recurrent layers (mlx-lm's `ArraysCache`) already hold one state per row; a verify pass records
what their recurrence consumed and each row's kept positions are replayed
(decoder/recording.py). The MTP head's caches are RowKVCaches with holes of their own.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from mtpkit.decoder.caches import is_recurrent
from mtpkit.decoder.shapes import padded


class Holes:
    """Which physical key positions each row may attend to, shared by every attention layer of
    one model (they grow, shrink and join alike): `valid` (B, S), S the buffers' length."""

    def __init__(self) -> None:
        self.valid: mx.array | None = None

    def open(self, real: mx.array, width: int) -> None:
        """A pass of `width` positions in which row b's first real[b] are real (the rest pad
        the row to the pass's width and are never attended to)."""
        fresh = mx.arange(width)[None] < real[:, None]
        self.valid = fresh if self.valid is None else mx.concatenate([self.valid, fresh], axis=1)

    def over(self, length: int) -> mx.array:
        """`valid` padded with holes to `length` positions (a pass's padded key view)."""
        assert self.valid is not None
        extra = length - self.valid.shape[1]
        return mx.pad(self.valid, [(0, 0), (0, extra)]) if extra > 0 else self.valid

    def close(self, keep: mx.array, width: int, trimmed: int) -> None:
        """After the pass: row b keeps its first keep[b] positions; the buffers' tail lost
        `trimmed` positions (what every row rejected)."""
        assert self.valid is not None
        end = self.valid.shape[1]
        block = mx.arange(width - trimmed)[None] < keep[:, None]
        self.valid = mx.concatenate([self.valid[:, :end - width], block], axis=1)

    def join(self, rows: int, length: int, before: int, after: int) -> None:
        """`rows` new rows whose `length` positions are all real, right-aligned with the batch
        as BatchKVCache.extend aligns them (`before`/`after`: the buffers' length)."""
        fresh = mx.arange(after)[None] >= after - length
        fresh = mx.broadcast_to(fresh, (rows, after))
        if self.valid is None or self.valid.shape[0] == 0:
            self.valid = fresh
            return
        old = self.valid
        if after > before:
            old = mx.concatenate([mx.zeros((old.shape[0], after - before), mx.bool_), old], axis=1)
        self.valid = mx.concatenate([old, fresh])

    def keep_rows(self, rows: list[int], shift: int) -> None:
        """Only `rows` stay; the buffers dropped their first `shift` positions."""
        assert self.valid is not None
        self.valid = self.valid[mx.array(rows)][:, shift:]


class RowKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache whose rows keep their own lengths: `offset` (each row's RoPE
    position) counts a row's real positions only, and the mask hides the holes. A pass leaves
    the offsets alone (every layer reads them before it writes) and `settle` moves them once
    for all layers. `bounded`: a pass sees keys padded to a multiple of STEP (hidden by the
    mask), so a GPU compiles each attention shape once (decoder/shapes.py)."""

    def __init__(self, holes: Holes, bounded: bool = False) -> None:
        super().__init__([])
        self.holes, self.bounded = holes, bounded
        self.fed: mx.array | None = None  # the last stock pass's new keys (Batch._staged)

    @classmethod
    def of(cls, single: KVCache, holes: Holes, bounded: bool = False) -> RowKVCache:
        """One sequence's KVCache as a batch of one row."""
        row = cls(holes, bounded)
        row.state = BatchKVCache.merge([single]).state
        return row

    def _view(self, end: int) -> int:
        return padded(end) if self.bounded else end

    def reserve(self, end: int, keys: mx.array, values: mx.array) -> int:
        """Grow the buffers by whole steps so a pass ending at `end` fits with its view
        (`keys`/`values` give the shape and dtype of new rows); returns the view's length."""
        have = 0 if self.keys is None else self.keys.shape[2]
        view = self._view(end)
        if view > have:
            b, heads, _, kd = keys.shape
            grow = padded(end) - have
            extra_k = mx.zeros((b, heads, grow, kd), keys.dtype)
            extra_v = mx.zeros((b, heads, grow, values.shape[3]), values.dtype)
            self.keys = extra_k if self.keys is None else mx.concatenate([self.keys, extra_k], 2)
            self.values = extra_v if self.values is None else \
                mx.concatenate([self.values, extra_v], 2)
        return view

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start, end = self._idx, self._idx + keys.shape[2]
        self.fed = keys
        view = self.reserve(end, keys, values)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self._idx = end
        return self.keys[..., :view, :], self.values[..., :view, :]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        end = self._idx + N
        causal = create_causal_mask(N, offset=self._idx, **kwargs)
        valid = self.holes.over(self._view(end))
        causal = mx.pad(causal, [(0, 0), (0, valid.shape[1] - end)])
        return causal & valid[:, None, None, :]


def _move(caches: list[Any], by: mx.array | int, trimmed: int) -> None:
    """Every batch attention cache's RoPE offsets moved by `by` (one op for every layer: the
    offsets are equal) and its buffer's tail shortened by `trimmed`."""
    rows = [c for c in caches if isinstance(c, RowKVCache)]
    if rows:
        offset = rows[0].offset + by
        for c in rows:
            c.offset = offset
            c._idx -= trimmed


def settle(caches: list[Any], holes: Holes, keep: mx.array, width: int, trimmed: int) -> None:
    """After a pass of `width` positions: row b keeps its first keep[b] (its RoPE offset moves
    by that much), and the buffers' tail drops `trimmed` (what every row rejected)."""
    _move(caches, keep, trimmed)
    holes.close(keep, width, trimmed)


def drop(caches: list[Any], holes: Holes, count: int) -> None:
    """The last `count` positions of every row leave (the head's chained drafts)."""
    _move(caches, -count, count)
    assert holes.valid is not None
    holes.valid = holes.valid[:, :holes.valid.shape[1] - count]


def batched(single: list[Any], holes: Holes, bounded: bool = False) -> list[Any]:
    """One sequence's caches as batches of one row (recurrent caches are batches already)."""
    return [c if is_recurrent(c) else RowKVCache.of(c, holes, bounded) for c in single]


def join(batch: list[Any], rows: list[Any], holes: Holes) -> None:
    """Append the rows of `rows` (batched caches of the same model) to `batch`, in place."""
    attention = [(b, r) for b, r in zip(batch, rows, strict=True) if isinstance(b, RowKVCache)]
    if attention:
        b, r = attention[0]
        before, length = b._idx, r._idx
        holes.join(r.offset.shape[0], length, before, max(before, length))
    for b, r in zip(batch, rows, strict=True):
        b.extend(r)


def keep_rows(batch: list[Any], rows: list[int], holes: Holes) -> None:
    """Only `rows` (indices, in order) stay in `batch`, in place."""
    attention = [c for c in batch if isinstance(c, RowKVCache)]
    shift = 0
    if attention:
        pads = attention[0].left_padding[mx.array(rows)]
        shift = int(pads.min().item()) if rows else 0
    for c in batch:
        c.filter(mx.array(rows))
    if attention:
        holes.keep_rows(rows, shift)


def usable(cache: list[Any]) -> bool:
    """Caches a batch can hold: mlx-lm's KVCache (and ours) and ArraysCache."""
    return all(type(c) in (KVCache, ArraysCache) or isinstance(c, KVCache) for c in cache)
