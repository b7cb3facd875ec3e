"""The verify-row matmul (decoder/model/kernels.py) against MLX's own ops, on whatever backend runs.

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

from fixtures.numerics import break_products_over
from mtpkit.decoder.model import kernels
from mtpkit.decoder.model.rows import (
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
    dequantize_where_wrong,
    use_kernel_linears,
)
from mtpkit.decoder.tuning import jit_warmup, kernel_choice

TOLERANCE = {mx.bfloat16: 2e-2, mx.float16: 4e-3, mx.float32: 1e-4}


def _close(got: mx.array, want: mx.array, dtype: mx.Dtype, roundings: int = 1) -> None:
    """Relative to the output's scale: a wrong nibble order or group index moves outputs by a
    whole weight's worth (~1/sqrt(K) of the scale), far above the dtype's rounding (`roundings`:
    how many times a value was rounded to the dtype on the way)."""
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    scale = float(np.abs(want).max()) + 1e-6
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) / scale < roundings * TOLERANCE[dtype]


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


def test_mlx_takes_a_row_count_only_where_clearly_faster() -> None:
    kernel = {2: 1.0, 8: 1.0, 12: 1.0, 16: 1.0}
    stock = {2: 2.0, 8: 0.95, 12: 0.89, 16: 0.5}  # a tie-ish 8 stays with the kernel
    assert kernel_choice.chosen_rows(kernel, stock) == {2, 8}


def _twin(n: int = 64, k: int = 128) -> KernelQuantizedLinear:
    mx.random.seed(3)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(k, n, bias=False), group_size=64, bits=4)
    return KernelQuantizedLinear(layer)


def test_a_twin_leaves_rows_outside_its_choice_to_mlx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the choice gave a row count to MLX's op, the twin computes exactly that op; at
    its other counts it calls the kernel (a spy here, so this holds on a CPU too)."""
    calls: list[int] = []

    def spy(x: mx.array, *args: object) -> mx.array:
        calls.append(x.size // x.shape[-1])
        return mx.zeros((*x.shape[:-1], 64), x.dtype)

    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    monkeypatch.setattr(kernels, "rows_matmul", spy)
    twin = _twin()
    twin.kernel_rows = frozenset({8})
    x4 = mx.random.normal((1, 4, 128)).astype(mx.bfloat16)
    want = mx.quantized_matmul(x4, twin.weight, twin.scales, twin.biases, transpose=True,
                               group_size=64, bits=4)
    assert mx.array_equal(twin(x4), want).item() and calls == []
    batch = x4.reshape(4, 1, 128)  # four one-row sequences: one product of four rows
    assert mx.array_equal(twin(batch), want.reshape(4, 1, 64)).item() and calls == []
    twin(mx.random.normal((1, 8, 128)).astype(mx.bfloat16))
    assert calls == [8]


@pytest.mark.parametrize("shape", [(4, 1, 128), (4, 5, 128), (1, 40, 128), (1, 1, 128)])
def test_mlx_op_gets_one_matrix_of_rows(monkeypatch: pytest.MonkeyPatch, shape: tuple) -> None:
    """Every product of several rows a twin leaves to MLX's op reaches it as one (rows, K)
    matrix: a batch of sequences handed over with its batch axis would be one product per
    sequence (each reading the weight), at any width, verify rows beyond the kernel's included.
    One row (a plain step) goes as the stock layer hands it, with nothing more to build. Same
    values."""
    seen: list[tuple] = []
    real = mx.quantized_matmul

    def spy(x: mx.array, *args: object, **kwargs: object) -> mx.array:
        seen.append(x.shape)
        return real(x, *args, **kwargs)

    twin = _twin()
    twin.kernel_rows = frozenset()
    x = mx.random.normal(shape).astype(mx.bfloat16)
    want = real(x, twin.weight, twin.scales, twin.biases, transpose=True, group_size=64, bits=4)
    monkeypatch.setattr(mx, "quantized_matmul", spy)
    got = twin(x)
    rows = shape[0] * shape[1]
    assert seen == [(rows, 128) if rows > 1 else shape] and got.shape == (*shape[:2], 64)
    assert mx.array_equal(got, want).item()


def test_each_shape_is_timed_once_and_its_choice_kept_on_disk(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Twins of one shape share a timing; a later load reads the stored choice instead of
    timing again (so it cannot flip), another device times anew, and an unreadable store is
    timed again, not an error. $MTPKIT_VERIFY_KERNEL_ROWS=all keeps every count."""
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path))
    timed: list[tuple] = []

    def fake(layer: object) -> dict[str, dict[int, float]]:
        timed.append(kernel_choice.shape_of(layer))
        wide = layer.weight.shape[0] > 64  # MLX's op wins the wide layer from 9 rows
        return {"kernel_ms": {r: 1.0 for r in kernel_choice.ALL_ROWS},
                "stock_ms": {r: 0.5 if wide and r > 8 else 3.0 for r in kernel_choice.ALL_ROWS}}

    monkeypatch.setattr(kernel_choice, "measure", fake)
    twins = [_twin(), _twin(), _twin(n=256)]
    said: list[str] = []
    chosen = kernel_choice.assign(twins, said.append)
    assert len(timed) == 2 and len(chosen) == 2
    assert len(said) == 1 and "once per device" in said[0]  # said before timing, once
    assert twins[0].kernel_rows == twins[1].kernel_rows == kernel_choice.ALL_ROWS
    assert twins[2].kernel_rows == frozenset(range(2, 9))

    again = [_twin(n=256)]
    kernel_choice.assign(again, said.append)
    assert len(timed) == 2 and again[0].kernel_rows == frozenset(range(2, 9))
    assert len(said) == 1  # nothing to time: nothing said

    stores = list((tmp_path / "kernels").glob("*.json"))
    assert len(stores) == 1
    stores[0].write_text("{not json")
    kernel_choice.assign([_twin(n=256)])
    assert len(timed) == 3

    key = kernel_choice.key()
    monkeypatch.setattr(kernel_choice, "key", lambda: {**key, "device": "another GPU"})
    kernel_choice.assign([_twin(n=256)])
    assert len(timed) == 4

    monkeypatch.setenv("MTPKIT_VERIFY_KERNEL_ROWS", "all")
    kept = [_twin(n=256)]
    assert kernel_choice.assign(kept) == {} and kept[0].kernel_rows == kernel_choice.ALL_ROWS
    assert len(timed) == 4


def test_warm_up_runs_every_row_count_once_per_layout(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Each quantized layout runs every row count once, through the product of its smallest
    layer (a compiled variant depends on the layout and the rows, not on the shape); the first
    warm-up of a layout says so before it starts, a later one does not; a product that took
    long is said as it happens."""
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path))
    ran: list[tuple[int, int]] = []
    twins = [_twin(n=256), _twin(n=64), _twin(n=128, k=256)]
    mx.random.seed(4)
    eight = nn.QuantizedLinear.from_linear(nn.Linear(128, 64, bias=False), group_size=64, bits=8)
    twins.append(KernelQuantizedLinear(eight))
    for twin in twins:
        real = twin._product

        def product(x: mx.array, twin=twin, real=real) -> mx.array:
            ran.append((twin.bits, twin.weight.shape[0] * twin.weight.shape[1]))
            return real(x)
        twin._product = product
    said: list[str] = []
    rows = (1, 3, 9, 20)
    took = jit_warmup.warm(twins, said.append, rows)
    assert sorted(took) == [(4, 64, "affine", "float32"), (8, 64, "affine", "float32")]
    smallest4 = twins[1].weight.shape[0] * twins[1].weight.shape[1]
    assert sorted(ran) == sorted([(4, smallest4)] * 4 + [(8, eight.weight.size)] * 4)
    banners = [line for line in said if "first time on this machine" in line]
    assert len(banners) == 2, said  # (a GPU also says each product that really compiled)
    assert all(" product in " in line for line in said if line not in banners)

    ran.clear()
    monkeypatch.setattr(jit_warmup, "SLOW_S", -1.0)  # every product "compiled something"
    said.clear()
    jit_warmup.warm(twins, said.append, rows)
    assert len(ran) == 8 and not any("first time" in line for line in said)
    assert [line.split()[2] for line in said] == ["1-row", "3-row", "9-row", "20-row"] * 2


