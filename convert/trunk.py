"""The trunk: mlx-lm's own model classes, sanitize and quantize_model, evaluated lazily so the
writer can stream it tensor by tensor. The MTP head is removed before mlx-lm sees the weights."""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from mtpkit.convert.quantize import check_quantization, quantize_rows
from mtpkit.convert.writer import Tensor
from mtpkit.loaders.bundle import BundleView

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")


@dataclass
class QuantOptions:
    """mlx-lm's convert options, with its names and meanings."""

    quantize: bool = False
    bits: int | None = None
    group_size: int | None = None
    mode: str = "affine"
    recipe: str | None = None
    overrides: list[tuple[str, dict[str, Any] | bool]] = field(default_factory=list)
    dtype: str | None = None
    implied: bool = field(default=False, init=False)  # quantize was implied by another option

    def __post_init__(self) -> None:
        """Quantization options without -q would silently write a float copy: they imply it
        (`implied` says so, for the caller to tell the user). Every combination MLX cannot
        quantize is refused here, before any work (mlx-lm's overrides quantize affine)."""
        asked = (self.bits or self.group_size or self.mode != "affine"
                 or any(isinstance(p, dict) for _, p in self.overrides))
        if asked and not self.quantize:
            self.quantize = self.implied = True
        if self.quantize:
            check_quantization(self.bits, self.group_size, self.mode, "trunk")
        for pattern, params in self.overrides:
            if isinstance(params, dict):
                check_quantization(params["bits"], params["group_size"], "affine",
                                   f"--quant-override {pattern}")


def parse_override(text: str) -> tuple[str, dict[str, Any] | bool]:
    """`PATTERN=BITS[:GROUP]` or `PATTERN=float` (fnmatch pattern over module paths)."""
    pattern, sep, value = text.rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"override {text!r}: expected PATTERN=BITS[:GROUP] or PATTERN=float")
    if value in ("float", "false", "none"):
        return pattern, False
    bits, _, group = value.partition(":")
    try:
        params = {"bits": int(bits), "group_size": int(group) if group else 64}
    except ValueError:
        raise ValueError(f"override {text!r}: BITS and GROUP must be integers") from None
    return pattern, params


def _load_model(view: BundleView) -> tuple[nn.Module, dict[str, Any]]:
    from mlx_lm.utils import load_model

    # A head left inside the trunk makes mlx-lm's strict load fail; it is read separately.
    strict = view.mtp.location not in ("trunk", "both")
    model, config = load_model(view.root, lazy=True, strict=strict, trust_remote_code=False)
    return model, config


def _predicate(model: nn.Module, options: QuantOptions, group: int
               ) -> Callable[[str, nn.Module], bool | dict[str, Any]] | None:
    from mlx_lm.convert import mixed_quant_predicate_builder

    base = getattr(model, "quant_predicate", None)
    if options.recipe:
        base = mixed_quant_predicate_builder(options.recipe, model, group)
    if not options.overrides:
        return base

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        for pattern, params in options.overrides:
            if fnmatch.fnmatchcase(path, pattern):
                return params
        return base(path, module) if base else True

    return predicate


def build_trunk(view: BundleView, options: QuantOptions) -> tuple[
        nn.Module, dict[str, Tensor], dict[str, Any]]:
    """(model, lazy tensors by name, config) for the converted trunk."""
    from mlx_lm.utils import dequantize_model, quantize_model

    model, config = _load_model(view)
    config = copy.deepcopy(config)
    requantize = options.quantize or options.dtype is not None
    if requantize and "quantization" in config:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    dtype_name = options.dtype or config.get("torch_dtype") or (
        config.get("text_config") or {}).get("dtype")
    if dtype_name in DTYPES and "quantization" not in config:
        dtype = DTYPES[dtype_name]
        cast = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
    sources = dict(tree_flatten(model.parameters()))
    if options.quantize:
        group = options.group_size or (64 if options.mode == "affine" else None)
        with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints its bpw line to stdout
            model, config = quantize_model(model, config, group_size=options.group_size,
                                           bits=options.bits, mode=options.mode,
                                           quant_predicate=_predicate(model, options, group or 32))
    tensors: dict[str, Tensor] = dict(tree_flatten(model.parameters()))
    if options.quantize:
        _quantize_in_rows(model, sources, tensors)
    return model, tensors, config


def _quantize_in_rows(model: nn.Module, sources: dict[str, mx.array],
                      tensors: dict[str, Tensor]) -> None:
    """Re-issue each quantized module's quantization with quantize_rows (same call, same bytes
    as mlx-lm's, spread over every core)."""
    for path, module in model.named_modules():
        source = sources.get(f"{path}.weight")
        if source is None or "scales" not in module or module.get("global_scale") is not None:
            continue  # not quantized here, or nvfp4 experts with per-expert global scales
        parts = quantize_rows(source, module.group_size, module.bits, module.mode)
        for suffix, part in zip(("weight", "scales", "biases"), parts, strict=False):
            tensors[f"{path}.{suffix}"] = part
