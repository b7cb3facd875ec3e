"""Where a batch's time goes (diagnostic): per scheduler step kind, wall ms, at N rows."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import bench_batch as bb  # noqa: E402


def run(runner, prompts, tokens, depth, label):
    from mtpkit.decoder.batch import Batch
    from mtpkit.decoder.scheduler import Scheduler

    for _warm in (True, False):
        sch = Scheduler(Batch(runner.trunk, runner.head), len(prompts), runner.batch_paid)
        for p in prompts:
            sch.add(runner.prepare(p, tokens, depth=depth))
        kinds: dict[str, list[float]] = {}
        total = 0
        start = time.perf_counter()
        while sch:
            kind = ("spec" if sch.spec is not None else "piped" if sch.stretch is not None
                    else "other")
            t0 = time.perf_counter()
            events = sch.step()
            dt = time.perf_counter() - t0
            kind = ("spec" if sch.spec is not None else "piped" if sch.stretch is not None
                    else kind)
            n = sum(len(e.tokens) for e in events)
            total += n
            kinds.setdefault(f"{kind}/{sch.rows}", []).append(dt * 1000)
        wall = time.perf_counter() - start
    print(label, f"{total / wall:.1f} tok/s wall {wall:.2f}s",
          {k: (len(v), round(statistics.median(v), 2), round(sum(v))) for k, v in kinds.items()},
          flush=True)


def main() -> None:
    import mlx.core as mx
    from bench_gpu import SUCCESSOR, llama8b

    from mtpkit.decoder.costs import measure
    from mtpkit.decoder.kernels import cuda_available
    from mtpkit.decoder.rows import use_kernel_linears
    from mtpkit.decoder.runner import Runner
    from mtpkit.decoder.shapes import bounded_by_default
    from mtpkit.decoder.trunk import Trunk

    model = llama8b(4, small="--small" in sys.argv)
    trunk = Trunk(model)
    if cuda_available():
        use_kernel_linears(trunk.text)
    if bounded_by_default():
        trunk.use_traced()
    vocab = trunk.args.vocab_size
    runner = Runner(trunk, bb.BatchOracle(SUCCESSOR[id(model)], bb.RATES, seed=0), None)
    runner._costs = measure(runner)
    for n in (4, 8):
        prompts = [[(13 * i + 7 + 101 * s) % vocab for i in range(bb.PROMPT)] for s in range(n)]
        for depth in (0, 1, 2, 3, "auto"):
            run(runner, prompts, 256, depth, f"{n} rows depth {depth}")
        mx.clear_cache()


if __name__ == "__main__":
    main()
