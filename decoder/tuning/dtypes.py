"""The float dtype a bundle runs in: as asked, or (auto) the one that decodes fastest here.

MLX's CPU backend multiplies half-precision weights by converting them on every matmul, so a
small model can decode several times slower in bfloat16 than in float32, and its MTP verify
passes lose to plain decoding. GPUs read half the bytes
per step in bfloat16. So "auto" keeps the bundle's own dtype on a GPU and, on a CPU, widens to
float32 when a measured matmul says it is clearly faster and the widened weights fit in memory.
The probe (a few milliseconds) is measured once per machine, MLX version and BLAS, then cached:
the same bundle always runs in the same dtype here, so its cost curve and texts stay put.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mtpkit.decoder.options import dtype_option
from mtpkit.decoder.tuning import store as disk

CLEARLY = 1.25  # float32 must beat bfloat16 by this factor to be chosen (noise never flips it)
ROOM = 0.6  # the widened weights may take at most this share of physical memory
PROBE = (1024, 4096)  # a layer's projection; rows as a 4-token verify pass and a plain step


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype to cast to (None: the bundle's own) and, where auto decided, why."""

    dtype: str | None
    reason: str = ""


def choose(dtype: str | None, weights: list[mx.array], quantized: bool) -> DtypeChoice:
    """Resolve `dtype` for weights about to load (lazily: sizes only, nothing read).
    quantized: the bundle keeps its quantized weights (nothing to cast)."""
    if dtype_option(dtype) != "auto":
        return DtypeChoice(dtype)
    half = [w for w in weights if w.dtype in (mx.bfloat16, mx.float16)]
    if quantized or not half or mx.default_device().type != mx.DeviceType.cpu:
        return DtypeChoice(None)
    own = str(half[0].dtype).removeprefix("mlx.core.")
    ratio = _float32_speedup()
    if ratio < CLEARLY:
        return DtypeChoice(None, f"dtype {own}: float32 is not clearly faster on this CPU "
                           f"({ratio:.2f}x)")
    widened = sum(w.size * 4 for w in weights if mx.issubdtype(w.dtype, mx.floating))
    if widened > ROOM * _physical_memory():
        return DtypeChoice(None, f"dtype {own}: float32 would be {ratio:.1f}x faster on this "
                           f"CPU but its {widened / 2**30:.1f} GiB of weights do not fit here")
    return DtypeChoice("float32", f"dtype float32: {ratio:.1f}x faster than {own} on this CPU "
                       f"(--dtype {own} keeps the bundle's)")


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: do not refuse on a guess


def _float32_speedup() -> float:
    """bfloat16 matmul time over float32's on this machine, measured once and cached."""
    from mtpkit.decoder.model.blas import LOADING

    key = f"{mx.__version__}|{LOADING.path if LOADING else None}"
    path = cache_file()
    stored = disk.read(path, "dtype_speed")
    if stored is not None and stored["key"] == key:
        return float(stored["ratio"])
    ratio = _time(mx.bfloat16) / _time(mx.float32)
    with contextlib.suppress(OSError):  # an unwritable cache costs a probe next time
        disk.write(path, {"key": key, "ratio": ratio}, "dtype_speed")
    return ratio


def _time(dtype: mx.Dtype, repeats: int = 7) -> float:
    """Median seconds of a 4-row and a 1-row product with a PROBE-sized weight."""
    w = mx.random.normal(PROBE, key=mx.random.key(0)).astype(dtype)
    xs = [mx.random.normal((rows, PROBE[0]), key=mx.random.key(rows)).astype(dtype)
          for rows in (4, 1)]
    mx.eval(w, *xs)
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        mx.eval(*[x @ w for x in xs])
        if i >= 2:  # two warm-ups
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cache_file() -> Path:
    """Where the probe's result is kept (tests point $MTPKIT_CACHE elsewhere)."""
    return disk.root() / "dtype-speed.json"
