"""What a sampled round's sampling and acceptance cost, against mlx-lm's sampler on one token.

Issue 32's target: at temperature 0.6 / top_p 0.95 / top_k 20 on Qwen3.5's 248,320-token
vocabulary, a depth-3 round's sampling and acceptance together (3 draft rows filtered and drawn,
4 target rows filtered, the acceptance rule, the round's one host read) cost no more than
mlx-lm's `make_sampler` on one plain token with the same settings (mlx-lm's own
`logits - logsumexp`, then its sampler, then `.item()`). Arms, interleaved, on the same logits:

- `mlx_lm_plain`: the baseline above.
- `round`: the decoder's device path (decoder/sampling.candidates, decoder/acceptance).
- `plain`: the decoder's plain step with the same filter (candidates on one row, one draw).
- `host_round`: the path before issue 32, for the record: each draft row through mlx-lm's
  chain and copied to the host in float64 (one read per draft), then the 4 target rows.
- `draft_row`, `target_rows`, `rule`: the round's parts alone (each read back), to see where
  its time goes.

    .venv/bin/python bench/bench_sampling.py --runs 30
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save, summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--tag", default="sampling")
    args = ap.parse_args()

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from mtpkit.decoder.rounds import acceptance
    from mtpkit.decoder.sampling import (
        Candidates,
        SamplingParams,
        candidate_width,
        candidates,
        probabilities,
    )

    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    sampler = make_sampler(args.temperature, args.top_p, top_k=args.top_k)
    depth = args.depth
    mx.random.seed(0)
    # logits like a language model's: most of the mass on a few dozen tokens
    target = mx.random.normal((depth + 1, args.vocab)) * 2.5
    drafts_logits = mx.random.normal((depth, args.vocab)) * 2.5
    mx.eval(target, drafts_logits)
    key = [mx.random.key(1)]

    def split() -> mx.array:
        key[0], sub = mx.random.split(key[0])
        return sub

    def mlx_lm_plain() -> None:
        row = target[:1]
        sampler(row - mx.logsumexp(row, axis=-1, keepdims=True)).item()

    def uniforms(*shape: int) -> mx.array:
        return mx.random.uniform(shape=shape, key=split())

    def plain() -> None:
        row = candidates(target[:1], params)
        row.draw(uniforms(1, row.width)).item()

    def device_round() -> None:
        width = candidate_width(params, args.vocab)
        noise = uniforms(depth * width + depth + width)  # the round's draws, as the decoder
        rows = [candidates(drafts_logits[i:i + 1], params, drafter=True) for i in range(depth)]
        drafts = mx.concatenate([row.draw(noise[None, i * width:(i + 1) * width])
                                 for i, row in enumerate(rows)])
        q = Candidates.concat(rows)
        verdict = acceptance.accept_sampled(drafts, q, candidates(target, params),
                                            noise[depth * width:])
        mx.concatenate([drafts, verdict]).tolist()

    def host_round() -> None:
        for i in range(depth):
            probabilities(drafts_logits[i:i + 1], params)
        probabilities(target, params)

    fixed_q = Candidates.concat([candidates(drafts_logits[i:i + 1], params, drafter=True)
                                 for i in range(depth)])
    fixed_p = candidates(target, params)
    fixed_drafts = fixed_q.draw(uniforms(*fixed_q.probs.shape))
    mx.eval(fixed_q.probs, fixed_p.probs, fixed_drafts)

    def draft_row() -> None:  # one draft's filter and draw, read back
        row = candidates(drafts_logits[:1], params, drafter=True)
        row.draw(uniforms(1, row.width)).tolist()

    def target_rows() -> None:  # the K+1 target rows' filter, read back
        mx.eval(candidates(target, params).probs)

    def rule() -> None:  # the acceptance rule alone, on filtered rows
        noise = uniforms(depth + fixed_p.width)
        acceptance.accept_sampled(fixed_drafts, fixed_q, fixed_p, noise).tolist()

    arms: dict[str, Callable[[], None]] = {"mlx_lm_plain": mlx_lm_plain, "round": device_round,
                                           "plain": plain, "host_round": host_round,
                                           "draft_row": draft_row, "target_rows": target_rows,
                                           "rule": rule}
    for fn in arms.values():  # warm-up: kernels built, pages touched
        fn()
    times: dict[str, list[float]] = {name: [] for name in arms}
    start = time.perf_counter()
    try:
        for run in range(args.runs):
            for name, fn in arms.items():
                begin = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - begin)
            left = (time.perf_counter() - start) / (run + 1) * (args.runs - run - 1)
            print(f"\rrun {run + 1}/{args.runs}, ~{left:.0f} s left", end="", file=sys.stderr)
    except KeyboardInterrupt:
        print("\ninterrupted: keeping the runs measured so far", file=sys.stderr)
    print(file=sys.stderr)
    stats = {name: summary([t * 1e3 for t in ts]) for name, ts in times.items() if ts}
    base = stats["mlx_lm_plain"]["median"]
    result = {
        "settings": {"vocab": args.vocab, "depth": depth, "temperature": args.temperature,
                     "top_p": args.top_p, "top_k": args.top_k, "runs": len(times["round"])},
        "ms": stats,
        "round_over_mlx_lm_plain": stats["round"]["median"] / base,
        "plain_over_mlx_lm_plain": stats["plain"]["median"] / base,
        "host_round_over_mlx_lm_plain": stats["host_round"]["median"] / base,
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                     "python": platform.python_version()},
        "device": str(mx.default_device()),
    }
    for name, s in stats.items():
        print(f"{name:>13}: median {s['median']:7.2f} ms  p95 {s['p95']:7.2f} ms  "
              f"({s['median'] / base:.2f}x mlx-lm's sampler on one token)")
    print(f"saved {save(args.tag, result)}")


if __name__ == "__main__":
    main()
