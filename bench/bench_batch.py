"""Many streams at once (issue 33): our batch with MTP (auto) and plain, mlx-lm's BatchGenerator.

1. --oracle (a GPU's mechanics): the Llama-3-8B-shaped 4-bit trunk of bench_gpu.py whose greedy
   continuation is a walk through a random permutation, and a drafter right with per-position
   acceptance 73/48/32% (bench_gpu's oracle, batched: it drafts each row's successor on the
   device). For N streams started together (128-token prompts, --tokens each): aggregate tok/s
   (every stream's tokens over the wall time from the start to the last token), per-stream
   decode tok/s and TTFT P50/P95, for ours batched at --depth auto, ours batched plain and
   mlx-lm's BatchGenerator (all N inserted at once); at one stream also today's single-sequence
   path (Runner.generate, traced verify passes where the GPU has them). Greedy tokens are
   checked equal across arms. `--small`: the same shapes scaled down, to check it on a CPU.
2. --serve BUNDLE (this CPU): 4 clients at once through `mtpkit serve` (the official openai SDK,
   streaming, temperature 0) on the loads, one request per client per load, against a server
   with --max-batch 1 (one at a time); then one request joining 3 running ones against the same
   request on an idle server (TTFT), its prompt cached and fresh. Texts must equal the
   one-at-a-time server's.

    python bench/bench_batch.py --oracle [--streams 1,2,4,8] [--tokens 256] [--runs 2] [--tuned]
    .venv/bin/python bench/bench_batch.py --serve out/SmolLM2-135M-mtp --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import save, summary  # noqa: E402

RATES = (0.73, 0.48, 0.32)
PROMPT = 128


class BatchOracle:
    """bench_gpu's Oracle for a batch: each row drafts its trunk's greedy successor (the walk's
    next token, computed on the device from the row's last token) while a per-row coin keeps
    it right with the RATES' conditional chances, else a wrong token. Costs a few tiny ops."""

    blocks = 1

    def __init__(self, successor: Any, rates: tuple[float, ...], seed: int) -> None:
        import mlx.core as mx

        self.successor, self.vocab = successor, successor.shape[0]
        self.conditional = [rates[0]] + [rates[i] / rates[i - 1] for i in range(1, len(rates))]
        self.key = mx.random.key(seed)
        self.right = None

    def make_cache(self, bounded: bool = False) -> list:
        from mlx_lm.models.cache import KVCache

        return [KVCache()]

    def __call__(self, hidden, tokens, cache, step, last_only=False, pick=None):
        import mlx.core as mx

        rows, width = tokens.shape
        blank = mx.zeros((rows, 1, width, 1), mx.bfloat16)
        cache[0].update_and_fetch(blank, blank)  # the head's cache grows as a real head's
        if pick is not None:
            last = mx.take_along_axis(tokens, pick[:, None], axis=1)[:, 0]
            hidden = mx.take_along_axis(hidden, pick[:, None, None], axis=1)
        else:
            last = tokens[:, -1]
        if step == 0:
            self.right = mx.ones((rows,), mx.bool_)
        chance = self.conditional[step] if step < len(self.conditional) else 0.0
        self.key, sub = mx.random.split(self.key)
        self.right = self.right & (mx.random.uniform(shape=(rows,), key=sub) < chance)
        want = self.successor[last]
        token = mx.where(self.right, want, (want + 1) % self.vocab)
        logits = mx.where(mx.arange(self.vocab)[None, None] == token[:, None, None], 1e9, 0.0)
        return logits, hidden[:, -1:]


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": statistics.median(ordered),
            "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]}


def _report(starts: float, first: list[float], last: list[float], counts: list[int]) -> dict:
    wall = max(last) - starts
    per_stream = [(n - 1) / (b - a) for n, a, b in zip(counts, first, last, strict=True)
                  if b > a]
    return {"aggregate_tps": sum(counts) / wall, "wall_s": wall,
            "per_stream_tps": _percentiles(per_stream),
            "ttft_s": _percentiles([f - starts for f in first]), "tokens": sum(counts)}


def ours(runner, prompts: list[list[int]], tokens: int, depth) -> tuple[dict, list[list[int]]]:
    """Our batch: every prompt at once, at `depth` (auto or 0)."""
    n = len(prompts)
    first, last, out = [0.0] * n, [0.0] * n, [[] for _ in range(n)]
    chosen: dict[int, int] = {}
    start = time.perf_counter()
    for i, piece in runner.stream_batch(prompts, tokens, max_batch=max(n, 1), depth=depth):
        now = time.perf_counter()
        if piece.tokens:
            first[i] = first[i] or now
            last[i] = now
            out[i] += piece.tokens
        if piece.result is not None:
            for d, k in piece.result.stats.depths.items():
                chosen[d] = chosen.get(d, 0) + k
    row = _report(start, first, last, [len(t) for t in out])
    row["depths"] = chosen
    return row, out


def single(runner, prompt: list[int], tokens: int) -> tuple[dict, list[int]]:
    """Today's single-sequence path (Session + Controller), depth auto."""
    start = time.perf_counter()
    first = lastt = 0.0
    out: list[int] = []
    for piece in runner.stream(prompt, tokens, depth="auto"):
        now = time.perf_counter()
        if piece.tokens:
            first = first or now
            lastt = now
            out += piece.tokens
    return _report(start, [first], [lastt], [len(out)]), out


def theirs(model, prompts: list[list[int]], tokens: int) -> tuple[dict, list[list[int]]]:
    """mlx-lm's BatchGenerator, every prompt inserted at once."""
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=max(n, 1),
                         prefill_batch_size=max(n, 1))
    start = time.perf_counter()
    uids = gen.insert(prompts, [tokens] * n)
    index = {u: i for i, u in enumerate(uids)}
    first, last, out = [0.0] * n, [0.0] * n, [[] for _ in range(n)]
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            i = index[r.uid]
            first[i] = first[i] or now
            last[i] = now
            out[i].append(r.token)
    gen.close()
    return _report(start, first, last, [len(t) for t in out]), out


