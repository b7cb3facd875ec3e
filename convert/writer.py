"""Streaming safetensors writer; atomic output folders and file replacement.

The header of a safetensors file lists every tensor's byte range before any data, and lazy MLX
arrays know their shapes and dtypes before they are computed, so a shard is written by laying
out the header first and then evaluating, writing and releasing one tensor at a time: peak
memory is one tensor (plus whatever the caller keeps), never a whole shard.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import struct
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import numpy as np

from mtpkit.loaders.findings import UserError
from mtpkit.loaders.paths import trusted_base

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


def claim_output(out: Path, source: Path, force: bool) -> None:
    """Refuse, before any work, an output that is its source, lies inside it or holds it (links
    resolved; for a Hugging Face cache snapshot, the cached repo its links point into):
    replacing OUT would delete the source, writing inside it would change it. Then put back
    what a killed earlier run left beside OUT (_recover) and refuse an existing OUT unless
    `force`."""
    target, origin = out.resolve(), source.resolve()
    area = trusted_base(origin) if origin.is_dir() else origin
    if target == origin or origin.is_relative_to(target) or target.is_relative_to(area):
        raise UserError("output.overlaps_source", f"{out} is {source} or overlaps it ({target} vs "
                        f"{origin}); the source is never modified",
                        "write the output to a folder outside the source, e.g. a sibling")
    _recover(target)
    if target.exists() and not force:
        raise OutputExists(f"{target} already exists")


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


# -- atomic output ---------------------------------------------------------------------------
# Leftovers are named `.{name}.{kind}-{host}-{pid}-{tag}` beside what they stand for, so a later
# run can tell the ones whose process has ended (on this machine) from those still at work.
HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"
STAGE, ASIDE = "mtpkit", "old"
AT_FDCWD = -100
EXCHANGE = 2  # Linux renameat2 RENAME_EXCHANGE; macOS renamex_np RENAME_SWAP


def _leftover(target: Path, kind: str, tag: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{HOST}-{os.getpid()}-{tag}"


def _dead_leftovers(target: Path, kind: str) -> list[tuple[int, Path]]:
    """(tag, path) of `target`'s leftovers of `kind` whose process on this machine has ended."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.{kind}-{HOST}-(\d+)-(\d+)")
    found: list[tuple[int, Path]] = []
    for path in target.parent.iterdir() if target.parent.is_dir() else []:
        match = pattern.fullmatch(path.name)
        if match and int(match[1]) > 0 and not _alive(int(match[1])):
            found.append((int(match[2]), path))
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root`: copied files (shutil) were never synced, and
    a rename must not publish a bundle whose bytes are still only in the page cache."""
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_path(os.path.join(folder, name))
        _fsync_path(folder)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step; False where the OS or filesystem cannot
    (then the caller sets the old one aside and renames twice)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "renameat2"):
        libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                                   ctypes.c_uint]
        rc = libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), EXCHANGE)
    elif hasattr(libc, "renamex_np"):
        libc.renamex_np.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
        rc = libc.renamex_np(os.fsencode(a), os.fsencode(b), EXCHANGE)
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _recover(out: Path) -> None:
    """Clean up after runs that were killed: an output one of them had set aside (killed between
    its two renames) goes back to `out`; their staging folders and set-aside copies go."""
    aside = _dead_leftovers(out, ASIDE)
    if aside and not out.exists():
        os.rename(aside.pop()[1], out)
    for _, path in [*aside, *_dead_leftovers(out, STAGE)]:
        _remove(path)


def _swap(stage: Path, out: Path, force: bool) -> None:
    """Publish the fsynced `stage` as `out`. A previous `out` is exchanged with the stage in one
    atomic step where the OS can, else set aside and the stage renamed in. If any step fails,
    the steps done are undone in reverse (the previous output back at `out`), the stage is
    removed and the error raised; if an undo fails too, what is left is named for `_recover`."""
    replacing = out.exists()
    if replacing and not force:
        shutil.rmtree(stage, ignore_errors=True)
        raise OutputExists(f"{out} already exists")
    undo: list[Callable[[], object]] = []
    previous = None
    try:
        if replacing and _exchange(stage, out):
            undo.append(lambda: _exchange(stage, out))
            previous = stage
        else:
            if replacing:
                previous = _leftover(out, ASIDE, str(time.time_ns()))
                os.rename(out, previous)
                undo.append(lambda: os.rename(previous, out))
            os.rename(stage, out)
            undo.append(lambda: os.rename(out, stage))
        _fsync_path(out.parent)
    except BaseException:
        for step in reversed(undo):
            step()
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


@contextmanager
def staged_output(out: Path, source: Path, force: bool = False) -> Iterator[Path]:
    """Yield a staging folder beside `out` (refused where it overlaps `source`: claim_output);
    when the block succeeds, fsync it and swap it into place (replacing `out` only with
    force=True); on failure remove it. `out` is at every step
    the previous output, whole, or the new one, whole (absent, where the OS has no atomic
    exchange, only while this process sits between its two renames: if it dies there, the
    next run writing `out` puts the previous one back)."""
    claim_output(out, source, force)
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = _leftover(out, STAGE, str(uuid.uuid4().int % 10**12))
    stage.mkdir()
    try:
        yield stage
        _fsync_tree(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _swap(stage, out, force)


@contextmanager
def scratch(out: Path) -> Iterator[Path]:
    """A hidden working folder beside `out` (a GGUF source dequantized for convert), removed on
    exit; named like a staging folder, so if this process is killed a later run removes it."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    path = _leftover(out, STAGE, str(uuid.uuid4().int % 10**12))
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _temporary(path: Path, data: bytes) -> Path:
    """`data` in a fsynced hidden file beside `path` (named for `_recover`)."""
    temp = _leftover(path, STAGE, str(uuid.uuid4().int % 10**12))
    try:
        temp.write_bytes(data)
        _fsync_path(temp)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


def replace_files(texts: dict[Path, str]) -> None:
    """Replace small text files of one folder (a bundle's card and manifest) together. The new
    texts and copies of the current files are written to fsynced temporaries first, then the
    new ones are renamed over their files in order (put the one that commits the others last).
    If any step fails, the files already replaced get their copies back (a rename: it cannot
    run out of space) and the temporaries go."""
    new: dict[Path, Path] = {}
    backup: dict[Path, Path | None] = {}
    done: list[Path] = []
    try:
        for path, text in texts.items():
            _recover(path)
            backup[path] = _temporary(path, path.read_bytes()) if path.exists() else None
            new[path] = _temporary(path, text.encode("utf-8"))
        for path, temp in new.items():
            os.replace(temp, path)
            done.append(path)
        _fsync_path(next(iter(texts)).parent)
    except BaseException:
        for path in reversed(done):
            saved = backup[path]
            if saved is None:
                path.unlink()
            else:
                os.replace(saved, path)
        raise
    finally:
        for temp in [*new.values(), *backup.values()]:
            if temp is not None:
                temp.unlink(missing_ok=True)
