"""Linear layers that verify a few positions at close to the cost of one.

On MLX's CPU backend:
A verify pass multiplies K+1 rows by every weight matrix. OpenBLAS serves one row with gemv
(memory-bound), but x @ W.T with 2-16 rows goes through its sgemm path, which costs clearly more
than one row per matrix; the same product computed as (W @ x.T).T costs little more
(docs/benchmarks-history.md, "Verify cost"). One row and long inputs (prefill, training) keep mlx-lm's
own x @ W.T, so plain decoding runs exactly the stock graph.

On a CUDA GPU, quantized linears and tied quantized output projections take 2..FEW_ROWS rows
through the kernel in decoder/model/kernels.py, which reads each weight once for all rows, at the row
counts where it beat MLX's op for the layer's shape on this device (decoder/tuning/kernel_choice.py);
one row (plain decoding) and long inputs go through MLX's own ops.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mtpkit.decoder.model import kernels
from mtpkit.decoder.tuning import jit_warmup, kernel_choice
from mtpkit.decoder.tuning.kernel_choice import stderr_line

FEW_ROWS = kernels.MAX_ROWS  # a verify pass's rows at most, as the kernel's


class FewRowsLinear(nn.Linear):
    """nn.Linear, with one sequence's 2..FEW_ROWS rows multiplied weight-first; any other input
    goes through nn.Linear's own __call__. A batch of sequences (B > 1) does too: weight-first
    it would be B products each reading the whole matrix, where stock's one sgemm reads it
    once."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # takes the weights it replaces: no fresh initialisation
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim < 2 or not 1 < x.shape[-2] <= FEW_ROWS or x.size != x.shape[-2] * x.shape[-1]:
            return super().__call__(x)
        y = mx.swapaxes(self.weight @ mx.swapaxes(x, -1, -2), -1, -2)
        return y + self.bias if "bias" in self else y


def _swap(module: nn.Module, kind: type[nn.Module], twin: type[nn.Module]) -> int:
    """Replace every module of exactly `kind` under `module` by `twin(it)`; how many."""
    swaps = [(name, twin(m)) for name, m in module.named_modules() if type(m) is kind]
    if swaps:
        module.update_modules(tree_unflatten(swaps))
    return len(swaps)


def use_few_rows_linears(module: nn.Module) -> int:
    """Swap every float nn.Linear under `module` (quantized ones are left alone); returns how
    many were swapped."""
    return _swap(module, nn.Linear, FewRowsLinear)


class _KernelTwin:
    """What both quantized twins share: the packed arrays taken as they are (no fresh
    initialisation), whether the kernel reads their layout (decided once), the row counts it
    serves (`kernel_rows`: all, until kernel_choice.assign times this shape), and the kernel's
    product (x @ W.T) for any rows."""

    kernel_rows: frozenset[int] = kernel_choice.ALL_ROWS

    def _adopt(self, layer: nn.Module, names: tuple[str, ...]) -> None:
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        for name in names:
            if name in layer:
                setattr(self, name, layer[name])
        self._fits = ("biases" in self and kernels.layout_supported(self.bits, self.group_size,
                                                                     self.mode)
                      and self.scales.shape[-1] * self.group_size % 16 == 0)
        self.freeze()

    def _product(self, x: mx.array) -> mx.array:
        """x @ W.T: 2..MAX_ROWS rows through the kernel at its row counts (CUDA), anything else
        through MLX's op as one (rows, K) matrix: given a batch of sequences (B, T, K), MLX's
        CUDA op runs B products, each reading the whole weight. One row (a plain step) takes
        MLX's op as the stock layer calls it, with no more host work: plain decoding builds
        every step's graph in Python, and a pipelined step is only as fast as that build."""
        k = x.shape[-1]
        rows = x.size // k
        if rows > 1 and self._fits and rows in self.kernel_rows and kernels.few_rows(x):
            return kernels.rows_matmul(x, self.weight, self.scales, self.biases, self.bits,
                                       self.group_size)
        y = mx.quantized_matmul(x if rows == 1 else x.reshape(rows, k), self["weight"],
                                scales=self["scales"], biases=self.get("biases"),
                                transpose=True, group_size=self.group_size, bits=self.bits,
                                mode=self.mode)
        return y if rows == 1 else y.reshape(*x.shape[:-1], y.shape[-1])


class KernelQuantizedLinear(_KernelTwin, nn.QuantizedLinear):
    """nn.QuantizedLinear whose products go through `_product`: the verify kernel for the row
    counts it serves, MLX's op on one matrix of rows otherwise."""

    def __init__(self, layer: nn.QuantizedLinear) -> None:
        self._adopt(layer, ("weight", "scales", "biases", "bias"))

    def __call__(self, x: mx.array) -> mx.array:
        y = self._product(x)
        return y + self.bias if "bias" in self else y


