"""Per-round latency of MTP decoding on one rank vs a trunk sharded over two (this machine).

A synthetic Qwen3.5 trunk with an MTP head (hidden 1024, 8 layers: linear attention and full
attention, ~100M parameters, float32 so greedy tokens can be compared exactly) runs in three
arms: one process (no --shard), 2 ranks tensor parallel and 2 ranks pipeline parallel, the
2-rank arms started with mlx.launch (ring backend, 127.0.0.1). Each arm loads, warms up, then
runs plain decoding (depth 0) and depth-2 MTP rounds, `--runs` times each, every run with a fresh
nonce prompt. Reported per arm: the median and P95 of one MTP round (draft + verify + commit:
the time between two committed batches) and of one plain step, decode tok/s, the depth-2 tokens
compared with the one-process run, and peak RSS per rank.

    .venv/bin/python bench/bench_distributed.py --workdir /tmp/bench-dist [--runs 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import save, summary  # noqa: E402

SHAPE = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 3072,
         "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 128,
         "linear_value_head_dim": 128, "full_attention_interval": 4}
ARMS = ("one", "tensor", "pipeline")
DEPTH = 2


def build(out: Path) -> Path:
    """The factory's Qwen3.5 bundle (with its MTP head) at SHAPE."""
    from fixtures import configs
    from fixtures.factory import build_mlx

    if out.exists():
        return out
    config = configs.config_for("qwen3_5")
    config["text_config"].update(SHAPE)
    with mock.patch.dict(configs.CONFIGS, {"qwen3_5": config}):
        return build_mlx("qwen3_5", out, quantize=False)


def prompt(run: int, length: int = 96) -> list[int]:
    """A fresh nonce prompt per run (token ids; vocabulary 512)."""
    rng = random.Random(1000 + run)
    return [rng.randrange(3, 512) for _ in range(length)]


def worker(bundle: str, shard: str | None, runs: int, tokens: int, out: str) -> None:
    """One arm, on every rank: rank 0 times; the others follow."""
    from mtpkit.decoder.runner import load
    from mtpkit.decoder.sharded import distributed

    runner = load(bundle, dtype="float32", shard=shard)
    if distributed.is_follower(runner):
        distributed.follow(runner)
        rank = os.environ["MLX_RANK"]
        Path(f"{out}.rank{rank}").write_text(json.dumps({"peak_rss_mb": _rss_mb()}))
        return
    runner.generate(prompt(-1), 16, depth=DEPTH)  # warm-up: every verify width once
    runner.generate(prompt(-2), 16, depth=0)
    record: dict = {"round_s": [], "step_s": [], "mtp_tps": [], "plain_tps": [], "tokens": []}
    for run in range(runs):
        for depth, gaps, tps in ((0, "step_s", "plain_tps"), (DEPTH, "round_s", "mtp_tps")):
            times, ids = [], []
            for piece in runner.stream(prompt(run), tokens, depth=depth):
                times.append(time.perf_counter())
                ids += piece.tokens
                if piece.result is not None:
                    record[tps].append(piece.result.stats.decode_tps)
            times = times[1:-1]  # the first piece ends the prefill; the last only carries stats
            record[gaps] += [b - a for a, b in zip(times, times[1:], strict=False)]
            if depth:
                record["tokens"].append(ids)
    distributed.finish(runner)
    Path(out).write_text(json.dumps({**record, "peak_rss_mb": _rss_mb()}))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_arm(arm: str, bundle: Path, args: argparse.Namespace, port: int) -> dict:
    out = args.workdir / f"{arm}.json"
    own = [sys.executable, __file__, "--worker", str(bundle), arm, str(args.runs),
           str(args.tokens), str(out)]
    if args.keep and out.exists():
        pass  # this arm's record from an earlier, interrupted run
    elif arm == "one":
        subprocess.run(own, check=True)
    else:
        launcher = Path(sys.executable).parent / "mlx.launch"
        subprocess.run([str(launcher), "--hosts", "127.0.0.1", "-n", "2", "--backend", "ring",
                        "--starting-port", str(port), "--", *own], check=True)
    record = json.loads(out.read_text())
    ranks = [record["peak_rss_mb"]]
    if arm != "one":
        ranks.append(json.loads(Path(f"{out}.rank1").read_text())["peak_rss_mb"])
    return {"round_s": summary(record["round_s"]), "step_s": summary(record["step_s"]),
            "mtp_tps": summary(record["mtp_tps"]), "plain_tps": summary(record["plain_tps"]),
            "tokens": record["tokens"], "peak_rss_mb": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=47400)
    parser.add_argument("--keep", action="store_true",
                        help="reuse the arm records an interrupted run left in --workdir")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    bundle = build(args.workdir / "qwen3_5-1024x8")
    arms = {arm: run_arm(arm, bundle, args, args.port + 10 * i) for i, arm in enumerate(ARMS)}
    reference = arms["one"]["tokens"]
    for arm in arms.values():
        arm["tokens_identical_to_one"] = arm.pop("tokens") == reference
    path = save("distributed-cpu", {"shape": SHAPE, "depth": DEPTH, "runs": args.runs,
                                    "tokens": args.tokens, "arms": arms})
    print("| arm | ranks | MTP round ms (median / P95) | plain step ms (median / P95) | "
          "MTP tok/s | plain tok/s | tokens = 1 rank | peak RSS MB per rank |")
    print("|---|---|---|---|---|---|---|---|")
    for name, a in arms.items():
        r, s = a["round_s"], a["step_s"]
        print(f"| {name} | {len(a['peak_rss_mb'])} | {1e3 * r['median']:.1f} / "
              f"{1e3 * r['p95']:.1f} | {1e3 * s['median']:.1f} / {1e3 * s['p95']:.1f} | "
              f"{a['mtp_tps']['median']:.1f} | {a['plain_tps']['median']:.1f} | "
              f"{'yes' if a['tokens_identical_to_one'] else 'NO'} | "
              f"{' / '.join(f'{m:.0f}' for m in a['peak_rss_mb'])} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        bundle, arm, runs, tokens, out = sys.argv[2:7]
        worker(bundle, None if arm == "one" else arm, int(runs), int(tokens), out)
    else:
        main()
