"""Does writing a pass's rows into the KV buffers copy them? (diagnostic, issue 49)

A traced verify pass (decoder/model/traced.py) writes its rows into every layer's key and value
buffer with `mx.slice_update` at an array offset, so the trace does not bake the position in.
This times 32 layers x (keys, values) of (1, 8, L, 128) bfloat16 written 4 rows at a time, the
buffers held by nothing else, seven ways: `mx.slice_update` at an array offset eagerly and inside
`mx.compile`, the same with the offset a constant of the trace, a scatter of the rows at their
positions (`mx.put_along_axis`) eagerly and traced, and the static slice assignment one-row
decoding uses (`buffer[..., a:b, :] = rows`), eagerly and traced. Where a way donates the buffer it costs
the rows; where it copies, the whole buffer.
Each way runs twice: back to back, and waiting for the device after each write.

    python bench/prof_kv_update.py --contexts 16384,65536
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx

LAYERS, KV_HEADS, DIM, ROWS = 32, 8, 128, 4


def arms(at: int) -> dict[str, Callable[[list[mx.array], mx.array], list[mx.array]]]:
    def dynamic(start: mx.array, new: mx.array, *buffers: mx.array) -> list[mx.array]:
        return [mx.slice_update(b, new, start[None], axes=(2,)) for b in buffers]

    def constant(new: mx.array, *buffers: mx.array) -> list[mx.array]:
        return [mx.slice_update(b, new, mx.array([at]), axes=(2,)) for b in buffers]

    def assign(buffers: list[mx.array], new: mx.array) -> list[mx.array]:
        for b in buffers:
            b[..., at:at + ROWS, :] = new
        return buffers

    def assign_traced(new: mx.array, *buffers: mx.array) -> list[mx.array]:
        return assign(list(buffers), new)

    def scatter(start: mx.array, new: mx.array, *buffers: mx.array) -> list[mx.array]:
        rows = (start + mx.arange(new.shape[2], dtype=mx.int32))[None, None, :, None]
        rows = mx.broadcast_to(rows, new.shape)
        return [mx.put_along_axis(b, rows, new, axis=2) for b in buffers]

    traced, traced_constant = mx.compile(dynamic), mx.compile(constant)
    traced_scatter, traced_assign = mx.compile(scatter), mx.compile(assign_traced)
    start = mx.array(at, mx.int32)
    return {"eager, array offset": lambda b, new: dynamic(start, new, *b),
            "traced, array offset": lambda b, new: traced(start, new, *b),
            "traced, constant offset": lambda b, new: traced_constant(new, *b),
            "eager, scatter": lambda b, new: scatter(start, new, *b),
            "traced, scatter": lambda b, new: traced_scatter(start, new, *b),
            "static assignment": assign,
            "traced, static assignment": lambda b, new: traced_assign(new, *b)}


def _time(write: Callable, held: dict[str, list[mx.array]], new: mx.array, reps: int,
          settle: bool) -> float:
    """Mean ms of `reps` writes after 3 warm-ups, the buffers donatable each time. settle:
    wait for the device after each write, so nothing the backend still holds from the last
    write keeps this one from donating. (MLX's peak-memory counter does not tell the ways
    apart on CUDA: the time does.)"""
    def step() -> None:
        buffers = held.pop("buffers")  # nothing else holds them
        out = write(buffers, new)
        del buffers
        mx.eval(out)
        if settle:
            mx.synchronize()
        held["buffers"] = out

    for _ in range(3):
        step()
    mx.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    mx.synchronize()
    return 1000 * (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16384,65536")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    for length in (int(c) for c in args.contexts.split(",")):
        held = {"buffers": [mx.zeros((1, KV_HEADS, length, DIM), mx.bfloat16)
                            for _ in range(2 * LAYERS)]}
        new = mx.ones((1, KV_HEADS, ROWS, DIM), mx.bfloat16)
        mx.eval(held["buffers"], new)
        buffer_mb = held["buffers"][0].nbytes / 2**20
        for name, write in arms(length // 2).items():
            for settle in (False, True):
                ms = _time(write, held, new, args.reps, settle)
                label = name + (", settled" if settle else "")
                print(f"L={length:6d} {label:36s} {ms:8.2f} ms per pass ({2 * LAYERS} buffers"
                      f" of {buffer_mb:.1f} MB)", flush=True)
        del held
        mx.clear_cache()


if __name__ == "__main__":
    main()
