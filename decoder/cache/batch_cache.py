"""Caches for many sequences in one pass, each row at its own length (decoder/rounds/batch.py).

mlx-lm's `BatchKVCache` keeps B rows of keys in one buffer, left-padded so that every row ends
at the same physical position, and trims every row alike. A speculative batch keeps a different
number of each row's verified positions, so here a row's rejected positions stay in the buffer
as holes: `Holes` says, per row, which physical key positions are real, and `RowKVCache` (a
BatchKVCache: its buffer, growth, `extend` and `filter` are mlx-lm's) masks the rest and keeps
each row's own RoPE offset. Trimming the buffer's tail by what every row rejected keeps the
holes few; a row's holes cost attention work like mlx-lm's left padding does, never exactness.

A sliding window (mlx-lm's `RotatingKVCache`) joins as mlx-lm's `BatchRotatingKVCache`: rows
right-aligned in one buffer of about the window, left padding masked, written in place one
position at a time and in position order by a longer pass. `RowRotatingKVCache` adds what a
speculative batch needs: after a pass each row rolls its rejected positions to the front of its
row, where they become left padding (mlx-lm's `finalize` does that for right-padded prompts),
so no row ever trims a window that has wrapped. A DSA layer's `CacheList` (latent KV and
indexer keys) holds a RowKVCache of each, sharing the trunk's holes.

Recurrent layers (mlx-lm's `ArraysCache`) already hold one state per row; a verify pass records
what their recurrence consumed and each row's kept positions are replayed
(decoder/cache/recording.py). The MTP head's caches are RowKVCaches with holes of their own (a
sliding-window block's applies its window through the mask).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    dynamic_roll,
)

from mtpkit.decoder.cache.caches import is_recurrent, leaves, window
from mtpkit.decoder.cache.shapes import PaddedKVCache, padded


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
    mask), so a GPU compiles each attention shape once (decoder/cache/shapes.py). `window`: a
    sliding window's size (the head's window blocks keep every position, as alone: a key is
    seen while fewer than `window` of its row's real positions follow it up to the query)."""

    def __init__(self, holes: Holes, bounded: bool = False, window: int | None = None) -> None:
        super().__init__([])
        self.holes, self.bounded, self.window = holes, bounded, window
        self.fed: mx.array | None = None  # the last stock pass's new keys (Batch._staged)
        self.exact = False  # a one-token pass of a lone row without holes or padding: its
        # keys up to the end, no mask (`exact_views`)

    @classmethod
    def of(cls, single: KVCache, holes: Holes, bounded: bool = False) -> RowKVCache:
        """One sequence's KVCache as a batch of one row: its own buffers, not a copy (at a
        long context one copy of every layer's keys is gigabytes)."""
        row = cls(holes, bounded, window(single))
        row.state = (single.keys, single.values, mx.array([single.offset]), mx.array([0]),
                     single.offset)
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
        if self.exact:
            view = end
        return self.keys[..., :view, :], self.values[..., :view, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs: Any) -> mx.array | None:
        if self.exact and N == 1:
            return None  # (every key up to the end is the row's: nothing to hide)
        end = self._idx + N
        causal = create_causal_mask(N, offset=self._idx, **kwargs)
        valid = self.holes.over(self._view(end))
        causal = mx.pad(causal, [(0, 0), (0, valid.shape[1] - end)])
        mask = causal & valid[:, None, None, :]
        size = window_size or self.window
        if size is None:
            return mask
        seen = mx.cumsum(valid.astype(mx.int32), axis=1)  # (B, S): real positions up to each
        after = seen[:, self._idx:end, None] - seen[:, None, :]  # (B, N, S): real ones after it
        return mask & (after < size)[:, None]


