"""Shared benchmark plumbing: machine/version record, isolated timed runs, result files."""

from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from mtpkit.verify.record import machine

RESULTS = Path(__file__).resolve().parent / "results"


ONES_BF16 = b"\x80\x3f" * 4096  # 1-D bf16 tensors (norm gains) hold 1.0 like a real bundle
DTYPES = {"uint32": "U32", "bfloat16": "BF16", "float32": "F32", "uint8": "U8"}


def write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], str]],
                       block: bytes, metadata: dict[str, str]) -> int:
    """Write a real (non-sparse) safetensors file of the given shapes: 1-D bf16 tensors hold
    1.0, everything else repeats `block`. Returns the data size."""
    header, offset = {"__metadata__": metadata}, 0
    sizes = {"U32": 4, "BF16": 2, "F32": 4, "U8": 1}
    for name, (shape, dtype) in sorted(tensors.items()):
        st = DTYPES[dtype]
        n = sizes[st]
        for d in shape:
            n *= d
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for name, (shape, dtype) in sorted(tensors.items()):
            begin, end = header[name]["data_offsets"]
            fill = ONES_BF16 if len(shape) == 1 and dtype == "bfloat16" else block
            left = end - begin
            while left:
                chunk = fill[: min(len(fill), left)]
                fh.write(chunk)
                left -= len(chunk)
    return offset



def run_isolated(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `code` in a fresh interpreter; it must print one JSON object as its last line.
    Peak RSS of that process (ru_maxrss, KiB on Linux) is added as peak_rss_mb."""
    wrapper = code + "\nimport resource as _r, json as _j\n" \
        "print(_j.dumps({**RESULT, 'peak_rss_mb': _r.getrusage(_r.RUSAGE_SELF).ru_maxrss / 1024}))"
    proc = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median": statistics.median(ordered), "p95": p95, "min": ordered[0], "n": len(ordered)}


def save(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path
