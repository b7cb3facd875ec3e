"""What multiplying verify rows weight-first (decoder/model/rows.py) is worth, paired in one process.

The same prompts (no nonce, so both arms decode the same text and accept the same drafts), stock
nn.Linear and FewRowsLinear alternating run by run; plain and depth-1 tok/s, and what a depth-1
round costs in plain steps ((1 + accepted per round) / depth-1 tok/s * plain tok/s).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 .venv/bin/python \
        bench/bench_verify_rows.py --bundle GRAFTED --loads held_code,held_memo
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import load_ids, steady_tps, timed_stream  # noqa: E402
from common import save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True, help="a bundle with an MTP head")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--drop", type=int, default=32)
    ap.add_argument("--loads", default="held_code,held_memo")
    ap.add_argument("--tag", default="verify-rows")
    args = ap.parse_args()

    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    import mtpkit
    from mtpkit.decoder.model.blas import loaded_blas
    from mtpkit.decoder.model.rows import FewRowsLinear, use_few_rows_linears
    from mtpkit.verify.loads import real_loads

    runner = mtpkit.load(args.bundle, dtype="float32")
    modules = [runner.trunk.inner, runner.head]

    def stock() -> None:
        for module in modules:
            swaps = []
            for name, m in module.named_modules():
                if isinstance(m, FewRowsLinear):
                    linear = nn.Linear(1, 1, bias="bias" in m)
                    linear.update(m.parameters())
                    swaps.append((name, linear))
            module.update_modules(tree_unflatten(swaps))

    def few() -> None:
        for module in modules:
            use_few_rows_linears(module)

    def decode(ids: list[int], depth: int) -> tuple[float, list[int], float]:
        tokens, times, result = timed_stream(runner, ids, args.max_tokens, depth)
        accepted = result.stats.acceptance_by_depth[0] if depth else 0.0
        return steady_tps(times, args.drop), tokens, accepted

    rows = {}
    for name, load in real_loads(args.loads.split(",")).items():
        ids = load_ids(runner, load, load.text)
        for depth in (0, 1):  # warm-up
            decode(ids, depth)
        arms: dict[str, dict[str, list[float]]] = {"stock": {}, "weight_first": {}}
        same = True
        for _ in range(args.runs):
            for arm, setup in (("stock", stock), ("weight_first", few)):
                setup()
                plain, plain_tokens, _ = decode(ids, 0)
                mtp, tokens, accepted = decode(ids, 1)
                same &= tokens == plain_tokens
                for key, value in (("plain", plain), ("depth1", mtp), ("accepted", accepted)):
                    arms[arm].setdefault(key, []).append(value)
        row = {"greedy_tokens_identical": same}
        for arm, samples in arms.items():
            plain, mtp = (statistics.median(samples[k]) for k in ("plain", "depth1"))
            accepted = statistics.mean(samples["accepted"])
            row[arm] = {"plain_tps": plain, "depth1_tps": mtp, "depth1_over_plain": mtp / plain,
                        "accepted": accepted, "round_in_plain_steps": (1 + accepted) / mtp * plain}
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    payload = {"bundle": str(args.bundle), "runs": args.runs, "max_tokens": args.max_tokens,
               "drop": args.drop, "blas": loaded_blas(), "loads": rows}
    print(f"saved {save(args.tag, payload)}")


if __name__ == "__main__":
    main()
