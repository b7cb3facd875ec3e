"""The benchmarks' mlx-lm arms run mlx-lm's own layers: our verify-kernel twins replace a
trunk's quantized layers in place, and a baseline sharing that model would run our kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_gpu import llama8b, stock  # noqa: E402

from mtpkit.decoder.model.rows import _KernelTwin, use_kernel_linears  # noqa: E402
from mtpkit.decoder.model.trunk import Trunk  # noqa: E402


def test_the_mlx_lm_arm_runs_stock_layers_over_the_same_weights() -> None:
    model = llama8b(4, small=True)
    assert use_kernel_linears(Trunk(model).text) > 0
    copy = stock(model)
    twins = [name for name, m in model.named_modules() if isinstance(m, _KernelTwin)]
    assert twins and not any(isinstance(m, _KernelTwin) for _, m in copy.named_modules())
    ours, theirs = dict(model.named_modules()), dict(copy.named_modules())
    for name in twins:  # the same packed arrays (no copy of the weights), in mlx-lm's class
        assert type(theirs[name]).__name__ in ("QuantizedLinear", "QuantizedEmbedding")
        assert theirs[name].weight is ours[name].weight
        assert theirs[name].scales is ours[name].scales
    one = mx.array([[3]])  # one row: both take MLX's own op, so the logits agree bit for bit
    assert mx.array_equal(model(one), copy(one)).item()
