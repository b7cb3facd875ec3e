"""Why `--depth auto` decoding plainly at a long context runs slower than the plain arm
(diagnostic, issue 49: H200, 8B oracle, 16K: auto plain in 93-95 of 95 steps at 0.74x of plain).

Four arms interleaved per run at one context, decode tok/s after `--drop` tokens:
- `plain`: `Runner.stream(depth=0)`, as bench_context's plain arm;
- `auto`: `Runner.stream(depth="auto")`, as its auto arm (the depths it chose beside);
- `spec-session steps`: a speculative session's own pipelined plain steps, no policy (what auto's
  stretches run, hiddens owed to the head);
- `plain-session steps`: a plain session's pipelined steps, no policy.
If the two sessions' steps run alike and auto is slower, the policy's path costs it (stretch
boundaries, probes); if the speculative session's steps are slower, the session does.

    python bench/prof_auto_plain.py --context 16384 --runs 3
    python bench/prof_auto_plain.py --small --context 1024 --runs 3   # steps of a few ms

`--profile N`: one more auto and one more plain arm under cProfile, the N functions with most
own time each (where a plain-deciding auto spends host time a plain session does not).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_context import Arm, oracle_setup, run_ours  # noqa: E402
from bench_decode import steady_tps  # noqa: E402


def session_steps(trunk, head, ids: list[int], tokens: int, drop: int,
                  bounded: bool | None = None) -> tuple[float, list[int]]:
    """Decode tok/s of a started session's pipelined plain steps (with a `head`, a speculative
    session's: hiddens owed to the head), and its tokens, the prompt's next one first."""
    import mlx.core as mx

    from mtpkit.decoder.rounds.session import Session
    from mtpkit.decoder.sampling import SamplingParams

    mx.clear_cache()
    session = Session(trunk, head, SamplingParams(), 0 if head is None else 1, bounded=bounded)
    out, times = [session.start(ids)], []
    for token in session.plain_steps(tokens - 1):
        times.append(time.perf_counter())
        out.append(token)
    return steady_tps(times, drop), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--drop", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small", action="store_true",
                    help="a small trunk: a CPU check, or on a GPU steps of a few ms (where "
                         "bench_families' 4-layer trunks saw auto's plain steps fall behind)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then profile one auto and one plain arm: the N dearest functions")
    args = ap.parse_args()
    from mtpkit.decoder.cache.shapes import bounded_by_default

    setup = oracle_setup("llama8b", args.small, bounded_by_default())  # traced where load traces
    ids = setup.prompt(args.context)
    rows: dict[str, list[float]] = {}
    for run in range(args.runs):
        for name in ("plain", "auto", "spec-session steps", "plain-session steps"):
            setup.ready(ids, args.tokens, run)
            if name in ("plain", "auto"):
                row = run_ours(setup.runner, Arm(name), ids, args.tokens, args.drop, setup.draft,
                               0, {}, run)
                tps, extra = row["decode_tps"], row.get("depths", "")
            else:
                head = setup.runner.head if name.startswith("spec") else None
                tps, _ = session_steps(setup.runner.trunk, head, ids, args.tokens, args.drop)
                extra = ""
            rows.setdefault(name, []).append(tps)
            print(f"run {run + 1} {name:20s} {tps:7.1f} tok/s {extra}", flush=True)
    plain = rows["plain"]
    for name, got in rows.items():
        paired = statistics.median(g / p for g, p in zip(got, plain, strict=True))
        print(f"{name:20s} median {statistics.median(got):7.1f} ({min(got):.1f}-{max(got):.1f}) "
              f"tok/s, {paired:.2f}x plain paired")
    for name in ("auto", "plain") if args.profile else ():
        profiled(setup, ids, args, name)


def profiled(setup, ids: list[int], args: argparse.Namespace, name: str) -> None:
    """One `name` arm under cProfile: its tok/s (profiled) and its dearest functions by own time."""
    import cProfile
    import pstats

    setup.ready(ids, args.tokens, args.runs)
    profile = cProfile.Profile()
    profile.enable()
    row = run_ours(setup.runner, Arm(name), ids, args.tokens, args.drop, setup.draft, 0, {},
                   args.runs)
    profile.disable()
    print(f"\nprofiled {name}: {row['decode_tps']:.1f} tok/s {row.get('depths', '')}")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