def ideal(table: Any, rows: int, plain_step: float | None = None) -> dict[str, Any]:
    """What the round costs `rows` rows paid here promise at the oracle's acceptance: the median
    paid per depth (decoder/tuning/policy.py's CostTable, shapes (rows, depth + 1, pipelined); 0: a
    plain step; "piped K": pipelined) and the best depth's tokens per second over plain steps'
    (each row commits 1 + a_1 + ... + a_K a round), beside the measured ratio. `plain_step`:
    the plain arm's own step time (seconds), where the batch never stepped plainly here."""
    # two timings at least: a shape's first pass may have compiled a kernel on a GPU (15-44 s)
    cost = {(width - 1, piped): statistics.median(seen)
            for (b, width, piped), seen in table.times.items() if b == rows and len(seen) >= 2}
    plain = cost.get((0, True), cost.get((0, False), plain_step))
    # each depth at its pipelined price where timed (as the batch runs it), else synchronous
    price = {k: cost.get((k, True), cost.get((k, False))) for k in range(1, 9)
             if (k, True) in cost or (k, False) in cost}
    if plain is None or not price:
        return {}
    gain = {k: (1 + sum(RATES[:k])) / c * plain for k, c in price.items()}
    best = max(gain, key=gain.__getitem__)
    return {"round_ms": {(f"piped {k}" if piped else k): round(1000 * c, 2)
                         for (k, piped), c in sorted(cost.items())},
            "ideal_over_plain": round(gain[best], 3), "ideal_depth": best}


