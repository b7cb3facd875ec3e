"""Verify-row matmuls that read each weight once for all rows (2..MAX_ROWS rows).

A verify pass multiplies 1 + depth rows by every weight matrix. On MLX's CUDA backend the
quantized matmul re-reads the packed weights once per row for 2-7 rows, so a depth-3 round costs
about what three plain steps do. The kernel here
streams each packed 16-value chunk once, dequantizes it in registers and multiplies it with every
row, as a decode step's matrix-vector product does for one row. `rows_matmul` runs it; the layer
twins (decoder/model/rows.py) and the row-count timing (decoder/tuning/kernel_choice.py) call it
where it applies, MLX's own op everywhere else (a Metal kernel can be added here once it can be
tested on a Mac).

Layouts: MLX affine quantization, 4 or 8 bits, groups of 32, 64 or 128 (what mtpkit convert
writes); x in float16, bfloat16 or float32. Float weights keep MLX's matmul: a kernel of this
shape was no faster than cuBLAS, and each call costs the host more to build than cuBLAS's
hand-off saves (docs/benchmarks-history.md, "GPU").
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

from mtpkit.decoder.tuning.curve import MAX_ROWS  # the widest verify pass the cost curve prices

ROW_BUCKETS = (4, 8, MAX_ROWS)
BITS = (4, 8)
GROUPS = (32, 64, 128)
ROWS_PER_WARP = 4
WARPS = 4

# One warp computes ROWS_PER_WARP (R) outputs for all M rows of x. Lane l reads values
# [k0, k0 + 16) of each of its weight rows, k0 = 16 l + 512 i, so a warp streams 512 consecutive
# values per row per step. For quantized weights the 16 values sit in one group (16 divides the
# group size), so sum_k x_k (s q_k + b) = s * sum_k x_k q_k + b * sum_k x_k: the per-row sum of x
# is shared by every output. Partial sums meet by warp shuffles; lane 0 writes.
_SOURCE = r"""
    constexpr int LANES = 32;
    constexpr int CHUNK = 16;
    const int N = w_shape[0];
    const int M = x_shape[0];  // rows; MB (a template bucket) sizes the accumulators
    const int K = x_shape[1];
    const int lane = threadIdx.x % LANES;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / LANES;
    const int n0 = warp * R;
    if (n0 >= N) return;
    float acc[MB][R];
    #pragma unroll
    for (int m = 0; m < MB; ++m)
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    for (int k0 = lane * CHUNK; k0 < K; k0 += LANES * CHUNK) {
        float wv[R][CHUNK];
        float sc[R], bi[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const int n = min(n0 + r, N - 1);
            {
                constexpr int WORDS = CHUNK * BITS / 32;
                constexpr int PER = 32 / BITS;
                constexpr uint32_t MASK = (1u << BITS) - 1u;
                uint32_t packed[WORDS];
                const uint32_t* row = w + (size_t)n * (K * BITS / 32) + k0 * BITS / 32;
                if constexpr (WORDS == 4) {
                    uint4 v = *reinterpret_cast<const uint4*>(row);
                    packed[0] = v.x; packed[1] = v.y; packed[2] = v.z; packed[3] = v.w;
                } else {
                    uint2 v = *reinterpret_cast<const uint2*>(row);
                    packed[0] = v.x; packed[1] = v.y;
                }
                #pragma unroll
                for (int i = 0; i < WORDS; ++i)
                    #pragma unroll
                    for (int j = 0; j < PER; ++j)
                        wv[r][i * PER + j] = static_cast<float>((packed[i] >> (j * BITS)) & MASK);
                const size_t g = (size_t)n * (K / GROUP) + k0 / GROUP;
                sc[r] = static_cast<float>(scales[g]);
                bi[r] = static_cast<float>(biases[g]);
            }
        }
        #pragma unroll
        for (int m = 0; m < MB; ++m) {
            if (m >= M) break;
            alignas(16) T raw[CHUNK];
            const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)m * K + k0);
            uint4* dst = reinterpret_cast<uint4*>(raw);
            #pragma unroll
            for (int i = 0; i < CHUNK * sizeof(T) / 16; ++i) dst[i] = src[i];
            float xv[CHUNK];
            float xsum = 0.0f;
            #pragma unroll
            for (int j = 0; j < CHUNK; ++j) {
                xv[j] = static_cast<float>(raw[j]);
                xsum += xv[j];
            }
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                float dot = 0.0f;
                #pragma unroll
                for (int j = 0; j < CHUNK; ++j) dot += xv[j] * wv[r][j];
                acc[m][r] += sc[r] * dot + bi[r] * xsum;
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < MB; ++m)
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            if (m >= M) break;
            float v = acc[m][r];
            #pragma unroll
            for (int off = LANES / 2; off > 0; off /= 2) v += __shfl_down_sync(0xffffffff, v, off);
            if (lane == 0 && n0 + r < N) out[(size_t)m * N + n0 + r] = static_cast<T>(v);
        }
