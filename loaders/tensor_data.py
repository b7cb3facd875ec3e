"""Read tensor bytes straight from a safetensors file: small vectors whole, big tensors in chunks.

numpy has no bfloat16, so bf16 is widened to float32 by shifting its bits; that keeps this
reader free of any framework and bounded in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mtpkit.loaders.safetensors_header import TensorInfo

_NUMPY = {
    "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "BOOL": np.bool_,
}
CHUNK_BYTES = 16 * 1024 * 1024
SMALL_TENSOR_BYTES = 1024 * 1024


def _decode(dtype: str, raw: bytes) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, _NUMPY[dtype])


def decodable(info: TensorInfo) -> bool:
    return info.dtype == "BF16" or info.dtype in _NUMPY


def read_small(root: Path, info: TensorInfo) -> np.ndarray | None:
    """The tensor's values as a flat array, or None when it is too big or not decodable."""
    if info.nbytes > SMALL_TENSOR_BYTES or not decodable(info):
        return None
    with open(root / info.file, "rb") as fh:
        fh.seek(info.start)
        return _decode(info.dtype, fh.read(info.nbytes))


def iter_chunks(root: Path, info: TensorInfo, chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """Yield the tensor's values in flat chunks of at most `chunk_bytes` (element-aligned)."""
    itemsize = 2 if info.dtype == "BF16" else np.dtype(_NUMPY[info.dtype]).itemsize
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    with open(root / info.file, "rb") as fh:
        fh.seek(info.start)
        left = info.nbytes
        while left > 0:
            raw = fh.read(min(step, left))
            if not raw:
                return
            left -= len(raw)
            yield _decode(info.dtype, raw[: len(raw) - len(raw) % itemsize])
