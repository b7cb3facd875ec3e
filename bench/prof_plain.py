"""Our batched plain step against mlx-lm's (diagnostic): host time per step, traced or not."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import bench_batch as bb  # noqa: E402


def timed_ours(runner, prompts, tokens, label):
    from mtpkit.decoder.rounds.batch import Batch

    host = [0.0]
    real_pass, real_settle = Batch._pass, Batch._settle

    def pass_(self, *a, **k):
        t = time.perf_counter()
        out = real_pass(self, *a, **k)
        host[0] += time.perf_counter() - t
        return out

    def settle(self, *a, **k):
        t = time.perf_counter()
        real_settle(self, *a, **k)
        host[0] += time.perf_counter() - t

    Batch._pass, Batch._settle = pass_, settle
    try:
        for _ in range(2):
            host[0] = 0.0
            row, _ = bb.ours(runner, prompts, tokens, 0)
    finally:
        Batch._pass, Batch._settle = real_pass, real_settle
    steps = tokens
    print(label, f"{row['aggregate_tps']:.1f} tok/s, wall {row['wall_s']:.2f} s, host build "
          f"{1000 * host[0] / steps:.2f} ms/step (pass + settle)", flush=True)


def main() -> None:
    from bench_gpu import llama8b, stock

    from mtpkit.decoder.model.kernels import cuda_available
    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.runner import Runner

    model = llama8b(4, small="--small" in sys.argv)
    trunk = Trunk(model)
    if cuda_available() and "--stock" not in sys.argv:
        use_kernel_linears(trunk.text)
    vocab = trunk.args.vocab_size
    baseline = stock(model)  # mlx-lm's arm runs its own layers, not our kernel twins
    for n in (4, 8):
        prompts = [[(13 * i + 7 + 101 * s) % vocab for i in range(bb.PROMPT)] for s in range(n)]
        trunk.use_traced(False)
        timed_ours(Runner(trunk, None, None), prompts, 256, f"{n} rows ours untraced")
        trunk.use_traced(True)
        timed_ours(Runner(trunk, None, None), prompts, 256, f"{n} rows ours traced")
        for _ in range(2):
            row, _ = bb.theirs(baseline, prompts, 256)
        print(f"{n} rows mlx-lm {row['aggregate_tps']:.1f} tok/s, wall {row['wall_s']:.2f} s",
              flush=True)


if __name__ == "__main__":
    main()