class KernelQuantizedEmbedding(_KernelTwin, nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose tied output projection goes through `_product`."""

    def __init__(self, embedding: nn.QuantizedEmbedding) -> None:
        self._adopt(embedding, ("weight", "scales", "biases"))
        self.num_embeddings, self.dims = embedding.num_embeddings, embedding.dims

    def as_linear(self, x: mx.array) -> mx.array:
        return self._product(x)


KERNEL_TWINS: dict[type[nn.Module], type[nn.Module]] = {
    nn.QuantizedLinear: KernelQuantizedLinear, nn.QuantizedEmbedding: KernelQuantizedEmbedding}


def use_kernel_linears(module: nn.Module) -> int:
    """Swap every quantized linear layer and embedding (a tied lm_head is its as_linear) under
    `module` for its verify-kernel twin (same packed weights; the twin differs only for
    2..MAX_ROWS rows on CUDA, at the row counts kernel_choice keeps for its shape); returns how
    many. On CUDA every row count decoding reaches is then compiled (decoder/tuning/jit_warmup.py)."""
    count = sum(_swap(module, kind, twin) for kind, twin in KERNEL_TWINS.items())
    if count and kernels.cuda_available():
        twins = [m for _, m in module.named_modules() if isinstance(m, _KernelTwin)]
        kernel_choice.assign(twins)
        jit_warmup.warm(twins)
    return count


QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)  # kernel twins are subclasses


def _products_right(layer: nn.Module) -> bool:
    """Whether MLX's own quantized matmul multiplies rows by `layer`'s weight right on this
    device: 2, FEW_ROWS and 4 x FEW_ROWS rows (its per-row, middle and tiled paths) against
    the dequantized product in float32 (`kernels.far_off`), over the weight's first output rows
    (a whole tied output projection in float32 would take gigabytes)."""
    sample = 256  # output rows: several of the op's tiles wide
    weight, scales = layer["weight"][:sample], layer["scales"][:sample]
    biases = layer["biases"][:sample] if "biases" in layer else None
    dtype = scales.dtype
    dense = mx.dequantize(weight, scales.astype(mx.float32), None if biases is None
                          else biases.astype(mx.float32), layer.group_size, layer.bits,
                          mode=layer.mode)
    for rows in (2, FEW_ROWS, 4 * FEW_ROWS):
        x = mx.random.normal((rows, dense.shape[1]), key=mx.random.key(rows)).astype(dtype)
        got = mx.quantized_matmul(x, weight, scales, biases, transpose=True,
                                  group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        if kernels.far_off(got, x.astype(mx.float32) @ dense.T):
            return False
    return True


def _dequantized(layer: nn.Module) -> nn.Module:
    """The float layer computing what `layer` should: its weight dequantized, in its dtype."""
    weight = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"),
                           layer.group_size, layer.bits, mode=layer.mode)
    if isinstance(layer, nn.QuantizedEmbedding):
        dense = nn.Embedding(*weight.shape)
    else:
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in layer)
        if "bias" in layer:
            dense.bias = layer["bias"]
    dense.weight = weight
    return dense


def dequantize_where_wrong(module: nn.Module, say: Callable[[str], None] = stderr_line) -> int:
    """Dequantize the quantized layers under `module` whose products MLX's own op computes
    wrongly on this device, checked once per weight layout and shape; returns how many.
    MLX's CUDA quantized matmul returns non-finite or unrelated values for two or more rows
    of a 64-feature input (4-bit in groups of 64: one group a row): every prefill and verify pass through
    such a layer would be garbage while one-row decoding stays right. Checked on the device
    rather than assumed from a version, so a fixed MLX keeps every layer quantized. Affine
    layouts only (the float formats' scales do not say the activations' dtype)."""
    found = [(name, m) for name, m in module.named_modules()
             if isinstance(m, QUANTIZED) and getattr(m, "mode", "affine") == "affine"]
    verdict: dict[tuple, bool] = {}
    wrong, extra = [], 0
    for name, layer in found:
        shape = (*layer["weight"].shape, layer.bits, layer.group_size, layer["scales"].dtype,
                 "biases" in layer)
        if shape not in verdict:
            verdict[shape] = _products_right(layer)
        if not verdict[shape]:
            wrong.append((name, _dequantized(layer)))
            extra += wrong[-1][1].weight.nbytes - sum(
                layer[k].nbytes for k in ("weight", "scales", "biases") if k in layer)
    if wrong:
        module.update_modules(tree_unflatten(wrong))
        say(f"MLX's quantized matmul computes wrong products on this device for "
            f"{sum(not ok for ok in verdict.values())} weight shape(s): {len(wrong)} layer(s) "
            f"run dequantized ({extra / 2**20:.1f} MiB more)")
    return len(wrong)
