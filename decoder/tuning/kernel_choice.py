"""Which verify-row counts the kernel serves, per weight shape: timed on the device, not assumed.

The kernel (decoder/model/kernels.py) reads each packed weight once for all rows, so it beats MLX's
quantized matmul wherever that op re-reads the weights once per row (2-7 rows on CUDA). From 8
rows MLX switches to a tiled kernel whose time barely grows with the rows, while ours does work in
proportion to them, so at 16 rows either may win, by the weight's shape. Batched rounds reach
those widths (8 sequences at depth 1 verify 16 rows). Where the two
cross depends on the GPU and the shape, so each shape's row counts are timed both ways once and
the choice is cached on disk, keyed by device, versions and the kernel's source: a later process
reads the same choice instead of re-timing it, so a seeded generation keeps its numerics.
$MTPKIT_VERIFY_KERNEL_ROWS=all skips the choice (every count through the kernel, as before).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.decoder.model import kernels
from mtpkit.decoder.tuning import store as disk
from mtpkit.decoder.tuning.curve import MIN_REPEATS, PAD_GAIN
from mtpkit.decoder.tuning.store import key_name, versions

MARGIN = PAD_GAIN  # MLX's op takes a row count only where it is this much cheaper: no noise
PRODUCTS = 8  # products per timing, in one eval: one product alone would time the launch
ALL_ROWS = frozenset(range(2, kernels.MAX_ROWS + 1))
FORMAT = 1

Shape = tuple[int, int, int, int, str]  # out features, in features, bits, group size, dtype


def chosen_rows(kernel_ms: dict[int, float], stock_ms: dict[int, float],
                margin: float = MARGIN) -> frozenset[int]:
    """The row counts the kernel keeps: all timed ones but those MLX's op did in under
    `margin` x the kernel's time (near a tie the kernel stays: the choice should not follow
    noise)."""
    return frozenset(r for r, t in kernel_ms.items() if not stock_ms[r] < margin * t)


def shape_of(layer: Any) -> Shape:
    """A kernel twin's (rows, reduction, bits, group, dtype): what its timings depend on."""
    n = layer.weight.shape[0]
    k = layer.scales.shape[-1] * layer.group_size
    return (n, k, layer.bits, layer.group_size, str(layer.scales.dtype).removeprefix("mlx.core."))


def _ms_per_product(product: Callable[[mx.array], mx.array], xs: list[mx.array]) -> float:
    mx.eval([product(x) for x in xs])  # warm-up: compiles a kernel variant the first time
    times = []
    for _ in range(MIN_REPEATS):  # per row count and op; the median counts
        start = time.perf_counter()
        mx.eval([product(x) for x in xs])
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times) / len(xs)


def measure(layer: Any) -> dict[str, dict[int, float]]:
    """Milliseconds per product of 2..MAX_ROWS rows through the kernel and through MLX's op,
    on the layer's own weights."""
    n, k, bits, group, dtype = shape_of(layer)
    w, s, b = layer.weight, layer.scales, layer.biases

    def ours(x: mx.array) -> mx.array:
        return kernels.rows_matmul(x, w, s, b, bits, group)

    def stock(x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group, bits=bits)

    out: dict[str, dict[int, float]] = {"kernel_ms": {}, "stock_ms": {}}
    for rows in sorted(ALL_ROWS):
        xs = [mx.random.normal((rows, k)).astype(getattr(mx, dtype)) for _ in range(PRODUCTS)]
        mx.eval(xs)
        out["kernel_ms"][rows] = _ms_per_product(ours, xs)
        out["stock_ms"][rows] = _ms_per_product(stock, xs)
    return out


def key() -> dict[str, Any]:
    """What a choice depends on: the device, versions, the kernel's source, the margin."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    source = hashlib.sha256((kernels._SOURCE + repr(kernels.ROW_BUCKETS)).encode()).hexdigest()
    return {"device": str(info.get("device_name", "")), "versions": versions(),
            "kernel": source[:16], "margin": MARGIN, "format": FORMAT}


def _path(key: dict[str, Any]) -> Path:
    return disk.root() / "kernels" / f"{key_name(key)}.json"


def _read(path: Path, key: dict[str, Any]) -> dict[str, Any]:
    """The stored timings of `key` by shape (every row count, both ways: the schema's); {}
    for none, invalid (decoder/tuning/store.py says why) or another key."""
    data = disk.read(path, "kernels")
    if data is None or data["key"] != key:
        return {}
    return {name: {kind: {int(r): float(ms) for r, ms in entry[kind].items()}
                   for kind in ("kernel_ms", "stock_ms")}
            for name, entry in data["shapes"].items()}


def _name(shape: Shape) -> str:
    return ",".join(map(str, shape))


def stderr_line(line: str) -> None:
    """What a device's first load says on stderr while it times or compiles (no silent minutes)."""
    print(line, file=sys.stderr, flush=True)


def assign(layers: Iterable[Any], say: Callable[[str], None] = stderr_line
           ) -> dict[Shape, frozenset[int]]:
    """Give every kernel twin in `layers` the row counts its shape keeps the kernel for:
    stored timings where this device has them, else timed now (once per shape) and stored."""
    twins = [t for t in layers if t._fits]
    if not twins or os.environ.get("MTPKIT_VERIFY_KERNEL_ROWS") == "all":
        return {}
    where = key()
    path = _path(where)
    stored = _read(path, where)
    fresh = {}
    for twin in twins:
        name = _name(shape_of(twin))
        if name not in stored and name not in fresh:
            if not fresh:
                say("timing the verify kernel against MLX's quantized matmul for each weight "
                    "shape, 2-16 rows (once per device; kept under $MTPKIT_CACHE/kernels)")
            fresh[name] = measure(twin)
    if fresh:
        stored |= fresh
        with contextlib.suppress(OSError):  # a read-only cache: the choice holds for this run
            disk.write(path, {"key": where, "shapes": {
                name: {kind: {str(r): ms for r, ms in t[kind].items()} for kind in t}
                for name, t in stored.items()}}, "kernels")
    chosen = {}
    for twin in twins:
        shape = shape_of(twin)
        timings = stored[_name(shape)]
        twin.kernel_rows = chosen.setdefault(
            shape, chosen_rows(timings["kernel_ms"], timings["stock_ms"]))
    return chosen
