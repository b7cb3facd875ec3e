"""Streaming safetensors writer and atomic output folders.

The header of a safetensors file lists every tensor's byte range before any data, and lazy MLX
arrays know their shapes and dtypes before they are computed, so a shard is written by laying
out the header first and then evaluating, writing and releasing one tensor at a time: peak
memory is one tensor (plus whatever the caller keeps), never a whole shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import numpy as np

ST_DTYPES = {mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16",
             mx.uint32: "U32", mx.int32: "I32", mx.uint64: "U64", mx.int64: "I64",
             mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32"}
SHARD_BYTES = 5 << 30  # mlx-lm's limit
# Output bytes evaluated together, and how many batches compute ahead of the one being written:
# in flight ~ (depth + 1) x batch of output plus its inputs (bf16 sources are 4x a 4-bit output).
BATCH_BYTES = 32 << 20
PIPELINE_DEPTH = 2
Release = Callable[[str], None]


class OutputExists(Exception):
    pass


class Rows:
    """A tensor computed as consecutive axis-0 chunks (lazy arrays). Its bytes are the chunks'
    bytes back to back, so the writer streams them in order and never concatenates."""

    def __init__(self, parts: list[mx.array]) -> None:
        self.parts = parts
        self.dtype = parts[0].dtype
        self.shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        self.nbytes = sum(p.nbytes for p in parts)


Tensor = mx.array | Rows


def _parts(tensor: Tensor) -> list[mx.array]:
    return tensor.parts if isinstance(tensor, Rows) else [tensor]


def _compute(tensors: dict[str, Tensor], names: list[str]) -> None:
    """Start evaluating `names` in the background (mx.async_eval)."""
    mx.async_eval([p for n in names for p in _parts(tensors[n])])


def _raw(array: mx.array) -> memoryview:
    """The array's bytes without a copy (bf16 goes through a uint16 view: numpy has no bf16)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return memoryview(np.ascontiguousarray(np.asarray(array))).cast("B")  # copies only views


def _start_writeback(fh: BinaryIO) -> None:
    """Hand what is written so far to the disk now and drop it from the page cache (Linux:
    POSIX_FADV_DONTNEED starts writeback of dirty pages and evicts clean ones). The final
    fsync then has little left to wait for, and gigabytes of output never crowd the page cache
    that is holding the source. No-op where posix_fadvise does not exist (macOS)."""
    if hasattr(os, "posix_fadvise"):
        fh.flush()
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _batches(tensors: dict[str, Tensor], names: list[str], budget: int) -> list[list[str]]:
    out: list[list[str]] = [[]]
    size = 0
    for name in names:
        if out[-1] and size + tensors[name].nbytes > budget:
            out.append([])
            size = 0
        out[-1].append(name)
        size += tensors[name].nbytes
    return out


def plan_shards(tensors: dict[str, Tensor], limit: int = SHARD_BYTES) -> list[list[str]]:
    """Group names (sorted) into shards of at most `limit` bytes, as mlx-lm does."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_safetensors(path: Path, tensors: dict[str, Tensor], names: list[str],
                      release: Release = lambda name: None,
                      progress: Callable[[int], None] = lambda n: None) -> str:
    """Write `names` from `tensors` (lazy arrays or Rows) to `path` and return the file's sha256.

    Tensors are evaluated in batches of at most BATCH_BYTES of output; the next PIPELINE_DEPTH
    batches compute (mx.async_eval) while the current one is written, so memory stays bounded
    by a few batches and their inputs; each written batch goes to the disk at once
    (_start_writeback). release(name) runs after each tensor is written."""
    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name in names:
        arr = tensors[name]
        header[name] = {"dtype": ST_DTYPES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    batches = _batches(tensors, names, BATCH_BYTES)
    with open(path, "wb") as fh:
        head = struct.pack("<Q", len(raw)) + raw
        fh.write(head)
        digest.update(head)
        for ahead in batches[:PIPELINE_DEPTH]:
            _compute(tensors, ahead)
        for i, batch in enumerate(batches):
            if i + PIPELINE_DEPTH < len(batches):
                _compute(tensors, batches[i + PIPELINE_DEPTH])
            for name in batch:
                parts = _parts(tensors.pop(name))
                while parts:
                    data = _raw(parts.pop(0))
                    fh.write(data)
                    digest.update(data)
                    progress(data.nbytes)
                    del data
                release(name)
            _start_writeback(fh)
        fh.flush()
        os.fsync(fh.fileno())
    return digest.hexdigest()


def write_shards(out: Path, tensors: dict[str, Tensor], prefix: str = "model",
                 release: Release = lambda name: None,
                 progress: Callable[[int], None] = lambda n: None) -> dict[str, str]:
    """mlx-lm's shard naming and index; returns {shard file: sha256}."""
    shards = plan_shards(tensors)
    total = sum(t.nbytes for t in tensors.values())
    weight_map: dict[str, str] = {}
    hashes: dict[str, str] = {}
    for i, names in enumerate(shards):
        fname = (f"{prefix}.safetensors" if len(shards) == 1
                 else f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        weight_map.update(dict.fromkeys(names, fname))
        hashes[fname] = write_safetensors(out / fname, tensors, names, release, progress)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text(out / f"{prefix}.safetensors.index.json", json.dumps(index, indent=4))
    return hashes


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


@contextmanager
def staged_output(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a staging folder beside `out`; on success rename it into place (replacing `out`
    only with force=True); on failure remove it. `out` is never left half-written."""
    out = out.resolve()
    if out.exists() and not force:
        raise OutputExists(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.mtpkit-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        yield stage
        dirfd = os.open(stage, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
            stage.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
