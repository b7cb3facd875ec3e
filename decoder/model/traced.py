"""Verify passes traced once per shape (`mx.compile`) and replayed without Python.

On MLX's CUDA backend a verify pass is bound by the host: building the graph in Python and
handing it to the device cost about as much as the device's own work (docs/benchmarks-history.md,
2026-11-24), and a synchronous round cannot overlap the two as pipelined plain decoding does.
`mx.compile` traces mlx-lm's own forward once per (rows, key buffer) shape and replays the tape
from C++ afterwards, with elementwise chains fused.

A trace must not bake the cache position in, so inside it each PaddedKVCache is stood in for by
a `_TracedCache` whose offset is an int32 array: rope takes it as an array, rows are scattered at
it into the STEP-aligned buffer, and the mask (additive, or bool for families that select with
it) hides each row's future and whatever a discarded pass left past the end. The real caches
keep their Python offsets; a pass hands them the new buffers.
Recurrent layers (GatedDeltaNet, mlx-lm's ArraysCache) take their conv and recurrent states in
and hand the new ones out; a recording pass also hands out what a commit replays from (each
recurrent layer's input and projections, decoder/cache/recording.py), so hybrid trunks (Qwen3.5/3.6,
Qwen3-Next) verify traced too. Rotating and quantized caches keep the stock pass, and a trunk
whose forward cannot be traced (a family that reads the offset as a Python number) falls back
for good the first time.
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from mtpkit.decoder.cache.batch_cache import RowKVCache
from mtpkit.decoder.cache.caches import arrays, traceable
from mtpkit.decoder.cache.recording import recorded
from mtpkit.decoder.cache.shapes import PaddedKVCache
from mtpkit.loaders.families import SELECTING_MASK


@functools.lru_cache(maxsize=64)
def _positions(length: int) -> mx.array:
    """Key positions 0..length-1, made once per buffer length and passed in (an op with no
    inputs inside the graph would be run again on every replay)."""
    out = mx.arange(length, dtype=mx.int32)
    mx.eval(out)
    return out


def _write(buffer: mx.array, rows: mx.array, start: mx.array) -> mx.array:
    """`buffer` with `rows` written at positions start.. of axis 2, as a scatter: MLX's CUDA
    backend copies the whole buffer for `mx.slice_update` at an array offset and donates it for
    a scatter (bench/prof_kv_update.py), so the write costs the rows, not the context."""
    at = (start + mx.arange(rows.shape[2], dtype=mx.int32))[None, None, :, None]
    return mx.put_along_axis(buffer, mx.broadcast_to(at, rows.shape), rows.astype(buffer.dtype),
                             axis=2)


class _TracedCache:
    """Stands in for one PaddedKVCache inside a trace: whole STEP-aligned buffers and an array
    offset. update_and_fetch writes the pass's rows and returns the whole buffers; the offset
    stays where the pass started (rope and the mask read it after the write)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, positions: mx.array,
                 selecting: bool) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self.positions, self.selecting = positions, selecting

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = _write(self.keys, keys, self.offset)
        self.values = _write(self.values, values, self.offset)
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array:
        if window_size is not None:
            raise NotImplementedError("sliding-window attention is not traced")
        seen = self.seen(n)
        if self.selecting:
            return seen
        return mx.where(seen, mx.array(0, self.keys.dtype), mx.array(-mx.inf, self.keys.dtype))

    def seen(self, n: int) -> mx.array:
        """Which keys each of the pass's n rows may attend to (bool)."""
        return self.positions[None] <= self.offset + self.positions[:n, None]

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values


