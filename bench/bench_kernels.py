"""The verify kernel (decoder/kernels.py) against MLX's own ops, layer by layer, on a GPU.

For each Llama-3-8B layer shape (4-bit g64, 8-bit g64 and bf16): milliseconds for 1..16 rows with
MLX's op and with the kernel, medians of synchronous repeats after a warm-up, and the largest
relative difference between the two outputs.

    python bench/bench_kernels.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save  # noqa: E402

SHAPES = {"qkvo": (4096, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}


def _time(fn, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _product(x, packed, bits, group, kernel: bool):
    """A zero-argument function computing x @ W.T with MLX's op or the kernel."""
    import mlx.core as mx

    from mtpkit.decoder import kernels

    if kernel:
        return lambda: kernels.verify_matmul(x, *packed, bits=bits, group_size=group)
    if bits is None:
        return lambda: x @ packed[0].T
    return lambda: mx.quantized_matmul(x, *packed, transpose=True, group_size=group, bits=bits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    args = ap.parse_args()

    import mlx.core as mx

    from mtpkit.decoder import kernels

    rows_list = [int(r) for r in args.rows.split(",")]
    out = {}
    for layout in ("4bit-g64", "8bit-g64", "bf16"):
        for name, (n, k) in SHAPES.items():
            w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
            if layout == "bf16":
                packed = (w,)
                bits = group = None
            else:
                bits, group = int(layout[0]), 64
                packed = mx.quantize(w, group_size=group, bits=bits)
            mx.eval(packed)
            row = {}
            for rows in rows_list:
                x = mx.random.normal((1, rows, k)).astype(mx.bfloat16)
                stock = _product(x, packed, bits, group, kernel=False)
                ours = _product(x, packed, bits, group, kernel=True)
                ref, got = stock(), ours()
                diff = float(mx.max(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))) /
                             (mx.max(mx.abs(ref.astype(mx.float32))) + 1e-6))
                row[rows] = {"mlx_ms": _time(stock, args.repeats),
                             "kernel_ms": _time(ours, args.repeats),
                             "kernel_used": kernels.supported(x, packed[0], bits, group),
                             "max_rel_diff": diff}
            out[f"{layout}:{name}"] = row
            print(layout, name, " ".join(
                f"{r}:{v['mlx_ms']:.3f}/{v['kernel_ms']:.3f}" for r, v in row.items()), flush=True)
    print(f"saved {save('kernels', {'repeats': args.repeats, 'layers': out})}")


if __name__ == "__main__":
    main()
