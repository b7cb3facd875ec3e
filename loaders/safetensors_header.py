"""Read and validate safetensors headers without touching tensor bytes.

The header is untrusted: its length is bounded, its JSON validated field by field, every
tensor's byte range checked against its dtype and shape, against the file size and against
every other tensor. Problems become findings, never exceptions.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from mtpkit.loaders.config import BundleJSONError, parse_json
from mtpkit.loaders.findings import Finding, finding

# The safetensors reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000

# Bits per element of every dtype the safetensors format defines.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range in the file."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class SafetensorsHeader:
    """A parsed header: valid tensors, the free-form metadata, and what was wrong."""

    file: str
    size: int
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # named in the header, left out as unusable

    @property
    def readable(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)


def _expected_nbytes(dtype: str, shape: list[int]) -> int | None:
    bits = DTYPE_BITS[dtype] * math.prod(shape)
    return bits // 8 if bits % 8 == 0 else None


def _is_shape(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    )


def _is_offsets(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in value)
        and value[0] <= value[1]
    )


def read_header(path: Path, label: str | None = None) -> SafetensorsHeader:
    """Parse the header of `path`; `label` names the file in findings (default: its name)."""
    label = label or path.name
    size = os.path.getsize(path)
    result = SafetensorsHeader(file=label, size=size)
    bad = result.findings.append
    if size < 8:
        bad(finding("safetensors.truncated", f"{size} bytes: too short to hold a header", label))
        return result
    with open(path, "rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        if header_len > MAX_HEADER_BYTES:
            bad(finding("safetensors.bad_header",
                        f"header claims {header_len} bytes (limit {MAX_HEADER_BYTES})", label))
            return result
        if header_len > size - 8:
            bad(finding("safetensors.truncated",
                        f"header claims {header_len} bytes but the file has {size - 8} after "
                        "the length prefix", label))
            return result
        raw = fh.read(header_len)
    _parse_entries(raw, result, data_start=8 + header_len)
    return result


def _parse_entries(raw: bytes, result: SafetensorsHeader, data_start: int) -> None:
    label = result.file
    bad = result.findings.append
    try:
        header = parse_json(raw)  # bounded depth and integer length, like every bundle JSON
    except BundleJSONError as exc:
        bad(finding("safetensors.bad_header", f"header: {exc}", label))
        return
    if not isinstance(header, dict):
        bad(finding("safetensors.bad_header", "header is not a JSON object", label))
        return
    # null is what mx.save_safetensors writes without metadata; the reference reader takes it
    # as "none", as it does an absent key. Anything but null or a string map it refuses.
    metadata = header.pop("__metadata__", None)
    if isinstance(metadata, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        result.metadata = metadata
    elif metadata is not None:
        bad(finding("safetensors.bad_header", "__metadata__ must be null or map strings to "
                    "strings", label))
    data_len = result.size - data_start
    spans: list[tuple[int, int, str]] = []
    past_end: list[str] = []
    for name, entry in header.items():
        where = f"{label}:{name}"
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
                and _is_shape(entry.get("shape")) and _is_offsets(entry.get("data_offsets"))):
            bad(finding("safetensors.bad_header",
                        "entry needs dtype, a shape of non-negative ints and data_offsets "
                        "[begin, end] with begin <= end", where))
            result.dropped.append(name)
            continue
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        spans.append((begin, end, name))
        if dtype not in DTYPE_BITS:
            bad(finding("safetensors.dtype_unknown", f"dtype {dtype!r} is not a safetensors dtype",
                        where))
            result.dropped.append(name)
            continue
        want = _expected_nbytes(dtype, shape)
        if want != end - begin:
            bad(finding("safetensors.bad_header",
                        f"{dtype}{shape} needs {want} bytes but its offsets span {end - begin}",
                        where))
            result.dropped.append(name)
            continue
        if end > data_len:
            past_end.append(name)
            continue
        result.tensors[name] = TensorInfo(name, label, dtype, tuple(shape),
                                          data_start + begin, data_start + end)
    if past_end:  # one finding per damaged file, not one per tensor (a cut shard names hundreds)
        needed = max(header[n]["data_offsets"][1] for n in past_end)
        shown = ", ".join(sorted(past_end)[:3]) + (" ..." if len(past_end) > 3 else "")
        bad(finding("safetensors.truncated", f"{len(past_end)} of {len(header)} tensor(s) run past "
                    f"the end of the file: their data needs {needed} bytes, the file holds "
                    f"{data_len} ({shown})", label))
        result.dropped += past_end
    _check_layout(spans, result)


def _check_layout(spans: list[tuple[int, int, str]], result: SafetensorsHeader) -> None:
    """Overlaps are corruption; holes make the reference safetensors loader refuse the file."""
    spans.sort()
    cursor, prev = 0, None
    for begin, end, name in spans:
        if begin < cursor and end > begin:
            result.findings.append(finding(
                "safetensors.overlap", f"bytes {begin}..{end} overlap tensor {prev!r}",
                f"{result.file}:{name}"))
            result.tensors.pop(name, None)
        elif begin > cursor:
            result.findings.append(finding(
                "safetensors.bad_header",
                f"{begin - cursor} unused bytes before this tensor; the safetensors library "
                "rejects non-contiguous data", f"{result.file}:{name}", severity="warning"))
        if end >= cursor:
            cursor, prev = end, name