class _TracedRows(_TracedCache):
    """Stands in for one RowKVCache (decoder/cache/batch_cache.py) inside a trace: a batch's rows
    are written at one physical position `start`, each row keeps its own RoPE `offset` (B,),
    and the mask adds the holes (`valid`, (B, buffer), an input of the trace)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, start: mx.array,
                 positions: mx.array, valid: mx.array, selecting: bool) -> None:
        super().__init__(keys, values, offset, positions, selecting)
        self.start, self.valid = start, valid

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = _write(self.keys, keys, self.start)
        self.values = _write(self.values, values, self.start)
        return self.keys, self.values

    def seen(self, n: int) -> mx.array:
        causal = self.positions[None] <= self.start + self.positions[:n, None]
        return causal[None, None] & self.valid[:, None, None, :]


class TracedPasses:
    """The trunk's verify passes through `mx.compile`d functions, one per recording mode (MLX
    keeps a trace per input shape, with the weights it saw: make this after the trunk's modules
    are final). Call `run`; None means "not traceable here, use the stock pass"."""

    def __init__(self, trunk: Any) -> None:
        self.trunk = trunk
        self.broken = False
        self.selecting = getattr(trunk.args, "model_type", "") in SELECTING_MASK
        self._fns = {record: mx.compile(functools.partial(self._forward, record))
                     for record in (False, True)}
        self._rows = mx.compile(self._forward_rows)
        self.rows_broken = False
        # (rows, width) -> whether a batch's pass of that shape is faster untraced here: a
        # replay still launches every kernel, and which way wins differs by shape, so it is
        # timed, not assumed (decoder/tuning/batch_costs.py). Untimed shapes stay traced.
        self.stock_rows: dict[tuple[int, int], bool] = {}
        self.stock_everywhere = False  # (while that timing times the stock passes)
        self._layout: list[int] = []  # per cache: 0 for attention, else its state count
        self._slots: list[int] = []  # per recorder: its cache's index among the recurrent ones

    def _forward(self, record: bool, tokens: mx.array, offset: mx.array, positions: mx.array,
                 *buffers: mx.array) -> tuple[mx.array, ...]:
        caches: list[Any] = []
        at = 0
        for states in self._layout:
            if not states:
                caches.append(_TracedCache(buffers[at], buffers[at + 1], offset, positions,
                                           self.selecting))
            else:
                caches.append(ArraysCache(states))
                caches[-1].cache = list(buffers[at:at + states])
            at += states or 2
        recorders = self.trunk.recorders if record else []
        hidden, logits = recorded(recorders, record, lambda: self.trunk.forward(tokens, caches))
        if record:  # (set while tracing; a replay runs no Python)
            recurrent = [c for c in caches if isinstance(c, ArraysCache)]
            self._slots = [recurrent.index(r.cache) for r in recorders]
        kept = [a for r in recorders for a in r.kept()]
        for recorder in recorders:  # tracers must not outlive the trace
            recorder.release()
        return (hidden, logits, *[a for c in caches for a in arrays(c)], *kept)

    def run(self, tokens: mx.array, cache: list[Any], record: bool = False
            ) -> tuple[mx.array, mx.array] | None:
        """(hidden, logits) of every row of `tokens` (1, T), the caches advanced by T; None
        (caches untouched) where this trunk or cache cannot take the traced pass. record: the
        trunk's recorders keep what a commit replays from, as in a stock pass."""
        attention = [c for c in cache if type(c) is PaddedKVCache]
        if (self.broken or not attention or any(c.keys is None for c in attention)
                or not all(traceable(c) for c in cache)
                or len({(c.offset, c.keys.shape[2]) for c in attention}) != 1):
            return None
        start = attention[0].offset
        end = start + tokens.shape[1]
        for c in attention:
            c.reserve(end, c.keys, c.values)
        length = attention[0].keys.shape[2]
        self._layout = [0 if type(c) is PaddedKVCache else len(c.cache) for c in cache]
        starts = [list(c.cache) for c in cache if type(c) is not PaddedKVCache]
        try:
            out = self._fns[record](tokens, mx.array(start, mx.int32), _positions(length),
                                    *[a for c in cache for a in arrays(c)])
        except (NotImplementedError, ValueError, TypeError, RuntimeError):
            self.broken = True  # a forward that needs the offset as a number: stock passes
            return None
        hidden, logits, *rest = out
        for c in cache:
            if type(c) is PaddedKVCache:
                (c.keys, c.values), c.offset, rest = rest[:2], end, rest[2:]
            else:
                c.cache, rest = list(rest[:len(c.cache)]), rest[len(c.cache):]
        if record:
            recurrent = [c for c in cache if type(c) is not PaddedKVCache]
            for recorder, slot in zip(self.trunk.recorders, self._slots, strict=True):
                taps, named = len(recorder.taps), recorder.exported
                recorder.adopt(recurrent[slot], starts[slot], rest[0], None, rest[1:1 + taps],
                               dict(zip(named, rest[1 + taps:], strict=False)))
                rest = rest[1 + taps + len(named):]
        return hidden, logits

    # -- a batch's passes (decoder/rounds/batch.py) ------------------------------------------------

    def _forward_rows(self, tokens: mx.array, start: mx.array, offset: mx.array,
                      positions: mx.array, valid: mx.array, *buffers: mx.array
                      ) -> tuple[mx.array, ...]:
        caches = [_TracedRows(buffers[i], buffers[i + 1], offset, start, positions, valid,
                              self.selecting) for i in range(0, len(buffers), 2)]
        hidden, logits = self.trunk.forward(tokens, caches)
        return (hidden, logits, *[a for c in caches for a in (c.keys, c.values)])

    def prefers_stock(self, rows: int, width: int) -> bool:
        """Whether a batch's pass of `rows` x `width` tokens goes untraced: as timed at the
        nearest batch size timed at that width (the larger on a tie)."""
        if self.stock_everywhere:
            return True
        timed = [r for r, w in self.stock_rows if w == width]
        if not timed:
            return False
        return self.stock_rows[(min(timed, key=lambda r: (abs(r - rows), -r)), width)]

    def run_rows(self, tokens: mx.array, cache: list[Any], holes: Any
                 ) -> tuple[mx.array, mx.array] | None:
        """A batch's verify pass (tokens (B, T)) traced: (hidden, logits) of every row, the
        buffers written and advanced by T (offsets and holes are the batch's to settle);
        None where the caches are not all a batch's attention caches (recurrent layers step
        their recording outside a trace) or the stock pass was timed faster for this shape."""
        if (self.rows_broken or self.prefers_stock(*tokens.shape[:2]) or not cache
                or not all(type(c) is RowKVCache for c in cache)
                or any(c.keys is None for c in cache)
                or len({(c._idx, c.keys.shape[2]) for c in cache}) != 1):
            return None
        first = cache[0]
        start, end = first._idx, first._idx + tokens.shape[1]
        view = 0
        for c in cache:
            view = c.reserve(end, c.keys, c.values)
        buffers = [a[..., :view, :] for c in cache for a in (c.keys, c.values)]
        try:
            out = self._rows(tokens, mx.array(start, mx.int32), first.offset.astype(mx.int32),
                             _positions(view), holes.over(view), *buffers)
        except (NotImplementedError, ValueError, TypeError, RuntimeError):
            self.rows_broken = True
            return None
        hidden, logits, *rest = out
        for i, c in enumerate(cache):
            c.keys, c.values, c._idx = rest[2 * i], rest[2 * i + 1], end
        return hidden, logits
