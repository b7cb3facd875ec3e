"""What MLX's CUDA backend compiles the first time a quantized matmul of each row count runs.

One 4096 x 4096 bf16 weight, quantized (group 64, 4 or 8 bits), multiplied with 1-40, 64, 65,
..., 2048 rows in a fresh process: the first product at each count, the second, and the kernel
files MLX's cache folder ($MLX_PTX_CACHE_DIR, else <temp>/mlx/<version>/ptx) gained. A count
whose first product took seconds compiled a variant (decoder/tuning/jit_warmup.py compiles them at
load). Run it on a machine whose cache is empty to see the compile times:

    python bench/probe_jit.py [--bits 4,8]
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time

import mtpkit  # noqa: F401  (imported before mlx: on a CPU it sets MLX's BLAS up first)

ROWS = (*range(1, 41), 64, 65, 128, 129, 256, 257, 512, 513, 1024, 2048)


def cached() -> set[str]:
    base = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "mlx",
                                                                "*", "ptx")
    return set(glob.glob(os.path.join(base, "*")))


def main() -> None:
    import mlx.core as mx

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="4")
    args = ap.parse_args()
    seen = cached()
    for bits in (int(b) for b in args.bits.split(",")):
        w = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=bits)
        mx.eval(wq, s, b)
        for rows in ROWS:
            x = mx.random.normal((rows, 4096)).astype(mx.bfloat16)
            mx.eval(x)
            times = []
            for _ in range(2):
                start = time.perf_counter()
                mx.eval(mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64,
                                            bits=bits))
                times.append(time.perf_counter() - start)
            new = sorted(os.path.basename(p) for p in cached() - seen if p.endswith(".ptx"))
            seen = cached()
            if times[0] > 0.5 or new:
                print(f"{bits}-bit, {rows} rows: first {times[0]:.2f} s, second "
                      f"{1000 * times[1]:.2f} ms, compiled {new}", flush=True)
    print("done")


if __name__ == "__main__":
    main()
