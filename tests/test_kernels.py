"""The verify-row matmul (decoder/kernels.py) against MLX's own ops, on whatever backend runs.

On CUDA the kernel computes these products and must match mx.quantized_matmul within
the tolerance of the activations' dtype; elsewhere verify_matmul must be exactly MLX's op (the
fallback). Either way `supported` has to say which of the two ran, so the same test proves the
kernel on a GPU and the dispatch on a CPU.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mtpkit.decoder import kernels
from mtpkit.decoder.rows import (
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
    use_kernel_linears,
)

TOLERANCE = {mx.bfloat16: 2e-2, mx.float16: 4e-3, mx.float32: 1e-4}


def _close(got: mx.array, want: mx.array, dtype: mx.Dtype) -> None:
    """Relative to the output's scale: a wrong nibble order or group index moves outputs by a
    whole weight's worth (~1/sqrt(K) of the scale), far above the dtype's rounding."""
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    scale = float(np.abs(want).max()) + 1e-6
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) / scale < TOLERANCE[dtype]


@pytest.mark.parametrize("bits", kernels.BITS)
@pytest.mark.parametrize("group_size", kernels.GROUPS)
@pytest.mark.parametrize("rows", [2, 7, 16])  # one per bucket: 18 kernel variants
def test_quantized_rows_match_quantized_matmul(bits: int, group_size: int, rows: int) -> None:
    mx.random.seed(bits * 1000 + group_size + rows)
    n, k = 200, 640  # K not a multiple of 512: the lanes' last pass is partial
    w = mx.random.normal((n, k)) * 0.05
    x = mx.random.normal((1, rows, k)).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w.astype(mx.bfloat16), group_size=group_size, bits=bits)
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size,
                               bits=bits)
    got = kernels.verify_matmul(x, wq, scales, biases, bits, group_size)
    assert kernels.supported(x, bits, group_size) == kernels.cuda_available()
    _close(got, want, mx.bfloat16)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_activation_dtypes(dtype: mx.Dtype) -> None:
    mx.random.seed(3)
    w = (mx.random.normal((96, 256)) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((4, 256)).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
    _close(kernels.verify_matmul(x, wq, scales, biases, 4, 64), want, dtype)


def test_one_row_and_long_inputs_use_mlx_ops() -> None:
    """Plain decoding (one row) and prefill (many rows) never go through the kernel, nor do
    layouts it does not implement."""
    for rows in (1, kernels.MAX_ROWS + 1, 256):
        assert not kernels.supported(mx.zeros((rows, 128), mx.bfloat16), 4, 64)
    assert not kernels.supported(mx.zeros((4, 128), mx.bfloat16), 3, 64)
    assert not kernels.supported(mx.zeros((4, 128), mx.bfloat16), 4, 16)
    assert not kernels.supported(mx.zeros((4, 128), mx.bfloat16), 4, 32, "mxfp4")
    assert not kernels.supported(mx.zeros((4, 120), mx.bfloat16), 4, 8)  # K % 16, group


def test_row_buckets_cover_every_verify_width() -> None:
    assert [kernels.bucket(r) for r in range(2, kernels.MAX_ROWS + 1)] == \
        [4] * 3 + [8] * 4 + [16] * 8


def test_kernel_linears_swap_and_compute_the_same() -> None:
    """The swapped modules keep their packed weights (no re-quantization) and compute what the
    originals compute, for one row, verify rows and a long input; float linears stay."""
    mx.random.seed(5)
    model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 64, bias=False), nn.Linear(64, 8))
    nn.quantize(model, group_size=64, bits=8, class_predicate=lambda p, m: p != "layers.2")
    inputs = [mx.random.normal((1, r, 256)).astype(mx.bfloat16) for r in (1, 4, 40)]
    want = [model(x) for x in inputs]
    packed = model.layers[0].weight
    assert use_kernel_linears(model) == 2
    assert [type(m) for m in model.layers] == [KernelQuantizedLinear] * 2 + [nn.Linear]
    assert model.layers[0].weight is packed
    for x, ref in zip(inputs, want, strict=True):
        _close(model(x), ref, mx.bfloat16)


def test_tied_quantized_output_projection_of_verify_rows() -> None:
    """A tied lm_head is the embedding's as_linear: its twin computes the same logits for one
    row, verify rows and a long input, and looks tokens up as before."""
    mx.random.seed(9)
    embedding = nn.Embedding(300, 128)
    embedding.weight = (embedding.weight * 0.05).astype(mx.bfloat16)
    holder = nn.Sequential(nn.QuantizedEmbedding.from_embedding(embedding, group_size=64, bits=4))
    quantized = holder.layers[0]
    inputs = [mx.random.normal((1, r, 128)).astype(mx.bfloat16) for r in (1, 5, 40)]
    want = [quantized.as_linear(x) for x in inputs]
    ids = mx.array([[3, 299, 0]])
    looked_up = quantized(ids)
    assert use_kernel_linears(holder) == 1
    twin = holder.layers[0]
    assert type(twin) is KernelQuantizedEmbedding and twin.weight is quantized.weight
    assert mx.array_equal(twin(ids), looked_up).item()
    for x, ref in zip(inputs, want, strict=True):
        _close(twin.as_linear(x), ref, mx.bfloat16)
