"""What one verify pass's attention costs by context and by the mask it is given (diagnostic).

A verify pass of T rows at a long context costs several plain steps on MLX's CUDA backend (issue
49: c(2) 26.5 ms against a 8.0 ms plain step at 16K, 8B 4-bit, H200). The weights are read once
either way, so the difference is attention: MLX picks its kernel by the call's shape and mask
(cuDNN's graph, its split-key vector kernel for fewer than 4 rows without an array mask, or the
unfused fallback). This times `mx.fast.scaled_dot_product_attention` alone, an 8B trunk's
shapes (32 query heads, 8 KV heads, 128 dims, bfloat16), one pass's worth of layers per timing:

- `plain`: one row, the exact keys of a 256-aligned buffer, no mask (a plain step);
- `padded+mask T`: T rows over the padded buffer with an additive mask (our traced passes);
- `exact+causal T`: T rows over the exact keys, mlx-lm's "causal" (stock, each new key length
  builds its own graph: warmed here, so compiling is not counted);
- `row by row T`: T one-row calls, each over its own exact keys, no mask;
- with `--batch B`, a batch's plain step of B rows (`batch_cases`).

Prints medians in ms per pass; `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

HEADS, KV_HEADS, DIM, LAYERS, STEP = 32, 8, 128, 32, 256


def _time(run: Callable[[], list[mx.array]], reps: int) -> float:
    for _ in range(3):
        mx.eval(run())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def cases(length: int, widths: list[int]) -> dict[str, Callable[[], list[mx.array]]]:
    """Each case's pass (LAYERS attention calls) at `length` keys already cached."""
    capacity = -(-(length + max(widths)) // STEP) * STEP
    keys = [mx.random.normal((1, KV_HEADS, capacity, DIM)).astype(mx.bfloat16)
            for _ in range(LAYERS)]
    values = [mx.random.normal((1, KV_HEADS, capacity, DIM)).astype(mx.bfloat16)
              for _ in range(LAYERS)]
    mx.eval(keys, values)
    scale = DIM ** -0.5

    def query(rows: int) -> mx.array:
        return mx.random.normal((1, HEADS, rows, DIM)).astype(mx.bfloat16)

    def sdpa(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | str | None) -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    out: dict[str, Callable[[], list[mx.array]]] = {}
    q1 = query(1)
    out["plain"] = lambda: [sdpa(q1, k[..., :length + 1, :], v[..., :length + 1, :], None)
                            for k, v in zip(keys, values, strict=True)]
    for rows in widths:
        q = query(rows)
        seen = mx.arange(capacity)[None] <= length + mx.arange(rows)[:, None]
        additive = mx.where(seen, 0.0, -mx.inf).astype(mx.bfloat16)
        end = length + rows
        out[f"padded+mask {rows}"] = lambda q=q, a=additive: [
            sdpa(q, k, v, a) for k, v in zip(keys, values, strict=True)]
        out[f"exact+causal {rows}"] = lambda q=q, end=end: [
            sdpa(q, k[..., :end, :], v[..., :end, :], "causal")
            for k, v in zip(keys, values, strict=True)]
        out[f"row by row {rows}"] = lambda q=q, rows=rows: [
            mx.concatenate([sdpa(q[:, :, i:i + 1], k[..., :length + i + 1, :],
                                 v[..., :length + i + 1, :], None) for i in range(rows)], axis=2)
            for k, v in zip(keys, values, strict=True)]
    return out


def batch_cases(length: int, rows: int) -> dict[str, Callable[[], list[mx.array]]]:
    """A batch's plain step: `rows` sequences of one query each at `length` keys, the mask
    and key view mlx-lm's BatchKVCache sends (exact keys, a bool mask) beside ours (a traced
    batch pass: keys padded to a STEP, an additive mask over the padding), each eagerly and
    inside `mx.compile` (where MLX's unfused attention for a masked query row is fused)."""
    capacity = -(-(length + 1) // STEP) * STEP
    shape = (rows, KV_HEADS, capacity, DIM)
    keys = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(LAYERS)]
    values = [mx.random.normal(shape).astype(mx.bfloat16) for _ in range(LAYERS)]
    q = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.bfloat16)
    mx.eval(keys, values, q)
    scale = DIM ** -0.5
    end = length + 1
    exact = mx.ones((rows, 1, 1, end), dtype=mx.bool_)
    seen = mx.broadcast_to(mx.arange(capacity)[None, None, None] < end, (rows, 1, 1, capacity))
    additive = mx.where(seen, 0.0, -mx.inf).astype(mx.bfloat16)

    def layers(q: mx.array, mask: mx.array | None, view: int, *kv: mx.array) -> list[mx.array]:
        return [mx.fast.scaled_dot_product_attention(q, k[..., :view, :], v[..., :view, :],
                                                     scale=scale, mask=mask)
                for k, v in zip(kv[:LAYERS], kv[LAYERS:], strict=True)]

    def with_mask(mask: mx.array | None, view: int) -> Callable[..., list[mx.array]]:
        return lambda q, *kv: layers(q, mask, view, *kv)

    out: dict[str, Callable[[], list[mx.array]]] = {}
    for name, mask, view in ((f"batch {rows} exact, no mask", None, end),
                             (f"batch {rows} exact+bool", exact, end),
                             (f"batch {rows} padded+additive", additive, capacity)):
        eager, traced = with_mask(mask, view), mx.compile(with_mask(mask, view))
        out[name] = lambda f=eager: f(q, *keys, *values)
        out[name + ", traced"] = lambda f=traced: f(q, *keys, *values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="1024,16384,65536")
    parser.add_argument("--widths", default="1,2,4")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=0,
                        help="also a batch's plain step of this many rows (mlx-lm's and ours)")
    parser.add_argument("--out")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    results: dict[str, dict[str, float]] = {}
    for length in (int(c) for c in args.contexts.split(",")):
        results[str(length)] = {}
        runs = cases(length, widths)
        if args.batch:
            runs |= batch_cases(length, args.batch)
        for name, run in runs.items():
            ms = _time(run, args.reps)
            results[str(length)][name] = ms
            print(f"L={length:6d} {name:34s} {ms:8.3f} ms per pass ({LAYERS} layers)", flush=True)
        mx.clear_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "mlx": mx.__version__,
                       "ms_per_pass": results}, f, indent=1)


if __name__ == "__main__":
    main()
