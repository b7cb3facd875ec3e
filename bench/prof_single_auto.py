"""What the single-sequence `--depth auto` chooses, request after request, in one runner.

The four serve loads (held_code, held_memo, edit, code; fresh nonces) decoded alone, in turn,
PASSES times in one process (as `serve --max-batch 1` decodes them), 192 tokens each: the seconds
and tok/s of each, the depths it chose (0: plain steps) and the runner's cost corrections after
it (decoder/tuning/policy.py's CostTable, per timed shape). The CPU batching ratio's one-at-a-time arm
is this path; on the
grafted SmolLM2 in float32 it decoded plain for 133-191 of ~190 rounds in most passes, 47-57 s a
pass (docs/benchmarks-history.md, 2026-11-27, 4d6146c).

    .venv/bin/python bench/prof_single_auto.py out/SmolLM2-135M-mtp [--dtype float32] [--passes 3]
"""

from __future__ import annotations

import argparse
import time

import mtpkit  # noqa: F401  (before mlx: on a CPU it sets MLX's BLAS up first)


def main() -> None:
    from mtpkit.decoder.runner import load
    from mtpkit.verify.loads import real_loads

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--loads", default="held_code,held_memo,edit,code")
    args = ap.parse_args()
    runner = load(args.bundle, dtype=args.dtype)
    loads = real_loads(args.loads.split(","))
    texts = {name: load_.fresh(None) for name, load_ in loads.items()}
    for n in range(args.passes):
        total = 0.0
        for name, load_ in loads.items():
            text = texts[name]
            prompt = runner.render([{"role": "user", "content": text}]) if load_.chat else text
            start = time.perf_counter()
            result = runner.generate(prompt, args.tokens, depth="auto")
            took = time.perf_counter() - start
            total += took
            scales = {k: round(v, 2) for k, v in runner.table().summary().items()}
            print(f"pass {n} {name}: {took:.1f} s, {len(result.tokens) / took:.1f} tok/s, "
                  f"depths {dict(sorted(result.stats.depths.items()))}, corrections {scales}",
                  flush=True)
        print(f"pass {n}: {total:.1f} s", flush=True)


if __name__ == "__main__":
    main()
