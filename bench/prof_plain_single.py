"""Where one sequence's plain decoding loses to stock mlx-lm's (diagnostic, issue 49: H200,
8B 4-bit oracle, our plain 0.84x / 0.77x of mlx-lm's generate_step at 1K / 16K, paired).

Arms interleaved per run at one context, decode tok/s after `--drop` tokens, greedy:
- `mlx-lm`: mlx-lm's generate_step over a stock copy of the model (bench_context's arm);
- `mlx-lm-loop`: the least loop over the same copy: its own caches, a step queued before the
  last is read, argmax (what generate_step's own work adds, by difference);
- `mlx-lm-2streams`: that loop with each step on a stream of its own and the next step's
  input made on the default stream (what our plain steps did before 2026-11-30);
- `mlx-lm-twins`: generate_step over the model our trunk wraps (its quantized layers our
  kernel twins, decoder/model/rows.py);
- `ours`: our plain decoding as users get it (Runner.stream, depth 0);
- `session`: our Session's plain steps alone (what the runner's loop adds, by difference);
- `session-stock`: the same over a trunk of the stock copy (what the twins cost);
- `session-unbounded`: the same with mlx-lm's own KV caches (what bounded caches cost).

    python bench/prof_plain_single.py --context 1024 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_context import Arm, oracle_setup, run_mlx_lm, run_ours  # noqa: E402
from bench_decode import steady_tps  # noqa: E402
from bench_gpu import stock  # noqa: E402
from prof_auto_plain import session_steps  # noqa: E402

ARMS = ("mlx-lm", "mlx-lm-loop", "mlx-lm-2streams", "mlx-lm-twins", "ours", "session", "session-stock",
        "session-unbounded")


def least_loop(model, ids: list[int], tokens: int, drop: int, streams: bool = False
               ) -> tuple[float, list[int]]:
    """mlx-lm's model and caches in the least pipelined greedy loop; says the host's ms per
    step (graph built and queued) beside the step's period: near it, the host is the bound.
    `streams`: each step on a stream of its own, its input reshaped on the default stream."""
    import contextlib

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    own = mx.new_thread_local_stream(mx.default_device())

    mx.clear_cache()
    cache = make_prompt_cache(model)
    prompt = mx.array(ids)[None]
    for at in range(0, len(ids) - 1, 2048):
        model(prompt[:, at:min(at + 2048, len(ids) - 1)], cache=cache)
        mx.eval([c.state for c in cache])

    host = []

    def step(y: mx.array) -> mx.array:
        start = time.perf_counter()
        with mx.stream(own) if streams else contextlib.nullcontext():
            out = mx.argmax(model(y, cache=cache)[:, -1], axis=-1)
            mx.async_eval(out)
        host.append(time.perf_counter() - start)
        return out

    y = step(prompt[:, -1:])
    times, out = [], []
    for _ in range(tokens):
        nxt = step(y[None])
        out.append(int(y.item()))
        times.append(time.perf_counter())
        y = nxt
    tps = steady_tps(times, drop)
    kind = "2 streams" if streams else "one stream"
    print(f"  ({kind}: host {1e3 * statistics.median(host[drop:]):.2f} ms a step of "
          f"{1e3 / tps:.2f})", flush=True)
    return tps, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drop", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a scaled-down trunk (a CPU check)")
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    from mtpkit.decoder.cache.shapes import bounded_by_default
    from mtpkit.decoder.model.trunk import Trunk

    setup = oracle_setup("llama8b", args.small, bounded_by_default())
    model = setup.runner.trunk.model
    stock_trunk = Trunk(stock(model))
    ids = setup.prompt(args.context)
    arms = args.arms.split(",")
    runs: dict[str, list[float]] = {name: [] for name in arms}
    for run in range(args.runs + 1):  # the first run warms up
        for name in arms:
            walk = setup.ready(ids, args.tokens, run)
            if name in ("mlx-lm", "mlx-lm-twins"):
                row = run_mlx_lm(setup.stock if name == "mlx-lm" else model, ids, args.tokens,
                                 args.drop, None, 0, {}, run)
                tps, out = row["decode_tps"], row["tokens"]
            elif name in ("mlx-lm-loop", "mlx-lm-2streams"):
                tps, out = least_loop(setup.stock, ids, args.tokens, args.drop,
                                      name == "mlx-lm-2streams")
            elif name == "ours":
                row = run_ours(setup.runner, Arm("plain"), ids, args.tokens, args.drop,
                               setup.draft, 0, {}, run)
                tps, out = row["decode_tps"], row["tokens"]
            else:
                trunk = stock_trunk if name == "session-stock" else setup.runner.trunk
                tps, out = session_steps(trunk, None, ids, args.tokens, args.drop,
                                         False if name == "session-unbounded" else None)
            same = "" if walk is None or out == walk else "  TOKENS DIFFER"
            print(f"{'warm-up' if not run else f'run {run}'} {name:24s} {tps:7.1f} tok/s{same}",
                  flush=True)
            if run:
                runs[name].append(tps)
    base = runs.get("mlx-lm")
    for name, got in runs.items():
        paired = (f", {statistics.median(g / b for g, b in zip(got, base, strict=True)):.2f}x "
                  "mlx-lm paired") if base else ""
        print(f"{name:24s} median {statistics.median(got):7.1f} ({min(got):.1f}-{max(got):.1f})"
              f" tok/s{paired}")


if __name__ == "__main__":
    main()
