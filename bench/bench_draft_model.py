"""Draft models on a CPU (issue 51): a model of the same family drafting for a real bundle,
against our plain decoding, in one process.

Arms, interleaved run by run after a warm-up of each: plain (ours, depth 0) and dK (the draft
model drafting K tokens a round, draft "model"). Per arm and load: steady decode tok/s (the
first `--drop` tokens dropped), tokens per round and acceptance per draft position; medians and
spread (min..max) over `--runs`. Beside each dK its ideal speedup,
E[tokens per round] / ((c(K + 1) + K * d) / s): c(T) one verify pass of T tokens, d one draft
model step, s one plain step, each timed here after the load's prompt: what the measured
acceptance would give if a round cost only its passes. Greedy tokens are checked equal to plain's.

Loads: verify/loads.py's real content (`code`: standard-library source to continue; `memo`: a
chat request), each with a seeded nonce so no prefix cache helps. Progress on stderr; JSON:
`--out DIR`/draft-model.json.

    .venv/bin/mtpkit convert out/SmolLM2-135M-mlx /tmp/SmolLM2-4bit -q --q-bits 4
    .venv/bin/python bench/bench_draft_model.py --bundle out/SmolLM2-135M-mlx \\
        --draft /tmp/SmolLM2-4bit --dtype float32 --runs 3 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from bench_context import commit, log  # noqa: E402
from bench_decode import load_ids, steady_tps, timed_stream  # noqa: E402

import mtpkit  # noqa: E402
from mtpkit.verify.loads import real_loads  # noqa: E402
from mtpkit.verify.record import machine  # noqa: E402

REPS = 15  # timings per pass kind (the median is kept)


def median_s(step: Any) -> float:
    """The median seconds of `step()` (it evaluates what it builds), after one untimed call."""
    step()
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pass_costs(runner: Any, ids: list[int], depths: list[int]) -> dict[str, float]:
    """Seconds of one plain step, one draft model step and each verify pass c(K + 1), after
    `ids` (the caches rolled back after each timing)."""
    trunk, drafter = runner.trunk, runner.drafter
    cache = trunk.make_cache()
    trunk(mx.array([ids]), cache, logits_for=1)
    mx.eval([c.state for c in cache])
    dcache = drafter.make_cache()
    drafter.feed(mx.array([ids]), dcache)
    mx.eval([c.state for c in dcache])

    def verify(width: int) -> Any:
        def step() -> None:
            _, logits = trunk(mx.array([ids[-width:]]), cache, logits_for=width)
            mx.eval(logits)
            for c in cache:
                c.trim(width)
        return step

    def draft() -> None:
        mx.eval(drafter.logits(mx.array([ids[-1:]]), dcache))
        for c in dcache:
            c.trim(1)

    out = {"plain_s": median_s(verify(1)), "draft_s": median_s(draft)}
    for k in depths:
        out[f"verify_{k + 1}_s"] = median_s(verify(k + 1))
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, default=Path("out/SmolLM2-135M-mlx"))
    ap.add_argument("--draft", type=Path, required=True, help="the draft model's bundle")
    ap.add_argument("--dtype", default="float32", help="the target's load dtype")
    ap.add_argument("--keep-quantized", action="store_true",
                    help="run the draft model's quantized weights as they are (default: "
                    "dequantized on a CPU, as load does)")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--loads", default="code,memo")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--drop", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    runner = mtpkit.load(args.bundle, dtype=args.dtype)
    runner.load_draft_model(args.draft, dequantize=not args.keep_quantized)
    loads = real_loads(args.loads.split(","))
    arms = ["plain"] + [f"d{k}" for k in depths]
    rng = random.Random(0)
    prompts = {name: [load_ids(runner, load, load.fresh(rng)) for _ in range(args.runs + 1)]
               for name, load in loads.items()}
    rows: dict[str, Any] = {}
    for name, ids_per_run in prompts.items():
        costs = pass_costs(runner, ids_per_run[0], depths)
        log(f"{name}: {len(ids_per_run[0])} prompt tokens; pass costs (ms): "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in costs.items()))
        seen: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
        for run, ids in enumerate(ids_per_run):  # run 0: the warm-up, not kept
            plain_tokens = None
            for arm in arms:
                depth = 0 if arm == "plain" else int(arm[1:])
                tokens, times, result = timed_stream(runner, ids, args.tokens, depth,
                                                     draft="model")
                if arm == "plain":
                    plain_tokens = tokens
                elif tokens != plain_tokens:
                    raise SystemExit(f"{name} {arm}: greedy tokens differ from plain's")
                stats = result.stats
                rounds = stats.verify_calls
                row = {"tps": steady_tps(times, args.drop),
                       "per_round": (len(tokens) - 1) / rounds if rounds else 1.0,
                       "acceptance": stats.acceptance_by_depth}
                if run:
                    seen[arm].append(row)
                log(f"  run {run} {arm}: {row['tps']:.1f} tok/s, "
                    f"{row['per_round']:.2f} tokens/round")
        plain = spread([r["tps"] for r in seen["plain"]])
        table = {"plain": {"tps": plain}}
        for k in depths:
            got = seen[f"d{k}"]
            per_round = statistics.median(r["per_round"] for r in got)
            round_s = costs[f"verify_{k + 1}_s"] + k * costs["draft_s"]
            table[f"d{k}"] = {
                "tps": spread([r["tps"] for r in got]),
                "speedup": spread([r["tps"] / p["tps"] for r, p in zip(got, seen["plain"],
                                                                        strict=True)]),
                "ideal": per_round / (round_s / costs["plain_s"]),
                "tokens_per_round": per_round,
                "acceptance": [statistics.median(a) for a in zip(
                    *(r["acceptance"] for r in got), strict=False)]}
        rows[name] = {"prompt_tokens": len(prompts[name][0]), "costs": costs, "arms": table}
    doc = {"bench": "draft_model", "commit": commit(), "machine": machine(),
           "bundle": str(args.bundle), "draft": str(args.draft), "dtype": args.dtype,
           "draft_quantized": args.keep_quantized, "tokens": args.tokens, "drop": args.drop,
           "runs": args.runs, "loads": rows, "command": " ".join(sys.argv)}
    print(json.dumps(doc, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "draft-model.json").write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
