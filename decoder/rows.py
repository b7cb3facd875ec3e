"""Linear layers that verify a few positions at close to the cost of one.

On MLX's CPU backend:
A verify pass multiplies K+1 rows by every weight matrix. OpenBLAS serves one row with gemv
(memory-bound), but x @ W.T with 2-16 rows goes through its sgemm path, which on this machine
costs ~25% more than one row per matrix; the same product computed as (W @ x.T).T costs ~5%
more (BENCHMARKS.md, "Verify cost"). One row and long inputs (prefill, training) keep mlx-lm's
own x @ W.T, so plain decoding runs exactly the stock graph.

On a CUDA GPU, quantized linears take 2..FEW_ROWS rows through the kernel in
decoder/kernels.py, which reads each weight once for all rows; one row (plain decoding) and
long inputs go through MLX's own ops.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mtpkit.decoder import kernels

FEW_ROWS = 16


class FewRowsLinear(nn.Linear):
    """nn.Linear, with 2..FEW_ROWS rows multiplied weight-first; any other input goes through
    nn.Linear's own __call__."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # takes the weights it replaces: no fresh initialisation
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim < 2 or not 1 < x.shape[-2] <= FEW_ROWS:
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


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear (its packed weights taken as they are) whose 2..FEW_ROWS-row products
    go through the verify kernel where the layout is supported."""

    def __init__(self, layer: nn.QuantizedLinear) -> None:
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        for name in ("weight", "scales", "biases", "bias"):
            if name in layer:
                setattr(self, name, layer[name])
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        if not kernels.supported(x, self.bits, self.group_size, self.mode):
            return super().__call__(x)
        y = kernels.verify_matmul(x, self.weight, self.scales, self.get("biases"), self.bits,
                                  self.group_size, self.mode)
        return y + self.bias if "bias" in self else y


def use_kernel_linears(module: nn.Module) -> int:
    """Swap every nn.QuantizedLinear under `module` for its verify-kernel twin; returns how
    many were swapped."""
    return _swap(module, nn.QuantizedLinear, KernelQuantizedLinear)
