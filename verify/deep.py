"""--deep: stream every tensor's bytes with bounded memory (16 MiB chunks) to find NaN/Inf,
all-zero quantization scales, an empty sidecar, and files whose sha256 no longer matches
the manifest."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from mtpkit.loaders.bundle import BundleView
from mtpkit.loaders.digest import sha256_file
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.paths import inside
from mtpkit.loaders.safetensors_header import FLOAT_DTYPES, TensorInfo
from mtpkit.loaders.tensor_data import iter_chunks

Progress = Callable[[int], None]


def _scan_tensor(root: Path, info: TensorInfo) -> tuple[int, bool]:
    """(non-finite count, any non-zero value) for one float tensor."""
    bad, nonzero = 0, False
    for chunk in iter_chunks(root, info):
        bad += int(chunk.size - np.count_nonzero(np.isfinite(chunk)))
        nonzero = nonzero or bool(np.any(chunk != 0))
    return bad, nonzero


def deep_bytes(view: BundleView) -> int:
    """How many bytes deep_scan will read (for a progress bar)."""
    tensors = sum(i.nbytes for i in view.tensors.values() if i.dtype in FLOAT_DTYPES)
    return tensors + sum(int(e["bytes"]) for e in view.manifest.files())


def deep_scan(view: BundleView, advance: Progress = lambda n: None) -> list[Finding]:
    out: list[Finding] = []
    sidecar_nonzero = False
    for name, info in sorted(view.tensors.items()):
        if info.dtype not in FLOAT_DTYPES:
            continue
        bad, nonzero = _scan_tensor(view.root, info)
        advance(info.nbytes)
        if bad:
            out.append(finding("weights.nonfinite", f"{bad} of {info.nbytes // 2} values are "
                               "NaN or Inf", f"{info.file}:{name}"))
        if name.endswith(".scales") and not nonzero and info.nbytes:
            out.append(finding("weights.zero_scales", "every scale is zero",
                               f"{info.file}:{name}"))
        if name in view.weights.sidecar and nonzero:
            sidecar_nonzero = True
    if view.weights.sidecar and not sidecar_nonzero:
        out.append(finding("mtp.empty", "every float tensor in the sidecar is all zeros",
                           view.weights.sidecar_file or "mtp.safetensors"))
    for entry in view.manifest.files():
        path = inside(view.root, entry["path"])
        if path is None or not path.is_file():
            continue  # already reported by the header pass
        if sha256_file(path, advance) != entry["sha256"]:
            out.append(finding("manifest.stale", "sha256 differs from mtpkit.json",
                               entry["path"]))
    return out
