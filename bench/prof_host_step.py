"""Host time to build one plain decoding step's graph (diagnostic): ours against mlx-lm's.

A plain step is not traced: Python builds its graph every step, and a pipelined step (ours, as
mlx-lm's generate_step) is only as fast as that build wherever the host is the slower side (a
busy or slow host, a small model, a fast GPU). This times the build alone, nothing evaluated:
our trunk (bounded caches, the quantized layers' kernel twins, as `mtpkit.load` sets a GPU up)
against mlx-lm's model over the same arrays (`bench_gpu.stock`), arms interleaved, on a
Llama-shaped 4-bit trunk of `--layers` layers at small widths (the host's work per layer does
not depend on the widths).

    python bench/prof_host_step.py [--layers 32] [--steps 300] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import oracle_ready, stock  # noqa: E402


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.llama import Model, ModelArgs

    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.sampling import greedy

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    model = oracle_ready(Model, ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=args.layers, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=1024,
        rope_theta=500000.0, tie_word_embeddings=False), 4)
    trunk = Trunk(model)
    use_kernel_linears(trunk.text)
    base = stock(model)
    token = mx.array([[3]])

    def timed(cache: list, step) -> float:
        """Microseconds per step graph; each step's cache write is undone, nothing evaluated."""
        start = time.perf_counter()
        for _ in range(args.steps):
            step(cache)
            for c in cache:
                c.offset -= 1
        return (time.perf_counter() - start) / args.steps * 1e6

    def ours() -> float:
        cache = trunk.make_cache(True)
        trunk(mx.array([[1, 2, 3, 4]]), cache, logits_for=1)
        mx.eval([c.state for c in cache])
        return timed(cache, lambda c: greedy(trunk(token, c, logits_for=1)[1][:, -1]))

    def theirs() -> float:
        cache = make_prompt_cache(base)
        base(mx.array([[1, 2, 3, 4]]), cache=cache)
        mx.eval([c.state for c in cache])
        return timed(cache, lambda c: mx.argmax(base(token, cache=c)[:, -1], axis=-1))

    got: dict[str, list[float]] = {"ours": [], "mlx-lm": []}
    for run in range(args.runs + 1):  # the first run warms up
        for name, arm in (("ours", ours), ("mlx-lm", theirs)):
            us = arm()
            if run:
                got[name].append(round(us))
    ratios = [a / b for a, b in zip(got["ours"], got["mlx-lm"], strict=True)]
    for name, runs in got.items():
        print(f"{name}: median {statistics.median(runs):.0f} us per step graph, runs {runs}")
    print(f"ours / mlx-lm paired: median {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}), {args.layers} layers")


if __name__ == "__main__":
    main()
