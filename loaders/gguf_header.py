"""Validate a GGUF file's header before gguf-py reads it.

gguf-py's GGUFReader trusts every count: a tensor count of 2^40 or a metadata array of 2^64
items is a loop that never ends, growing a list of empty views until memory runs out, and a
truncated file is an IndexError from deep inside. Here the header is walked once over a
read-only memory map, every count and length checked against the bytes that remain (and
against bounds far above any published model's) and every tensor's bytes against the file
size, before gguf-py allocates anything. Problems are a GGUFInvalid (UserError gguf.invalid).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from mtpkit.loaders.findings import UserError

HINT = "the file is not a complete GGUF model; download it again, or convert the original " \
       "Hugging Face checkpoint instead"
VERSIONS = (2, 3)  # what gguf-py reads
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# Bounds far above published models (tens of metadata keys, a few thousand tensors, vocabularies
# of a few hundred thousand tokens), low enough that gguf-py's per-item objects fit in memory.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ARRAY_ITEMS = 1 << 21
MAX_METADATA_ITEMS = 1 << 22
# GGUF value types: fixed sizes of the scalars, then string (8) and array (9).
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, one-byte value
MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # empty name, no dims, type, offset


class GGUFInvalid(UserError):
    """A GGUF file whose header cannot be read as one: truncated, counts beyond its size."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__("gguf.invalid", f"{path.name}: {message}", HINT)


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    tensor_count: int
    kv_count: int
    data_offset: int
    size: int


