"""Compile MLX's CUDA kernels at load, for every row count decoding reaches, not mid-serve.

MLX's CUDA backend compiles some kernels with NVRTC the first time they run: its quantized
matmul one variant per tile, picked by the row count, and our verify kernel (decoder/model/kernels.py)
one per row bucket. Each of the matmul's variants (8-16, 17-32 and 33+ rows) takes tens of
seconds to compile, and a batch that first reaches a wider round mid-serve stalls every client
that long. So on CUDA the loader runs one product of each
quantized layout (bits, group size, mode, activation dtype) at every row count a batch's rounds
and a prefill can reach, on the layout's smallest layer and through the layer's own product (the
kernel where it serves those rows, MLX's op elsewhere). A variant depends on the layout and the
rows, not on the weight's shape, so that compiles everything decoding will run. MLX keeps what
it compiled on disk ($MLX_PTX_CACHE_DIR, else a temp folder): a later load reads them there
instead of compiling. The first warm-up of a layout on a machine says so on stderr before it starts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.decoder.tuning import kernel_choice
from mtpkit.decoder.tuning import store as disk
from mtpkit.decoder.tuning.kernel_choice import stderr_line
from mtpkit.decoder.tuning.store import key_name

# every width of a batch's rounds (up to 16 rows x depth 3, 8 x 7); powers of two for prefills
ROWS = (*range(1, 65), 128, 256, 512, 1024, 2048)
SLOW_S = 2.0  # a product that took longer compiled something: said as it happens

Layout = tuple[int, int, str, str]  # bits, group size, mode, activation dtype


def layout_of(layer: Any) -> Layout:
    """What a compiled variant depends on besides the rows."""
    dtype = str(layer.scales.dtype).removeprefix("mlx.core.")
    return (layer.bits, layer.group_size, getattr(layer, "mode", "affine"), dtype)


def _marker(layout: Layout) -> Path:
    """A file that says this layout was warmed under the kernel choice's key (device, versions,
    the kernel's source: a changed kernel compiles anew)."""
    return disk.root() / "warmed" / key_name(_key(layout))


def _key(layout: Layout) -> dict[str, Any]:
    return {**kernel_choice.key(), "layout": list(layout)}


def warm(layers: Iterable[Any], say: Callable[[str], None] = stderr_line,
         rows: Iterable[int] = ROWS) -> dict[Layout, float]:
    """Run every row count of `rows` through the smallest layer of each quantized layout among
    `layers` (kernel twins: decoder/model/rows.py); returns the seconds each layout took."""
    smallest: dict[Layout, Any] = {}
    for layer in layers:
        layout = layout_of(layer)
        if layout not in smallest or layer.weight.size < smallest[layout].weight.size:
            smallest[layout] = layer
    took = {}
    for layout, layer in smallest.items():
        marker = _marker(layout)
        found = disk.read(marker, "warmed")
        if found is None or found["key"] != _key(layout):
            say(f"compiling MLX's CUDA kernels for {layout[0]}-bit weights (group "
                f"{layout[1]}, {layout[3]}) at every row count decoding uses: the first "
                "time on this machine, up to a few minutes; MLX keeps them on disk")
        k = layer.scales.shape[-1] * layer.group_size
        start = time.perf_counter()
        for count in rows:
            began = time.perf_counter()
            mx.eval(layer._product(mx.zeros((count, k), getattr(mx, layout[3]))))
            if (spent := time.perf_counter() - began) > SLOW_S:
                say(f"  compiled the {count}-row product in {spent:.0f} s")
        took[layout] = time.perf_counter() - start
        with contextlib.suppress(OSError):  # a read-only cache: the next load says it again
            disk.write(marker, {"key": _key(layout)}, "warmed")
    return took
