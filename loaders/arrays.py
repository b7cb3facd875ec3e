"""Lazy MLX arrays of a bundle's MTP head under canonical names, wherever the head is stored."""

from __future__ import annotations

import mlx.core as mx

from mtpkit.loaders.bundle import BundleView


def mtp_arrays(view: BundleView) -> dict[str, mx.array]:
    """Canonical name -> lazy array (mx.load maps the file; nothing is read until used)."""
    loaded: dict[str, dict[str, mx.array]] = {}
    out = {}
    for canon, info in view.mtp.tensors.items():
        if info.file not in loaded:
            loaded[info.file] = mx.load(str(view.root / info.file))
        out[canon] = loaded[info.file][view.mtp.source_names[canon]]
    return out
