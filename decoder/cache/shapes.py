"""Attention shapes from a bounded set, so a GPU backend compiles each one once.

On MLX's CUDA backend, `mx.fast.scaled_dot_product_attention` with more than one query row builds a
cuDNN graph per (query length, key length, key buffer) it has not seen (tens of ms), and
every verify round of speculative decoding has a new key length. `PaddedKVCache` is mlx-lm's own
KVCache with two hooks changed: a multi-row pass sees the keys padded to a multiple of 256 (the
buffer is always allocated in whole 256-position steps) and a bool mask that hides the padding;
one-row decoding sees exactly what mlx-lm's cache gives it. Query lengths are bounded by the
callers: verify passes have 1 + depth rows, and long inputs go in `pieces`.

A quantized KV cache (`--kv-bits`, mlx-lm's QuantizedKVCache) is left unpadded: its attention is
mlx-lm's `quantized_scaled_dot_product_attention`, two quantized matmuls and a softmax, with no
cuDNN graph per key length. A PaddedKVCache switches to it through mlx-lm's own
`KVCache.to_quantized` (decoder/cache/caches.py `quantize`), and its passes then run untraced.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

STEP = KVCache.step  # mlx-lm's KV allocation step (256); cuDNN's own decoding path keys on it too


def padded(n: int) -> int:
    return -(-n // STEP) * STEP


def bucket(n: int) -> int:
    """A query length from a bounded set that holds n: a power of two below STEP (a whole
    STEP would be up to twice a short prompt's work), else whole STEPs."""
    return 1 << (n - 1).bit_length() if n <= STEP else padded(n)


class PaddedKVCache(KVCache):
    """A KVCache whose multi-row views have a key length that is a multiple of STEP."""

    step = STEP

    def reserve(self, end: int, keys: mx.array, values: mx.array) -> None:
        """Grow the buffers by whole steps (never slicing first: they stay STEP-aligned) so
        positions up to `end` fit; `keys`/`values` give the shape and dtype of new rows."""
        have = 0 if self.keys is None else self.keys.shape[2]
        if end <= have:
            return
        grow = padded(end) - have
        b, heads, _, kd = keys.shape
        extra_k = mx.zeros((b, heads, grow, kd), keys.dtype)
        extra_v = mx.zeros((b, heads, grow, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = extra_k, extra_v
        else:
            self.keys = mx.concatenate([self.keys, extra_k], axis=2)
            self.values = mx.concatenate([self.values, extra_v], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        rows = keys.shape[2]
        end = self.offset + rows
        self.reserve(end, keys, values)
        self.keys[..., self.offset:end, :] = keys
        self.values[..., self.offset:end, :] = values
        self.offset = end
        if rows == 1:
            return self.keys_and_values()
        view = padded(end)
        return self.keys[..., :view, :], self.values[..., :view, :]

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> Any:
        """For n > 1 rows: a bool (n, padded key length) causal mask, False over the padding
        (positions at or past the end of this pass); one row needs no mask. A pass that ends
        on a STEP boundary (every prefill chunk) sees its exact keys, so mlx-lm's "causal"
        says the same: an array mask would be turned into an additive bias of every head's
        (rows, keys) on CUDA, 16 GiB for one 2,048-row chunk at a 64K context."""
        end = self.offset + n
        if window_size is not None or n == 1 or (end == padded(end) and not return_array):
            return super().make_mask(n, return_array=return_array, window_size=window_size)
        rows = mx.arange(self.offset, self.offset + n)[:, None]
        cols = mx.arange(padded(self.offset + n))[None]
        return rows >= cols


def bounded_by_default() -> bool:
    """Bound shapes where multi-row attention compiles per shape: on a GPU backend, unless it is
    CUDA with cuDNN attention turned off (MLX_CUDA_USE_CUDNN_SDPA=0), whose kernels take any
    key length without compiling."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return False
    cuda = getattr(mx, "cuda", None)
    cudnn_off = os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1") == "0"
    return not (cuda is not None and cuda.is_available() and cudnn_off)


def bounded_caches(caches: list[Any]) -> list[Any]:
    """mlx-lm's caches with every plain KVCache replaced by a PaddedKVCache (rotating,
    quantized and recurrent caches are kept: they have their own shapes)."""
    return [PaddedKVCache() if type(c) is KVCache else c for c in caches]


def pieces(n: int) -> list[int]:
    """Split n positions into chunks whose lengths come from a fixed set: whole STEPs, then the
    powers of two of the rest (at most log2(STEP) extra passes)."""
    out = [STEP] * (n // STEP)
    rest = n % STEP
    bit = STEP
    while rest:
        bit //= 2
        if rest >= bit:
            out.append(bit)
            rest -= bit
    return out