def oracle_bench(args: argparse.Namespace) -> dict:
    import mlx.core as mx
    from bench_gpu import SUCCESSOR, llama8b, stock

    from mtpkit.decoder.cache.shapes import bounded_by_default
    from mtpkit.decoder.model.kernels import cuda_available
    from mtpkit.decoder.model.rows import use_few_rows_linears, use_kernel_linears
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.runner import Runner
    from mtpkit.decoder.tuning.costs import measure

    model = llama8b(4, small=args.small)
    trunk = Trunk(model)
    if cuda_available():
        use_kernel_linears(trunk.text)
    elif mx.default_device().type == mx.DeviceType.cpu:
        use_few_rows_linears(trunk.inner)
    if bounded_by_default():
        trunk.use_traced()
    vocab = trunk.args.vocab_size
    runner = Runner(trunk, BatchOracle(SUCCESSOR[id(model)], RATES, seed=0), None)  # type: ignore[arg-type]
    runner._costs = measure(runner)
    if args.tuned:  # as a bundle after `tune --max-batch N`: the batch starts from prices
        from mtpkit.verify.tune import batch_lines

        most = max(int(s) for s in args.streams.split(","))
        runner.batch_costs(most, told=batch_lines())
    plain_runner = Runner(trunk, None, None)
    baseline = stock(model)  # mlx-lm's arm runs its own layers, not our kernel twins
    out: dict[str, Any] = {"curve": runner._costs.to_dict(), "rates": RATES, "streams": {}}
    if trunk.passes is not None:  # batch pass shapes tune found faster untraced (rows, width)
        out["untraced"] = sorted(f"{r},{w}" for (r, w), s in trunk.passes.stock_rows.items() if s)
        print("untraced batch passes:", out["untraced"], flush=True)
    for n in [int(s) for s in args.streams.split(",")]:
        prompts = [[(13 * i + 7 + 101 * s) % vocab for i in range(PROMPT)] for s in range(n)]
        # warm-up, each arm at full length: every traced shape compiled once, and the batch
        # policy's round timings at this size learned, as a running server has them
        ours(runner, prompts, args.tokens, "auto")
        ours(plain_runner, prompts, args.tokens, 0)
        theirs(baseline, prompts, args.tokens)
        arms: dict[str, list[dict]] = {"mtp_auto": [], "plain": [], "mlx_lm": []}
        if n == 1:
            arms["single_auto"] = []
        same = True
        for _ in range(args.runs):  # arms interleaved run by run
            before = ideal(runner.table(), n).get("round_ms")  # what auto starts from
            row, mtp_tokens = ours(runner, prompts, args.tokens, "auto")
            arms["mtp_auto"].append(row | {"prices_before_ms": before})
            row, plain_tokens = ours(plain_runner, prompts, args.tokens, 0)
            arms["plain"].append(row)
            row, base_tokens = theirs(baseline, prompts, args.tokens)
            arms["mlx_lm"].append(row)
            same &= mtp_tokens == plain_tokens == base_tokens
            if n == 1:
                row, alone = single(runner, prompts[0], args.tokens)
                arms["single_auto"].append(row)
                same &= alone == plain_tokens[0]
        med = {arm: statistics.median(r["aggregate_tps"] for r in rows)
               for arm, rows in arms.items()}
        entry = {"arms": arms, "aggregate_tps_median": med,
                 "mtp_over_mlx_lm": med["mtp_auto"] / med["mlx_lm"],
                 "mtp_over_plain": med["mtp_auto"] / med["plain"],
                 "greedy_tokens_identical": same}
        if n == 1:
            entry["batch_over_single"] = med["mtp_auto"] / med["single_auto"]
        steady = statistics.median(r["per_stream_tps"]["p50"] for r in arms["plain"])
        entry |= ideal(runner.table(), n, 1 / steady)
        out["streams"][str(n)] = entry
        print(n, "streams", {k: round(v, 1) for k, v in med.items()},
              f"mtp/mlx_lm {entry['mtp_over_mlx_lm']:.2f}x mtp/plain {entry['mtp_over_plain']:.2f}x"
              f" identical {same}; round ms {entry.get('round_ms')}, ideal "
              f"{entry.get('ideal_over_plain')}", flush=True)
    return out