def test_kernel_linears_warm_up_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's swap compiles every row count on CUDA (after the kernel choice), and
    nowhere else."""
    warmed: list[int] = []
    monkeypatch.setattr(jit_warmup, "warm", lambda twins: warmed.append(len(twins)))
    monkeypatch.setattr(kernel_choice, "assign", lambda twins: {})
    model = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 64))
    nn.quantize(model, group_size=64, bits=4)
    monkeypatch.setattr(kernels, "cuda_available", lambda: False)
    use_kernel_linears(model)
    assert warmed == []
    again = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 64))
    nn.quantize(again, group_size=64, bits=4)
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    use_kernel_linears(again)
    assert warmed == [2]


def test_layers_mlx_multiplies_wrongly_run_dequantized(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where MLX's op is right every quantized layer stays; where it is wrong for a shape, that
    shape's layers (linear and tied output projection alike) become float layers computing
    what the quantized ones should, and the others stay packed."""
    mx.random.seed(11)
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128, bias=False),
                          nn.Embedding(512, 128))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)
    inputs = [mx.random.normal((1, r, 128)).astype(mx.bfloat16) for r in (1, 5, 40)]
    ids = mx.array([[0, 511, 7]])
    want = [(model.layers[0](x), model.layers[2].as_linear(x)) for x in inputs]
    looked_up = model.layers[2](ids)
    said: list[str] = []
    assert dequantize_where_wrong(model, said.append) == 0 and not said
    break_products_over(monkeypatch, 128)
    assert dequantize_where_wrong(model, said.append) == 2
    assert [type(m) for m in model.layers] == [nn.Linear, nn.QuantizedLinear, nn.Embedding]
    assert "for 2 weight shape(s): 2 layer(s) run dequantized" in said[0]
    for x, (linear, tied) in zip(inputs, want, strict=True):  # weights rounded once more
        _close(model.layers[0](x), linear, mx.bfloat16, roundings=2)
        _close(model.layers[2].as_linear(x), tied, mx.bfloat16, roundings=2)
    assert mx.array_equal(model.layers[2](ids), looked_up).item()
