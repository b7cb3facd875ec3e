"""MLX's own quantize, on every CPU core.

MLX's CPU backend runs each stream's work on one thread, so a conversion that quantizes on the
default stream (as mlx-lm's does) uses one core. Quantization is independent per row (groups run
along the last axis), so a weight split along axis 0 and quantized chunk by chunk -- each chunk
with the very call mlx's quantized layers make, `mx.quantize(w, group_size, bits, mode=mode)`,
on its own CPU stream -- gives exactly mlx-lm's bytes, and every tensor keeps all cores busy.
Stacked experts are chunked one expert at a time: an expert of a fused gate_up slice is
contiguous, so no chunk pays the copy a strided slice would need. The chunks are written back
to back (writer.Rows), never concatenated."""

from __future__ import annotations

import os
from functools import cache

import mlx.core as mx

from mtpkit.convert.writer import Rows

MAX_STREAMS = 8


@cache
def _cpu_streams() -> tuple[mx.Stream, ...]:
    return tuple(mx.new_stream(mx.cpu)
                 for _ in range(max(1, min(os.cpu_count() or 1, MAX_STREAMS))))


def quantize_rows(weight: mx.array, group_size: int, bits: int, mode: str = "affine"
                  ) -> tuple[mx.array | Rows, ...]:
    """mx.quantize(weight, group_size, bits, mode=mode) as (weight, scales[, biases]), each
    computed in axis-0 chunks spread over the CPU streams (on a GPU: one plain call)."""
    streams = _cpu_streams() if mx.default_device() == mx.cpu else ()
    rows = weight.shape[0] if weight.ndim >= 2 else 0
    chunks = rows if weight.ndim >= 3 else min(len(streams), rows)
    if len(streams) < 2 or chunks < 2:
        return tuple(mx.quantize(weight, group_size, bits, mode=mode))
    bounds = [rows * i // chunks for i in range(chunks + 1)]
    per_chunk = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        with mx.stream(streams[i % len(streams)]):
            per_chunk.append(mx.quantize(weight[lo:hi], group_size, bits, mode=mode))
    return tuple(Rows(list(parts)) for parts in zip(*per_chunk, strict=True))