def serve_bench(args: argparse.Namespace) -> dict:
    from openai import OpenAI

    from fixtures.serving import serve_process
    from mtpkit.verify.loads import real_loads

    loads = real_loads(args.loads.split(","))
    texts = {name: load.fresh(None) for name, load in loads.items()}

    def client(url: str, name: str, results: dict, start: float, text: str | None = None
               ) -> None:
        api = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        load = loads[name]
        kwargs = {"model": "m", "max_tokens": args.tokens, "temperature": 0.0, "stream": True}
        first, times, chunks, tokens = None, [], [], 0
        text = texts[name] if text is None else text
        if load.chat:
            stream = api.chat.completions.create(
                messages=[{"role": "user", "content": text}], **kwargs)
        else:
            stream = api.completions.create(prompt=text, **kwargs)
        for chunk in stream:
            now = time.perf_counter()
            if getattr(chunk, "usage", None) is not None:  # the last chunk carries usage
                tokens = chunk.usage.completion_tokens
            piece = (chunk.choices[0].delta.content if load.chat else chunk.choices[0].text) \
                if chunk.choices else None
            if piece:
                first = first or now
                times.append(now)
                chunks.append(piece)
        end = times[-1] if times else start
        results[name] = {"text": "".join(chunks), "ttft_s": (first or start) - start,
                         "end": end, "first": first or start, "tokens": tokens,
                         "tps": (tokens - 1) / (end - first) if first and end > first else 0.0}

    def together(url: str) -> dict:
        results: dict[str, dict] = {}
        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(url, name, results, start))
                   for name in loads]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = max(r["end"] for r in results.values()) - start
        tps = [r["tps"] for r in results.values()]
        return {"wall_s": wall, "results": results,
                "aggregate_tps": sum(r["tokens"] for r in results.values()) / wall,
                "slowest_over_median_tps": min(tps) / statistics.median(tps)}

    out: dict[str, Any] = {"loads": list(loads), "tokens": args.tokens, "runs": []}
    options = ["--dtype", args.dtype] if args.dtype else []
    with serve_process(Path(args.serve), "--max-batch", "1", *options) as one, \
            serve_process(Path(args.serve), "--max-batch", "4", *options) as four:
        together(one)  # warm-up, each server
        together(four)
        for _ in range(args.runs):
            a, b = together(one), together(four)
            identical = {n: a["results"][n]["text"] == b["results"][n]["text"] for n in loads}
            out["runs"].append({"one_at_a_time": a, "batched": b, "identical": identical,
                                "ratio": a["wall_s"] / b["wall_s"]})
            print(f"4 clients: one at a time {a['wall_s']:.1f} s, batched {b['wall_s']:.1f} s "
                  f"({a['wall_s'] / b['wall_s']:.2f}x; {b['aggregate_tps']:.1f} tok/s); slowest "
                  f"client {b['slowest_over_median_tps']:.2f}x of the median; identical "
                  f"{identical}", flush=True)
        # a request joining three running ones, against the same request on an idle server:
        # its prompt cached (the text the warm-up sent: the prefix cache restores it, so the
        # wait for the round in flight is most of the difference), and a fresh prompt
        # (prefilled whole, as a new conversation's)
        last = list(loads)[-1]
        for kind in ("cached", "fresh"):
            joins, idle = [], []
            for _ in range(args.runs):
                text = None if kind == "cached" else loads[last].fresh(None)
                results: dict[str, dict] = {}
                start = time.perf_counter()
                mates = [threading.Thread(target=client, args=(four, n, results, start))
                         for n in list(loads)[:3]]
                for t in mates:
                    t.start()
                time.sleep(1.0)
                late: dict[str, dict] = {}
                client(four, last, late, time.perf_counter(), text)
                joins.append(late[last]["ttft_s"])
                for t in mates:
                    t.join()
                alone: dict[str, dict] = {}
                text = None if kind == "cached" else loads[last].fresh(None)
                client(four, last, alone, time.perf_counter(), text)
                idle.append(alone[last]["ttft_s"])
            prefix = "" if kind == "cached" else "fresh_"
            out[f"{prefix}join_ttft_s"], out[f"{prefix}idle_ttft_s"] = summary(joins), summary(idle)
            out[f"{prefix}join_over_idle"] = statistics.median(joins) / statistics.median(idle)
    ratios = [r["ratio"] for r in out["runs"]]
    out["aggregate_ratio"] = summary(ratios)
    def ms(key: str) -> str:
        return f"{1000 * out[key]['median']:.0f}"

    print(f"aggregate {statistics.median(ratios):.2f}x; join TTFT {out['join_over_idle']:.2f}x "
          f"of idle (cached prompt: {ms('join_ttft_s')} vs {ms('idle_ttft_s')} ms), "
          f"{out['fresh_join_over_idle']:.2f}x (fresh prompt: {ms('fresh_join_ttft_s')} vs "
          f"{ms('fresh_idle_ttft_s')} ms)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle", action="store_true")
    ap.add_argument("--small", action="store_true", help="scaled-down shapes (a CPU check)")
    ap.add_argument("--tuned", action="store_true",
                    help="--oracle: time batched rounds first, as tune --max-batch does")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--serve", help="a bundle to serve (the CPU part)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"])
    ap.add_argument("--loads", default="held_code,held_memo,edit,code")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tag", default="batch")
    args = ap.parse_args()
    payload = oracle_bench(args) if args.oracle else serve_bench(args)
    print("saved", save(args.tag, payload))


if __name__ == "__main__":
    main()
