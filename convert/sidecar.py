"""The MTP sidecar: canonical `mtp.` names, experts stacked, norms encoded like the trunk's
(absolute, never shifted twice), and its own quantization policy."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.convert.experts import stack_experts
from mtpkit.convert.quantize import check_quantization, quantize_rows
from mtpkit.convert.writer import Tensor
from mtpkit.loaders.arrays import mtp_arrays
from mtpkit.loaders.bundle import BundleView
from mtpkit.loaders.norms import ABSOLUTE, absolute_from_delta, reencode

POLICIES = ("keep", "layers", "all")


@dataclass(frozen=True)
class SidecarOptions:
    """keep: full precision; layers: quantize the decoder layer only (fc, norms and heads stay
    full precision: what published packs call cyankiwi / prequantized-int4); all: every linear."""

    policy: str = "layers"
    bits: int = 4
    group_size: int = 64
    mode: str = "affine"
    dtype: mx.Dtype | None = mx.bfloat16

    def __post_init__(self) -> None:
        if self.policy != "keep":
            check_quantization(self.bits, self.group_size, self.mode, "MTP sidecar")


def _sanitize_layers(arrays: dict[str, mx.array], model: nn.Module) -> dict[str, mx.array]:
    """Let the trunk model's sanitize convert the MTP decoder layers (as trunk layers k): its
    splits (an MLA kv_b_proj) and dequantization, mlx-lm's code run on the renamed tensors.
    A sanitize may add its model's prefix (Kimi-K3's `language_model.`), taken off again, and
    drop the head's own modules (Kimi-K3's drops every `mtp.*` name): a module outside the
    layers that it returned nothing of is kept as given."""
    renamed = {re.sub(r"^mtp\.layers\.(\d+)\.", r"model.layers.\1.", n): a
               for n, a in arrays.items()}
    sanitized = {re.sub(r"^(?:language_model\.)?model\.layers\.(\d+)\.", r"mtp.layers.\1.",
                        k).removeprefix("language_model."): v
                 for k, v in model.sanitize(renamed).items()}
    returned = {k.rsplit(".", 1)[0] for k in sanitized}
    dropped = {n: a for n, a in arrays.items()
               if not n.startswith("mtp.layers.") and n.rsplit(".", 1)[0] not in returned}
    return {**dropped, **sanitized}


def _quantizable(name: str, arr: mx.array, options: SidecarOptions) -> bool:
    if options.policy == "keep" or not name.endswith(".weight") or arr.ndim < 2:
        return False
    if options.policy == "layers" and not name.startswith("mtp.layers."):
        return False
    return arr.shape[-1] % options.group_size == 0 and mx.issubdtype(arr.dtype, mx.floating)


def build_sidecar(view: BundleView, options: SidecarOptions, trunk_model: nn.Module | None,
                  hidden_size: int) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(lazy sidecar tensors, the `mtplx_mtp_quantization` record describing them)."""
    arrays = mtp_arrays(view)
    if any(n.endswith(".scales") for n in arrays):
        arrays = _dequantize(arrays, view)
    if view.family.sanitize_mtp_layer and trunk_model is not None:
        arrays = _sanitize_layers(arrays, trunk_model)
    arrays = stack_experts(arrays, hidden_size)
    if view.family.zero_centred_norms and view.kind == "hf":
        # The HF convention, applied unconditionally as mlx-lm's sanitize does for the trunk.
        arrays = absolute_from_delta(arrays)
    elif view.mtp.norms is not None:
        # MLX sidecars in the wild come in either encoding (some mixed): decided per head.
        arrays = reencode(arrays, view.mtp.norms.shifts(ABSOLUTE) or {})
    return encode_sidecar(arrays, options)


def encode_sidecar(arrays: dict[str, mx.array], options: SidecarOptions
                   ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Canonical head arrays (absolute norms, stacked experts) -> sidecar tensors quantized by
    the policy, and the `mtplx_mtp_quantization` record describing them."""
    out: dict[str, Tensor] = {}
    modules = []
    for name, arr in sorted(arrays.items()):
        if options.dtype is not None and mx.issubdtype(arr.dtype, mx.floating):
            arr = arr.astype(options.dtype)
        if not _quantizable(name, arr, options):
            out[name] = arr
            continue
        module = name[: -len(".weight")]
        parts = quantize_rows(arr, options.group_size, options.bits, options.mode)
        for suffix, part in zip(("weight", "scales", "biases"), parts, strict=False):
            out[f"{module}.{suffix}"] = part
        modules.append(module)
    record = {
        "policy": options.policy, "bits": options.bits if modules else None,
        "group_size": options.group_size if modules else None, "mode": options.mode,
        "prequantized": bool(modules), "source_format": "mtpkit",
        "quantized_modules": modules, "norm_encoding": "absolute",
    }
    return out, record


def _dequantize(arrays: dict[str, mx.array], view: BundleView) -> dict[str, mx.array]:
    """A quantized source sidecar is dequantized (with its measured parameters) so it can be
    re-encoded under the requested policy."""
    out = dict(arrays)
    for module, mq in view.mtp_quantization.items():
        if mq.quant is None:
            continue
        w, s = out.pop(f"{module}.weight"), out.pop(f"{module}.scales")
        b = out.pop(f"{module}.biases", None)
        out[f"{module}.weight"] = mx.dequantize(w, s, b, group_size=mq.quant.group_size,
                                                bits=mq.quant.bits, mode=mq.quant.mode)
    return out