class RowRotatingKVCache(BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache whose rows keep different counts of a pass: `settle`
    rolls each row's rejected positions to the front of its row as left padding (a row's
    keys stay right-aligned, so its window is where mlx-lm's mask puts it); nothing is
    trimmed, so a window that wrapped during the pass loses no key a row keeps."""

    @classmethod
    def of(cls, single: RotatingKVCache) -> RowRotatingKVCache:
        """One sequence's window as a batch of one row, every key it holds kept in position
        order (mlx-lm's merge keeps `max_size`; a longer pass leaves up to max_size - 1 more,
        and an assistant reads one more than the window where its cache holds it)."""
        row = cls(single.max_size, [0])
        if single.keys is not None:
            row.keys, row.values = (single._temporal_order(a) for a in (single.keys,
                                                                          single.values))
            row.offset = mx.array([single.offset])
            row._idx = row._offset = row.keys.shape[2]
        return row

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False
                  ) -> mx.array:
        """mlx-lm's mask, the buffer first put in position order where a longer pass will put
        it: mlx-lm's mask of a pass over a rotated buffer counts one front key less than the
        update trims (its BatchGenerator never runs such a pass)."""
        if N > 1 and self.rotated:
            self._temporal_order()
        return super().make_mask(N, window_size=window_size, return_array=return_array)

    def extend(self, other: BatchRotatingKVCache) -> None:
        """mlx-lm's extend, a row's padding first counted as none where it went below zero (a
        window that wrapped): mlx-lm adds the new left padding to it, and a pad column would
        pass for a key of the row."""
        for c in (self, other):
            c.left_padding = mx.maximum(c.left_padding, 0)
        super().extend(other)

    def settle(self, keep: mx.array, width: int) -> None:
        """After a pass of `width` positions (in position order, every row's ending the
        buffer): row b keeps its first keep[b]; the rest roll to its front as padding."""
        roll = width - keep
        self.keys = dynamic_roll(self.keys, roll[:, None], axis=2)
        self.values = dynamic_roll(self.values, roll[:, None], axis=2)
        self.left_padding = mx.maximum(self.left_padding, 0) + roll
        self.offset = self.offset - roll

    def row(self, b: int, last: int) -> tuple[mx.array, mx.array, mx.array]:
        """Row b's keys and values in position order, the `last` columns at most, and which of
        them are the row's (its padding is not)."""
        keys, values = self.keys[b:b + 1], self.values[b:b + 1]
        if self.rotated:
            keys, values = (mx.roll(a, -self._idx, axis=2) for a in (keys, values))
        else:
            keys, values = keys[..., :self._idx, :], values[..., :self._idx, :]
        start = max(keys.shape[2] - last, 0)
        real = mx.arange(start, keys.shape[2]) >= self.left_padding[b]
        return keys[..., start:, :], values[..., start:, :], real


def exact_views(caches: list[Any], on: bool) -> None:
    """Every RowKVCache among `caches` hands a one-token pass its keys up to the end with no
    mask (`on`), as mlx-lm's KVCache does for one sequence, or its padded, masked view. Only
    for a lone row without holes or padding (Batch.exact): on MLX's CUDA backend a masked
    one-row pass attends several times slower at a long context (BENCHMARKS.md, context
    sweep), and an unmasked one takes the fused vector kernel."""
    for c in _rows(caches):
        c.exact = on and c.window is None  # (a window's mask still hides what slid out)


def _rows(caches: list[Any]) -> list[RowKVCache]:
    """The RowKVCaches among `caches` (a CacheList's parts included), in order."""
    return [c for c in leaves(caches) if isinstance(c, RowKVCache)]


def _move(caches: list[Any], by: mx.array | int, trimmed: int) -> None:
    """Every batch attention cache's RoPE offsets moved by `by` (one op for every layer: the
    offsets are equal) and its buffer's tail shortened by `trimmed`."""
    rows = _rows(caches)
    if rows:
        offset = rows[0].offset + by
        for c in rows:
            c.offset = offset
            c._idx -= trimmed


def settle(caches: list[Any], holes: Holes, keep: mx.array, width: int, trimmed: int) -> None:
    """After a pass of `width` positions: row b keeps its first keep[b] (its RoPE offset moves
    by that much), and the buffers' tail drops `trimmed` (what every row rejected); a window
    rolls each row's rejected positions into its padding."""
    _move(caches, keep, trimmed)
    if holes.valid is not None:
        holes.close(keep, width, trimmed)
    if width > 1:
        for c in caches:
            if isinstance(c, RowRotatingKVCache):
                c.settle(keep, width)


def drop(caches: list[Any], holes: Holes, count: int) -> None:
    """The last `count` positions of every row leave (the head's chained drafts: its caches
    are RowKVCaches, a window block's included)."""
    assert all(isinstance(c, RowKVCache) for c in leaves(caches))
    _move(caches, -count, count)
    assert holes.valid is not None
    holes.valid = holes.valid[:, :holes.valid.shape[1] - count]


def batched(single: list[Any], holes: Holes, bounded: bool = False) -> list[Any]:
    """One sequence's caches as batches of one row (recurrent caches are batches already; a
    CacheList's parts share `holes`)."""
    out: list[Any] = []
    for c in single:
        if is_recurrent(c):
            out.append(c)
        elif type(c) is RotatingKVCache:
            out.append(RowRotatingKVCache.of(c))
        elif isinstance(c, CacheList):
            out.append(CacheList(*batched(list(c.caches), holes, bounded)))
        else:
            out.append(RowKVCache.of(c, holes, bounded))
    return out


def single(batch: list[Any], holes: list[Holes], fresh: list[Any]) -> list[Any]:
    """A batch-of-one's caches as one sequence's (`fresh`: its empty ones): attention keys at
    the row's real positions only (its holes dropped; a row without any keeps its buffers);
    a window's keys as mlx-lm extracts them; recurrent states as they are. The trunk's
    attention layers share one Holes; each head block has its own. `batch` is handed over:
    each layer leaves it once its copy is made, so one layer's copy at a time is alive beside
    the row's keys."""
    out, real = [], {}  # one host read per Holes, not per layer
    for i, f in enumerate(fresh):
        b, batch[i] = batch[i], None
        h = holes[0 if len(holes) == 1 else i]
        if isinstance(b, CacheList):
            out.append(CacheList(*single(list(b.caches), [h], list(f.caches))))
        elif isinstance(b, RowRotatingKVCache):
            out.append(b.extract(0))
        elif isinstance(b, RowKVCache):
            if id(h) not in real:
                assert h.valid is not None
                real[id(h)] = [p for p, v in enumerate(h.valid[0, :b._idx].tolist()) if v]
            kept = real[id(h)]
            if len(kept) == b._idx:  # no holes: views of the buffers, not copies
                f.state = (*(_whole(a, b._idx, f) for a in (b.keys, b.values)), b._idx)
            else:
                at = mx.array(kept, dtype=mx.int32)  # (a block with none: int)
                f.state = (b.keys[:, :, at, :], b.values[:, :, at, :], len(kept))
                mx.eval(f.state[:2])
            out.append(f)
        else:
            out.append(b)
    return out


def _whole(buffer: mx.array, end: int, into: KVCache) -> mx.array:
    """A row's buffer (its first `end` positions real) as `into` takes it without a copy: a
    KVCache the whole of it (it reads `offset` positions); a PaddedKVCache whole STEPs (it
    grows by whole STEPs, never slicing first), or the real positions where the buffer is
    shorter (its next pass grows it to whole STEPs)."""
    if not isinstance(into, PaddedKVCache):
        return buffer
    aligned = padded(end)
    return buffer[..., :aligned if buffer.shape[2] >= aligned else end, :]


def join(batch: list[Any], rows: list[Any], holes: Holes) -> None:
    """Append the rows of `rows` (batched caches of the same model) to `batch`, in place."""
    attention = list(zip(_rows(batch), _rows(rows), strict=True))
    if attention:
        b, r = attention[0]
        before, length = b._idx, r._idx
        holes.join(r.offset.shape[0], length, before, max(before, length))
    for b, r in zip(batch, rows, strict=True):
        b.extend(r)


def keep_rows(batch: list[Any], rows: list[int], holes: Holes) -> None:
    """Only `rows` (indices, in order) stay in `batch`, in place."""
    attention = _rows(batch)
    shift = 0
    if attention:
        pads = attention[0].left_padding[mx.array(rows)]
        shift = int(pads.min().item()) if rows else 0
    for c in batch:
        c.filter(mx.array(rows))
    if attention:
        holes.keep_rows(rows, shift)


def row_kv(c: Any, holes: Holes, b: int, last: int) -> tuple[mx.array, mx.array, mx.array]:
    """Row b's keys and values of one attention cache, as a drafter that reads the target's
    K/V sees them (decoder/drafters/assistant.py), and which of their positions are the row's: a
    RowKVCache's buffer up to its end with its holes, a window's `last` positions at most."""
    if isinstance(c, RowRotatingKVCache):
        return c.row(b, last)
    assert isinstance(c, RowKVCache) and holes.valid is not None
    end = c._idx
    return c.keys[b:b + 1, :, :end, :], c.values[b:b + 1, :, :end, :], holes.valid[b, :end]
