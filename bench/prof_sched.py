"""cProfile of our batched plain arm (diagnostic): where the host's time per step goes."""
from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import bench_batch as bb  # noqa: E402


def main() -> None:
    from bench_gpu import llama8b

    from mtpkit.decoder.model.kernels import cuda_available
    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.runner import Runner

    model = llama8b(4, small="--small" in sys.argv)
    trunk = Trunk(model)
    if cuda_available():
        use_kernel_linears(trunk.text)
    n = 8
    prompts = [[(13 * i + 7 + 101 * s) % trunk.args.vocab_size for i in range(bb.PROMPT)]
               for s in range(n)]
    runner = Runner(trunk, None, None)
    bb.ours(runner, prompts, 64, 0)
    prof = cProfile.Profile()
    prof.enable()
    row, _ = bb.ours(runner, prompts, 256, 0)
    prof.disable()
    print(row, flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
