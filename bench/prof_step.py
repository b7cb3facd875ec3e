"""Where a batched plain step's time goes (diagnostic): mlx-lm's BatchKVCache pass against our
Batch's, on the same model object, the same rows and contexts, each step timed alone
(synchronous: host build + device) and pipelined (the next step queued before the last is read,
as both generators run). Variants of ours isolate the traced pass and the padded key view.

    python bench/prof_step.py [--rows 4,8] [--widths 1,2] [--steps 128] [--small]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mtpkit  # noqa: E402,F401  (sets MLX up before mlx is imported)

WARM = 8


def timings(step: Callable, y, steps: int) -> dict[str, float]:
    """ms per step: median and P95 of synchronous steps, their host build alone, and the mean
    of a pipelined run."""
    import mlx.core as mx

    for _ in range(WARM):
        y = step(y)
        mx.eval(y)
    sync, host = [], []
    for _ in range(steps):
        t = time.perf_counter()
        y = step(y)
        host.append(time.perf_counter() - t)
        mx.eval(y)
        sync.append(time.perf_counter() - t)
    t = time.perf_counter()
    queued = step(y)
    for _ in range(steps):
        current, queued = queued, step(queued)
        current.tolist()
    queued.tolist()
    piped = (time.perf_counter() - t) / (steps + 1)
    sync.sort()
    return {"sync_ms": round(1000 * statistics.median(sync), 2),
            "sync_p95_ms": round(1000 * sync[int(0.95 * (len(sync) - 1))], 2),
            "host_ms": round(1000 * statistics.median(host), 2),
            "piped_ms": round(1000 * piped, 2)}


def theirs(model, prompts: list[list[int]]):
    """mlx-lm's own caches: each prompt prefilled alone, merged into BatchKVCaches."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from mtpkit.decoder.rounds.session import STREAM

    singles = []
    for p in prompts:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([p]), cache=cache))
        singles.append(cache)
    cache = [BatchKVCache.merge([s[i] for s in singles]) for i in range(len(singles[0]))]

    def step(y):
        with mx.stream(STREAM):
            logits = model(y[:, None], cache=cache)
            y = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
        mx.async_eval(y)
        return y
    return step


def ours(trunk, prompts: list[list[int]], bounded: bool | None, width: int = 1):
    """Our Batch, each row a session prefilled alone and joined, stepped as plain_steps does;
    width > 1: rounds of `width` positions every row keeps (a depth width-1 round, all drafts
    accepted), built as the batch's rounds are."""
    import mlx.core as mx

    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.rounds.session import STREAM, Session
    from mtpkit.decoder.sampling import SamplingParams

    batch = Batch(trunk, None, bounded)
    for p in prompts:
        session = Session(trunk, None, SamplingParams(), 0, bounded=bounded)
        session.start(p)
        batch.join(session)
    keep = mx.full(len(prompts), width, mx.int32)

    def step(y):
        with mx.stream(STREAM):
            _, logits = batch._pass(mx.repeat(y[:, None], width, axis=1), keep, width)
            batch._settle(keep, width, 0)
            y = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
        mx.async_eval(y)
        return y
    return step


def main() -> None:
    import mlx.core as mx
    from bench_gpu import llama8b, stock

    from mtpkit.decoder.model.kernels import cuda_available
    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.model.trunk import Trunk

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4,8")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--widths", default="1")
    ap.add_argument("--exact", action="store_true", help="also unpadded key views")
    ap.add_argument("--stock", action="store_true", help="no kernel twins")
    args = ap.parse_args()
    model = llama8b(4, small=args.small)
    trunk = Trunk(model)
    if cuda_available() and not args.stock:
        use_kernel_linears(trunk.text)
    vocab = trunk.args.vocab_size
    baseline = stock(model)  # mlx-lm's arm runs its own layers, not our kernel twins
    out = {}
    for n in [int(r) for r in args.rows.split(",")]:
        prompts = [[(13 * i + 7 + 101 * s) % vocab for i in range(args.prompt)]
                   for s in range(n)]
        first = mx.array([p[-1] for p in prompts], mx.int32)
        arms = {"mlx-lm": lambda prompts=prompts: theirs(baseline, prompts)}
        for width in [int(w) for w in args.widths.split(",")]:
            for traced in (True, False):
                for bounded in (None, False) if args.exact else (None,):
                    name = f"ours w{width} {'traced' if traced else 'untraced'}" + \
                        ("" if bounded is None else " exact keys")
                    arms[name] = (lambda t=traced, b=bounded, w=width, prompts=prompts:
                                  (trunk.use_traced(t), ours(trunk, prompts, b, w))[1])
        for name, make in arms.items():
            row = timings(make(), first, args.steps)
            out[f"{n} rows {name}"] = row
            print(f"{n} rows {name:28s} {json.dumps(row)}", flush=True)
        trunk.use_traced(True)
    Path("prof_step.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
