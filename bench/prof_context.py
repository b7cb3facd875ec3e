"""What a verify pass costs as the context grows, piece by piece (issue 49's diagnosis).

At a context of L tokens (a real prefill), the 8B 4-bit oracle trunk of bench_gpu.py, passes of
T = 1, 2, 4 rows, synchronous, medians after warm-up, in three arms: "stock" (mlx-lm's KVCache,
MLX's ops), "ours" (verify kernel, bounded attention shapes: decoder/cache/shapes.py) and "traced"
(ours, traced once per shape: a GPU's default). Then attention alone, one layer's shapes, by mask
kind (none, "causal", a bool array over exactly L keys, a bool array over the padded view), and
the peak memory and time of each arm's prefill against mlx-lm's own (prefill_step_size 2048).

    python bench/prof_context.py --contexts 1024,16384,65536 [--small] [--arms stock,ours,traced]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import llama8b  # noqa: E402
from common import save  # noqa: E402


def timed(run, passes: int) -> float:
    """Median ms of `run` (which evaluates what it builds), after two warm-up calls."""
    times = []
    for i in range(passes + 2):
        start = time.perf_counter()
        run()
        if i >= 2:
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def prefill_stock(model, ids: list[int], step: int = 2048):
    """mlx-lm's generate_step prefill: chunks of `step` into make_prompt_cache's caches."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for start in range(0, len(ids) - 1, step):
        model(mx.array(ids[start:min(start + step, len(ids) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
    return cache


def passes(call, cache, vocab: int, rows: tuple[int, ...], n: int) -> dict:
    import mlx.core as mx

    out = {}
    for t in rows:
        tokens = mx.array([(5 * i + 1) % vocab for i in range(t)])[None]

        def one(tokens=tokens, t=t) -> None:
            logits = call(tokens, cache)
            mx.eval(mx.argmax(logits[0, -1]))
            for c in cache:
                c.trim(t)

        out[t] = timed(one, n)
    return out


def _queries(contexts: list[int], small: bool, rows: tuple[int, ...]):
    """(L, T, keys, values, q) for one 8B attention layer (32 query heads, 8 KV heads, 128
    wide; scaled down: a CPU smoke run): a STEP-aligned key buffer past L, T query rows."""
    import mlx.core as mx

    from mtpkit.decoder.cache.shapes import padded

    heads, kv = (2, 1) if small else (32, 8)
    for length in contexts:
        keys = mx.random.normal((1, kv, padded(length + 8), 128)).astype(mx.bfloat16)
        values = mx.random.normal(keys.shape).astype(mx.bfloat16)
        for t in rows:
            q = mx.random.normal((1, heads, t, 128)).astype(mx.bfloat16)
            mx.eval(keys, values, q)
            yield length, t, keys, values, q


def _report(label: str, out: dict) -> dict:
    for length, row in out.items():
        print(label, length, {k: round(v, 3) for k, v in row.items()}, flush=True)
    return out


def sdpa_alone(contexts: list[int], small: bool, n: int) -> dict:
    """One attention layer's sdpa by mask kind: none, "causal", a bool array over exactly the
    keys, a bool array over the padded view (what bounded passes send)."""
    import mlx.core as mx

    from mtpkit.decoder.cache.shapes import padded

    out: dict = {}
    for length, t, keys, values, q in _queries(contexts, small, (1, 2, 4)):
        end, view = length + t, padded(length + t)
        k, v = keys[..., :end, :], values[..., :end, :]
        kp, vp = keys[..., :view, :], values[..., :view, :]
        exact = mx.arange(length, end)[:, None] >= mx.arange(end)[None]
        pad = mx.arange(length, end)[:, None] >= mx.arange(view)[None]
        arms = {"none": (k, v, None), "causal": (k, v, "causal"),
                "bool_exact": (k, v, exact), "bool_padded": (kp, vp, pad)}
        for name, (kk, vv, mask) in arms.items():
            if t == 1 and name != "none":
                continue

            def run(q=q, kk=kk, vv=vv, mask=mask) -> None:
                mx.eval(mx.fast.scaled_dot_product_attention(q, kk, vv, scale=128 ** -0.5,
                                                             mask=mask))

            out.setdefault(length, {})[f"T{t}_{name}"] = timed(run, n)
    return _report("sdpa", out)


def sdpa_memory(contexts: list[int], small: bool, rows: int = 2048) -> dict:
    """Peak memory (GB above what was live) and ms of one prefill chunk's sdpa (`rows` queries
    at the end of L keys), by mask kind: what a chunk of a long prompt costs in attention."""
    import mlx.core as mx

    from mtpkit.decoder.cache.shapes import padded

    heads, kv, dim = (2, 1, 128) if small else (32, 8, 128)
    out: dict = {}
    for length in contexts:
        end = length + rows
        keys = mx.random.normal((1, kv, padded(end), dim)).astype(mx.bfloat16)
        values = mx.random.normal(keys.shape).astype(mx.bfloat16)
        q = mx.random.normal((1, heads, rows, dim)).astype(mx.bfloat16)
        mx.eval(keys, values, q)
        view = padded(end)
        arms = {"causal": (keys[..., :end, :], values[..., :end, :], "causal"),
                "bool_padded": (keys[..., :view, :], values[..., :view, :],
                                mx.arange(length, end)[:, None] >= mx.arange(view)[None])}
        row: dict = {}
        for name, (kk, vv, mask) in arms.items():
            mx.synchronize()
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            start = time.perf_counter()
            mx.eval(mx.fast.scaled_dot_product_attention(q, kk, vv, scale=dim ** -0.5, mask=mask))
            row[name] = {"ms": 1000 * (time.perf_counter() - start),
                         "peak_over_gb": (mx.get_peak_memory() - base) / 2**30}
        out[length] = row
        print("sdpa prefill chunk", length, row, flush=True)
    return out


def row_split(contexts: list[int], small: bool, n: int) -> dict:
    """A verify pass's attention as T one-row calls (row i over its own visible keys, the
    decode kernel each) against one T-row call with a bool mask (what bounded passes send)."""
    import mlx.core as mx

    from mtpkit.decoder.cache.shapes import padded

    out: dict = {}
    for length, t, keys, values, q in _queries(contexts, small, (2, 3, 4)):
        end, view = length + t, padded(length + t)
        mask = mx.arange(length, end)[:, None] >= mx.arange(view)[None]

        def one(q=q, mask=mask, view=view, keys=keys, values=values) -> None:
            mx.eval(mx.fast.scaled_dot_product_attention(
                q, keys[..., :view, :], values[..., :view, :], scale=128 ** -0.5, mask=mask))

        def split(t=t, q=q, keys=keys, values=values, length=length) -> None:
            mx.eval(mx.concatenate([mx.fast.scaled_dot_product_attention(
                q[:, :, i:i + 1], keys[..., :length + i + 1, :],
                values[..., :length + i + 1, :], scale=128 ** -0.5) for i in range(t)], axis=2))

        row = out.setdefault(length, {})
        row[f"T{t}_masked"], row[f"T{t}_split"] = timed(one, n), timed(split, n)
    return _report("row split", out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,16384,65536")
    ap.add_argument("--arms", default="stock,ours,traced")
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="a scaled-down trunk (a CPU smoke run)")
    ap.add_argument("--tag", default="prof-context")
    ap.add_argument("--parts", default="sdpa,passes", help="sdpa, memory, split, passes")
    args = ap.parse_args()

    import mlx.core as mx

    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.rounds.session import Session
    from mtpkit.decoder.runner import Runner
    from mtpkit.decoder.sampling import SamplingParams

    contexts = [int(c) for c in args.contexts.split(",")]
    out: dict = {"contexts": contexts, "device": str(mx.default_device())}
    parts = args.parts.split(",")
    if "sdpa" in parts:
        out["sdpa_ms"] = sdpa_alone(contexts, args.small, 4 * args.passes)
    if "memory" in parts:
        out["sdpa_prefill_chunk"] = sdpa_memory(contexts, args.small)
    if "split" in parts:
        out["row_split_ms"] = row_split(contexts, args.small, 4 * args.passes)
    if "passes" not in parts:
        print(f"saved {save(args.tag, out)}")
        return
    model = llama8b(4, args.small)
    vocab = model.args.vocab_size
    runner = Runner(Trunk(model), None, None)
    out["passes_ms"], out["prefill"] = {}, {}
    for length in contexts:
        ids = [(7 * i + 3) % vocab for i in range(length)]
        for arm in args.arms.split(","):
            mx.clear_cache()
            mx.reset_peak_memory()
            start = time.perf_counter()
            if arm == "stock":
                cache = prefill_stock(model, ids)
                call = model
            else:
                use_kernel_linears(runner.trunk.text)
                runner.trunk.use_traced(arm == "traced")
                session = Session(runner.trunk, None, SamplingParams(), 0, bounded=True)
                session.start(ids)
                cache = session.cache

                def call(tokens, cache):
                    return runner.trunk(tokens, cache)[1]
            mx.synchronize()
            prefill_s = time.perf_counter() - start
            peak = mx.get_peak_memory() / 2**30
            active = mx.get_active_memory() / 2**30
            ms = passes(call, cache, vocab, (1, 2, 4), args.passes)
            out["prefill"].setdefault(length, {})[arm] = {
                "seconds": prefill_s, "peak_gb": peak, "active_after_gb": active}
            out["passes_ms"].setdefault(length, {})[arm] = ms
            print(f"L={length} {arm:7} prefill {prefill_s:6.2f} s peak {peak:6.1f} GB active "
                  f"{active:6.1f} GB | c(1,2,4) ms", [round(ms[t], 2) for t in (1, 2, 4)],
                  f"c2/c1 {ms[2] / ms[1]:.2f}", flush=True)
            del cache
            if arm != "stock":
                del session
    print(f"saved {save(args.tag, out)}")


if __name__ == "__main__":
    main()
