"""Describe measured quantization in each form a bundle carries it: mlx-lm's config entries,
the `mtplx_mtp_quantization` record, and the manifest section. One source of truth: the
ModuleQuant measurements."""

from __future__ import annotations

from collections import Counter
from typing import Any

from mtpkit.loaders.quant import ModuleQuant, Quant


def _quants(measured: dict[str, ModuleQuant]) -> dict[str, Quant]:
    return {p: mq.quant for p, mq in sorted(measured.items()) if mq.quant}


def default_quant(measured: dict[str, ModuleQuant]) -> Quant | None:
    quants = _quants(measured)
    return Counter(quants.values()).most_common(1)[0][0] if quants else None


def manifest_section(measured: dict[str, ModuleQuant]) -> dict[str, Any]:
    quants, default = _quants(measured), default_quant(measured)
    return {"default": default.to_dict() if default else None,
            "modules": {p: q.to_dict() for p, q in quants.items() if q != default},
            "quantized_modules": len(quants)}


def config_entries(measured: dict[str, ModuleQuant]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` value: the default plus an entry per module that differs."""
    default = default_quant(measured)
    if default is None:
        return None
    entries: dict[str, Any] = default.to_dict()
    entries.update({p: q.to_dict() for p, q in _quants(measured).items() if q != default})
    return entries


def sidecar_record(measured: dict[str, ModuleQuant], policy: str | None,
                   norm_encoding: str = "absolute") -> dict[str, Any]:
    default = default_quant(measured)
    return {"policy": policy, "bits": default.bits if default else None,
            "group_size": default.group_size if default else None,
            "mode": default.mode if default else "affine", "prequantized": default is not None,
            "source_format": "mtpkit", "quantized_modules": sorted(_quants(measured)),
            "norm_encoding": norm_encoding}


def measured_policy(measured: dict[str, ModuleQuant], has_head: bool) -> str | None:
    """all (fc quantized), layers (only the decoder layer), keep; None without a head."""
    if not has_head:
        return None
    quants = _quants(measured)
    if "mtp.fc" in quants:
        return "all"
    return "layers" if quants else "keep"