class _Reader:
    """A cursor over the mapped file that refuses to read past its end."""

    def __init__(self, buf: mmap.mmap, order: str, path: Path) -> None:
        self.buf, self.order, self.path, self.pos = buf, order, path, 0
        self.items = 0  # metadata values so far (gguf-py keeps an object for each)

    def fail(self, message: str) -> GGUFInvalid:
        return GGUFInvalid(self.path, message)

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def skip(self, n: int, what: str) -> None:
        if n > self.remaining():
            raise self.fail(f"truncated: {what} needs {n} bytes at offset {self.pos}, the file "
                            f"has {self.remaining()} left")
        self.pos += n

    def number(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        start = self.pos
        self.skip(size, what)
        return struct.unpack_from(self.order + fmt, self.buf, start)[0]

    def string(self, what: str) -> str:
        n = self.number("Q", f"the length of {what}")
        start = self.pos
        self.skip(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {start} is not UTF-8") from None

    def count(self, value: int, limit: int, min_bytes: int, what: str) -> int:
        """A count that the remaining bytes (min_bytes each) and `limit` both allow."""
        if value > limit:
            raise self.fail(f"{what} is {value}, over the bound {limit}")
        if value * min_bytes > self.remaining():
            raise self.fail(f"{what} is {value}, more than the {self.remaining()} bytes left in "
                            "the file can hold")
        return value

    def value(self, vtype: int, what: str, nested: bool = False) -> int | str | None:
        """Skip one metadata value; return it when it is a uint32 or a string."""
        self.items += 1
        if self.items > MAX_METADATA_ITEMS:
            raise self.fail(f"more than {MAX_METADATA_ITEMS} metadata values")
        if vtype in SCALAR_SIZES:
            if vtype == UINT32:
                return self.number("I", what)
            self.skip(SCALAR_SIZES[vtype], what)
            return None
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY and not nested:
            itype = self.number("I", f"the item type of {what}")
            n = self.number("Q", f"the length of {what}")
            if itype == ARRAY:
                raise self.fail(f"{what} is an array of arrays, which GGUF readers refuse")
            if itype not in SCALAR_SIZES and itype != STRING:
                raise self.fail(f"{what} has items of unknown type {itype}")
            self.count(n, MAX_ARRAY_ITEMS, SCALAR_SIZES.get(itype, 8), f"the length of {what}")
            if itype in SCALAR_SIZES:  # fixed size: skip in one step
                self.items += n
                if self.items > MAX_METADATA_ITEMS:
                    raise self.fail(f"more than {MAX_METADATA_ITEMS} metadata values")
                self.skip(n * SCALAR_SIZES[itype], what)
            else:
                for i in range(n):
                    self.value(itype, f"{what}[{i}]", nested=True)
            return None
        raise self.fail(f"{what} has unknown value type {vtype}")


def check_gguf(path: Path) -> GGUFHeader:
    """Walk the header of the GGUF file `path`; raise GGUFInvalid unless gguf-py can read it
    in bounded time and memory and every tensor's bytes lie inside the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise GGUFInvalid(path, f"cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise GGUFInvalid(path, "not a regular file")
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 24:
            raise GGUFInvalid(path, f"truncated: {size} bytes cannot hold a GGUF header")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(_Reader(buf, "<", path), size, GGML_QUANT_SIZES, GGMLQuantizationType)


def _walk(r: _Reader, size: int, quant_sizes: dict, quant_types: type) -> GGUFHeader:
    if bytes(r.buf[:4]) != b"GGUF":
        raise r.fail(f"not a GGUF file (magic {bytes(r.buf[:4])!r}, expected b'GGUF')")
    r.pos = 4
    version = r.number("I", "the version")
    if version & 0xFFFF == 0:  # written on a big-endian host; gguf-py swaps, so do we
        r.order, r.pos = ">", 4
        version = r.number("I", "the version")
    if version not in VERSIONS:
        raise r.fail(f"GGUF version {version} (readable: {', '.join(map(str, VERSIONS))})")
    tensor_count = r.number("Q", "the tensor count")
    kv_count = r.count(r.number("Q", "the metadata count"), MAX_KV, MIN_KV_BYTES,
                       "the metadata count")
    r.count(tensor_count, MAX_TENSORS, MIN_TENSOR_BYTES, "the tensor count")
    seen = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # gguf-py's own field names
    alignment = DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = r.string(f"metadata key {i}")
        if key in seen:
            raise r.fail(f"metadata key {key[:80]!r} appears twice")
        seen.add(key)
        vtype = r.number("I", f"the type of {key[:80]!r}")
        value = r.value(vtype, f"metadata {key[:80]!r}")
        if key == "general.alignment":
            if vtype != UINT32 or not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise r.fail("general.alignment must be a uint32 power of two")
            alignment = value
    r.count(tensor_count, MAX_TENSORS, MIN_TENSOR_BYTES, "the tensor count")
    tensors = []
    names: set[str] = set()
    for i in range(tensor_count):
        name = r.string(f"the name of tensor {i}")
        if name in names:
            raise r.fail(f"tensor {name[:80]!r} appears twice")
        names.add(name)
        n_dims = r.number("I", f"the dimension count of {name[:80]!r}")
        if n_dims > MAX_DIMS:
            raise r.fail(f"tensor {name[:80]!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = [r.number("Q", f"the shape of {name[:80]!r}") for _ in range(n_dims)]
        raw_type = r.number("I", f"the type of {name[:80]!r}")
        offset = r.number("Q", f"the data offset of {name[:80]!r}")
        tensors.append((name, dims, raw_type, offset))
    data_offset = -(-r.pos // alignment) * alignment
    for name, dims, raw_type, offset in tensors:
        label = repr(name[:80])
        try:
            block, type_size = quant_sizes[quant_types(raw_type)]
        except (ValueError, KeyError):
            raise r.fail(f"tensor {label} has unknown type {raw_type}") from None
        if dims and dims[0] % block:
            raise r.fail(f"tensor {label}: its row of {dims[0]} is not a whole number of "
                         f"{block}-value blocks")
        elements = 1
        for d in dims:
            elements *= d
        end = data_offset + offset + elements * type_size // block
        if end > size:
            raise r.fail(f"truncated: tensor {label} ends at byte {end}, the file has {size}")
    return GGUFHeader(version, tensor_count, kv_count, data_offset, size)
