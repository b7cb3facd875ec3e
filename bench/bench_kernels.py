"""The verify kernel (decoder/model/kernels.py) against MLX's own op, layer by layer, on a GPU.

For each Llama-3-8B layer shape (4-bit and 8-bit, groups of 64, bf16 activations): milliseconds
per product for 2..16 rows with MLX's quantized matmul and with the kernel, timed as the runtime
choice times them (decoder/tuning/kernel_choice.py: several products per eval, medians), the row counts
that choice keeps for the kernel, and the largest relative difference between the two outputs.

    python bench/bench_kernels.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save  # noqa: E402

SHAPES = {"q_o": (4096, 4096), "k_v": (1024, 4096), "gate_up": (14336, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}


def main() -> None:
    import mlx.core as mx

    from mtpkit.decoder.model import kernels
    from mtpkit.decoder.tuning import kernel_choice

    out = {}
    for bits in (4, 8):
        for name, (n, k) in SHAPES.items():
            w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
            weight, scales, biases = mx.quantize(w, group_size=64, bits=bits)
            layer = SimpleNamespace(weight=weight, scales=scales, biases=biases, bits=bits,
                                    group_size=64)
            mx.eval(weight, scales, biases)
            timed = kernel_choice.measure(layer)
            diffs = {}
            for rows in (2, 8, 16):
                x = mx.random.normal((rows, k)).astype(mx.bfloat16)
                ref = mx.quantized_matmul(x, weight, scales, biases, transpose=True,
                                          group_size=64, bits=bits).astype(mx.float32)
                got = kernels.rows_matmul(x, weight, scales, biases, bits, 64).astype(mx.float32)
                diffs[rows] = float(mx.max(mx.abs(got - ref)) / (mx.max(mx.abs(ref)) + 1e-6))
            kept = sorted(kernel_choice.chosen_rows(timed["kernel_ms"], timed["stock_ms"]))
            out[f"{bits}bit-g64:{name}"] = {**timed, "kernel_rows": kept, "max_rel_diff": diffs}
            print(f"{bits}-bit {name} {n}x{k} (MLX / kernel ms):", " ".join(
                f"{r}:{timed['stock_ms'][r]:.3f}/{timed['kernel_ms'][r]:.3f}"
                for r in sorted(timed["kernel_ms"])), f"| kernel keeps {kept}", flush=True)
    print(f"saved {save('kernels', {'layers': out})}")


if __name__ == "__main__":
    main()
