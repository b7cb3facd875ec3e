"""Verify passes traced once per shape (`mx.compile`) and replayed without Python.

On MLX's CUDA backend a verify pass is bound by the host: building the graph in Python and
handing it to the device cost about as much as the device's own work (docs/benchmarks-history.md, second GPU
session), and a synchronous round cannot overlap the two as pipelined plain decoding does.
`mx.compile` traces mlx-lm's own forward once per (rows, key buffer) shape and replays the tape
from C++ afterwards, with elementwise chains fused.

A trace must not bake the cache position in, so inside it each PaddedKVCache is stood in for by
a `_TracedCache` whose offset is an int32 array: rope takes it as an array, rows are written by
`mx.slice_update` at it into the STEP-aligned buffer, and the mask (additive, or bool for
families that select with it) hides each row's future and whatever a discarded pass left past
the end. The real caches keep their Python offsets; a pass hands them the new buffers. Only
trunks whose caches are all PaddedKVCache take this path (recurrent, rotating and quantized
caches keep the stock pass), and a trunk whose forward cannot be traced (a family that reads the
offset as a Python number) falls back for good the first time.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from mtpkit.decoder.shapes import PaddedKVCache
from mtpkit.loaders.families import SELECTING_MASK


@functools.lru_cache(maxsize=64)
def _positions(length: int) -> mx.array:
    """Key positions 0..length-1, made once per buffer length and passed in (an op with no
    inputs inside the graph would be run again on every replay)."""
    out = mx.arange(length, dtype=mx.int32)
    mx.eval(out)
    return out


class _TracedCache:
    """Stands in for one PaddedKVCache inside a trace: whole STEP-aligned buffers and an array
    offset. update_and_fetch writes the pass's rows and returns the whole buffers; the offset
    stays where the pass started (rope and the mask read it after the write)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, positions: mx.array,
                 selecting: bool) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self.positions, self.selecting = positions, selecting

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.offset[None], axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset[None], axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array:
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not traced")
        seen = self.positions[None] <= self.offset + self.positions[:n, None]
        if self.selecting:
            return seen
        return mx.where(seen, mx.array(0, self.keys.dtype), mx.array(-mx.inf, self.keys.dtype))

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values


class TracedPasses:
    """The trunk's verify passes through one `mx.compile`d function (MLX keeps a trace per
    input shape, with the weights it saw: make this after the trunk's modules are final).
    Call `run`; None means "not traceable here, use the stock pass"."""

    def __init__(self, trunk: Any) -> None:
        self.trunk = trunk
        self.broken = False
        self.selecting = getattr(trunk.args, "model_type", "") in SELECTING_MASK
        self._fn = mx.compile(self._forward)

    def _forward(self, tokens: mx.array, offset: mx.array, positions: mx.array,
                 *buffers: mx.array) -> tuple[mx.array, ...]:
        caches = [_TracedCache(buffers[i], buffers[i + 1], offset, positions, self.selecting)
                  for i in range(0, len(buffers), 2)]
        hidden, logits = self.trunk.forward(tokens, caches)
        return (hidden, logits, *[a for c in caches for a in (c.keys, c.values)])

    def usable(self, cache: list[Any]) -> bool:
        return (not self.broken and bool(cache)
                and all(type(c) is PaddedKVCache and c.keys is not None for c in cache)
                and len({(c.offset, c.keys.shape[2]) for c in cache}) == 1)

    def run(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array] | None:
        """(hidden, logits) of every row of `tokens` (1, T), the caches advanced by T; None
        (caches untouched) where this trunk or cache cannot take the traced pass."""
        if not self.usable(cache):
            return None
        start = cache[0].offset
        end = start + tokens.shape[1]
        for c in cache:
            c.reserve(end, c.keys, c.values)
        length = cache[0].keys.shape[2]
        buffers = [a for c in cache for a in (c.keys, c.values)]
        try:
            out = self._fn(tokens, mx.array(start, mx.int32), _positions(length), *buffers)
        except (NotImplementedError, ValueError, TypeError, RuntimeError):
            self.broken = True  # a forward that needs the offset as a number: stock passes
            return None
        hidden, logits, *new = out
        for i, c in enumerate(cache):
            c.keys, c.values, c.offset = new[2 * i], new[2 * i + 1], end
        return hidden, logits