"""

ACTIVATIONS = (mx.float16, mx.bfloat16, mx.float32)
_KERNEL: list[object] = []  # built on first use (a GPU-only object)


def _kernel() -> object:
    if not _KERNEL:
        _KERNEL.append(mx.fast.cuda_kernel(name="mtpkit_verify_rows",
                                           input_names=["x", "w", "scales", "biases"],
                                           output_names=["out"], source=_SOURCE))
    return _KERNEL[0]


def cuda_available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return (mx.default_device().type == mx.DeviceType.gpu and cuda is not None
            and cuda.is_available())


def bucket(rows: int) -> int:
    """The accumulator size compiled for `rows` rows: a few kernels cover 2..MAX_ROWS (each
    variant JIT-compiles once, then MLX keeps its PTX on disk)."""
    return next(b for b in ROW_BUCKETS if rows <= b)


def few_rows(x: mx.array) -> bool:
    """2..MAX_ROWS rows of a kernel activation dtype on CUDA: a verify pass (the cheap checks
    first: plain decoding and prefill leave at the first)."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    return 2 <= rows <= MAX_ROWS and x.dtype in ACTIVATIONS and cuda_available()


def layout_supported(bits: int | None, group_size: int | None, mode: str = "affine") -> bool:
    """Whether the kernel reads this weight layout: affine 4/8-bit in groups of 32/64/128."""
    return mode == "affine" and bits in BITS and group_size in GROUPS


def supported(x: mx.array, bits: int | None, group_size: int | None,
              mode: str = "affine") -> bool:
    """Whether the kernel computes x @ W.T here: CUDA, 2..MAX_ROWS rows of float16, bfloat16 or
    float32, a layout above, the reduction axis a multiple of 16."""
    return (x.ndim > 0 and x.shape[-1] % 16 == 0 and layout_supported(bits, group_size, mode)
            and few_rows(x))


@cache
def _template(dtype: mx.Dtype, mb: int, bits: int, group_size: int) -> list[tuple[str, Any]]:
    """Template arguments per call shape, built once (a verify pass makes hundreds of calls)."""
    return [("T", dtype), ("MB", mb), ("R", ROWS_PER_WARP), ("BITS", bits),
            ("GROUP", group_size)]


def verify_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array | None,
                  bits: int, group_size: int, mode: str = "affine") -> mx.array:
    """x @ W.T for a quantized linear layer's weight: the kernel where `supported`, else
    `mx.quantized_matmul`."""
    if biases is None or not supported(x, bits, group_size, mode):
        return mx.quantized_matmul(x, weight, scales, biases, transpose=True,
                                   group_size=group_size, bits=bits, mode=mode)
    return rows_matmul(x, weight, scales, biases, bits, group_size)


def rows_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bits: int,
                group_size: int) -> mx.array:
    """The kernel itself, unchecked: for callers that established `supported` already (the
    layer twins check their layout once and the rows per call)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows, n = x.size // k, weight.shape[0]
    warps = -(-n // ROWS_PER_WARP)
    (out,) = _kernel()(inputs=[x.reshape(rows, k), weight, scales, biases],
                       template=_template(x.dtype, bucket(rows), bits, group_size),
                       grid=(warps * 32, 1, 1), threadgroup=(32 * WARPS, 1, 1),
                       output_shapes=[(rows, n)], output_dtypes=[x.dtype])
    return out.reshape(*lead, n)


def far_off(got: mx.array, want: mx.array) -> bool:
    """Whether an op's output is garbage against its float32 reference: non-finite, or off by
    a quarter of the reference's largest value (rounding in any float dtype stays far below
    that). How load checks MLX's quantized products on the device (rows.py, cache/caches.py)."""
    error = mx.abs(got.astype(mx.float32) - want).max()
    return not (error <= 0.25 * mx.abs(want).max()).item()  # NaN compares false
