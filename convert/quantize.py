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
from mtpkit.loaders.findings import UserError

MAX_STREAMS = 8
# mlx-lm's (group size, bits) when an option leaves them out, per mode (quantize_model).
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


@cache
def supported(bits: int, group_size: int, mode: str) -> bool:
    """Whether this MLX quantizes at (bits, group size, mode): asked of mx.quantize itself on
    one tiny row, so the answer is the installed release's, not a table that ages."""
    try:
        mx.eval(mx.quantize(mx.zeros((1, 4 * max(group_size, 32))), group_size=group_size,
                            bits=bits, mode=mode))
    except (ValueError, RuntimeError):
        return False
    return True


def check_quantization(bits: int | None, group_size: int | None, mode: str, what: str) -> None:
    """Refuse, before any work, a quantization MLX cannot do (a raw mx.quantize error deep
    inside a conversion otherwise), naming what it can do in that mode."""
    if mode not in MODE_DEFAULTS:
        raise UserError("quant.unsupported", f"{what}: unknown mode {mode!r}",
                        f"choose one of {', '.join(MODE_DEFAULTS)}")
    default_group, default_bits = MODE_DEFAULTS[mode]
    bits, group_size = bits or default_bits, group_size or default_group
    if supported(bits, group_size, mode):
        return
    by_groups: dict[tuple[int, ...], list[str]] = {}
    for b in range(1, 9):
        groups = tuple(g for g in (16, 32, 64, 128) if supported(b, g, mode))
        if groups:
            by_groups.setdefault(groups, []).append(str(b))
    fits = "; ".join(f"{'/'.join(b)} bits at group size {'/'.join(map(str, g))}"
                     for g, b in by_groups.items())
    raise UserError("quant.unsupported", f"{what}: MLX cannot quantize {bits}-bit with group size "
                    f"{group_size} in mode {mode}", f"{mode} takes {fits}")


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
