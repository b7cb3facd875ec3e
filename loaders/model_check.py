"""Every tensor against what the model will load, without reading a weight.

mlx-lm's own model class is built from config.json, the bundle's tensors go through its
`sanitize` as lazy stand-ins of their header shapes and dtypes, and the quantization its loader
applies (the same class predicate, reading shapes and dtypes from the headers) is applied; the
names, shapes and dtypes are then compared the way `load_weights(strict=True)` compares them,
and dtypes as well, which it does not (int32 scales load and decode other tokens). The MTP
sidecar is compared in the same way with the head the decoder builds from it.

Nothing is evaluated: MLX arrays are lazy, so a 35B model's parameters and stand-ins cost a
graph of a few thousand nodes, not their bytes. The global random state the model's
initialisers draw from is put back, so a check never changes what a seeded caller draws.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtpkit.loaders.bundle import BundleView
from mtpkit.loaders.families import Family
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.mtp import MTPLayout
from mtpkit.loaders.quant import ModuleQuant
from mtpkit.loaders.safetensors_header import TensorInfo

# Safetensors dtypes as MLX holds them once loaded (mx.load gives fp8 as uint8).
MX_DTYPES = {
    "BOOL": mx.bool_, "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16, "I16": mx.int16,
    "U32": mx.uint32, "I32": mx.int32, "U64": mx.uint64, "I64": mx.int64, "F16": mx.float16,
    "BF16": mx.bfloat16, "F32": mx.float32, "F64": mx.float64, "C64": mx.complex64,
    "F8_E4M3": mx.uint8, "F8_E5M2": mx.uint8, "F8_E8M0": mx.uint8,
}
# Earlier findings that make this comparison moot or misleading: tensors unread or dropped, a
# config no model should be built from (a 100,000-layer claim), quantized modules already
# reported. Their own findings name the problem.
TRUNK_PREREQUISITES = ("files.", "index.", "safetensors.", "config.", "quant.")
HEAD_PREREQUISITES = ("mtp.incomplete", "mtp.experts_unstacked", "mtp.unsupported")
# Quantization methods whose loader path rewrites the tensors before load_weights (mlx-lm's
# load_model): not modelled here, so such checkpoints are left to their own loader.
REWRITTEN = ("bitnet", "awq", "gptq")
LISTED = 10  # per-tensor findings of one code before the rest are counted in one more
DRAFT_VOCAB = "mtp.draft_vocab"  # the head casts it to int32, whatever it is stored as


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """Model initialisers draw from MLX's global key; put it back afterwards."""
    hi, lo = mx.random.state[0].tolist()
    try:
        yield
    finally:
        mx.random.seed((hi << 32) | lo)


def _stand_ins(tensors: dict[str, TensorInfo]) -> dict[str, mx.array] | None:
    """Lazy zeros of each tensor's shape and dtype (never evaluated, so never allocated);
    None where a dtype has no MLX form (fp4/fp6: mlx-lm cannot load those either)."""
    if any(i.dtype not in MX_DTYPES for i in tensors.values()):
        return None
    return {n: mx.zeros(i.shape, MX_DTYPES[i.dtype]) for n, i in tensors.items()}


def _kind(dtype: mx.Dtype) -> str:
    return "float" if mx.issubdtype(dtype, mx.floating) else str(dtype).removeprefix("mlx.core.")


def _quantize(model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array],
              at: list[str]) -> bool:
    """Quantize `model` as mlx-lm's load_model does for this config and these tensors;
    False where its loader rewrites the tensors first (not modelled). `at` gets the path of
    each module as it is quantized (the last one names a failure)."""
    from mlx_lm import utils

    quantization = config.get("quantization")
    if quantization is None:
        qc = config.get("quantization_config") or (config.get("text_config") or {}).get(
            "quantization_config")
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method in REWRITTEN or config.get("quantize_activations"):
            return False
        if method in ("mxfp4", "mxfp8"):
            quantization = {"group_size": 32, "bits": 4 if method == "mxfp4" else 8,
                            "mode": method}
        elif (method == "fp8" and qc.get("scale_fmt") == "ue8m0"
              and list(qc.get("weight_block_size", ())) == [32, 32]):
            quantization = {"group_size": 32, "bits": 8, "mode": "mxfp8"}
        elif method == "compressed-tensors":
            quantization = utils._compressed_tensors_quantization(qc)
        elif method == "modelopt":
            settings = qc.get("quantization", qc)
            quantization = {"group_size": settings.get("group_size", 16), "bits": 4,
                            "mode": "nvfp4"}
        if quantization is None:
            return True
    declared = quantization

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        at.append(path)
        if path in declared:
            return declared[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        params = utils.infer_quant_config(path, module, weights)
        if f"{path}.global_scale" in weights and utils._takes_global_scale(module):
            params["global_scale"] = True
        return params

    nn.quantize(model, group_size=declared["group_size"], bits=declared["bits"],
                mode=declared.get("mode", "affine"), class_predicate=predicate)
    return True


def _compare(expected: dict[str, mx.array], actual: dict[str, mx.array],
             tensors: dict[str, TensorInfo], what: str,
             stored: dict[str, str] | None = None) -> list[Finding]:
    """load_weights(strict=True)'s comparison (unexpected, missing, shapes) plus dtype kinds:
    a float parameter takes any float dtype; packed weights and fp scales need theirs."""
    def where(name: str) -> str:
        info = tensors.get(name)
        return f"{info.file}:{(stored or {}).get(name, name)}" if info else name

    out: list[Finding] = []
    by_file: dict[str, list[str]] = {}
    for name in sorted(actual.keys() - expected.keys()):
        info = tensors.get(name)
        by_file.setdefault(info.file if info else "", []).append(name)
    for file, names in sorted(by_file.items()):
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        out.append(finding("weights.unexpected", f"{len(names)} tensor(s) that {what} has no "
                           f"parameter for ({shown}); its strict load refuses them", file))
    missing = [finding("weights.missing", f"{what} has this parameter; no tensor holds it", name)
               for name in sorted(expected.keys() - actual.keys())]
    shapes, dtypes = [], []
    for name in sorted(expected.keys() & actual.keys()):
        want, have = expected[name], actual[name]
        if tuple(want.shape) != tuple(have.shape):
            shapes.append(finding("weights.shape_mismatch", f"stored {list(have.shape)}, "
                                  f"{what} loads {list(want.shape)}", where(name)))
        elif name != DRAFT_VOCAB and _kind(want.dtype) != _kind(have.dtype):
            dtypes.append(finding("weights.dtype_mismatch", f"stored {_kind(have.dtype)}, "
                                  f"{what} computes with {_kind(want.dtype)}", where(name)))
    for found in (missing, shapes, dtypes):
        out += found[:LISTED]
        if len(found) > LISTED:
            out.append(finding(found[0].code, f"{len(found) - LISTED} more like the above",
                               found[LISTED].location))
    return out


def _build(config: dict[str, Any]) -> tuple[nn.Module, str]:
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(config)), model_cls.__module__.rsplit(".", 1)[-1]


def check_model(view: BundleView) -> list[Finding]:
    """Trunk tensors against mlx-lm's model for this config, the MTP head's against the head
    the decoder builds. Empty where a finding already made names a prerequisite problem (see
    TRUNK_PREREQUISITES). Imports mlx-lm (seconds), which is why open_bundle does not call it:
    doctor, load and convert do."""
    errors = [f.code for f in view.findings if f.severity == "error"]
    if any(c.startswith(TRUNK_PREREQUISITES) for c in errors) or view.config.model_type is None:
        return []
    mtp = view.mtp
    head_names = set(mtp.source_names.values())
    trunk = {n: i for n, i in view.weights.trunk.items() if n not in head_names}
    stand_ins = _stand_ins(trunk)
    if stand_ins is None:
        return []
    raw = copy.deepcopy(view.config.raw)
    first = view.weights.trunk_files[0] if view.weights.trunk_files else "config.json"
    with _random_state_kept(), contextlib.redirect_stdout(io.StringIO()):
        try:
            model, name = _build(raw)
        except Exception as exc:  # noqa: BLE001 - mlx-lm's classes raise anything on a bad config
            return [finding("config.invalid", f"mlx-lm cannot build the model from config.json: "
                            f"{type(exc).__name__}: {str(exc)[:200]}", "config.json")]
        what = f"mlx-lm's {name} model"
        sanitized = stand_ins
        if hasattr(model, "sanitize"):
            try:
                sanitized = model.sanitize(dict(stand_ins))
            except KeyError as exc:
                return [finding("weights.missing", f"{what}'s sanitize needs tensor {exc}", first)]
            except (ValueError, TypeError, IndexError) as exc:
                return [finding("weights.shape_mismatch", f"{what}'s sanitize fails on these "
                                f"shapes: {str(exc)[:200]}", first)]
        at: list[str] = []
        try:
            if not _quantize(model, raw, sanitized, at):
                return []
        except ValueError as exc:  # MLX cannot quantize a module at the width the class gives
            path = at[-1] if at else first
            module = dict(model.named_modules()).get(path)
            weight = sanitized.get(f"{path}.weight")
            if module is None or weight is None or "weight" not in module:
                return [finding("quant.unsupported", f"{what} cannot be quantized as these "
                                f"tensors are: {str(exc)[:200]}", path)]
            return [finding("quant.unsupported", f"packed {list(weight.shape)} fits no "
                            f"quantization of the {module.weight.shape[-1]} inputs {what} "
                            "gives this module", path)]
        out = _compare(dict(tree_flatten(model.parameters())), sanitized, trunk, what)
        # A checkpoint's head is converted before anything loads it (experts stacked, MLA
        # split): only a bundle's is what the decoder builds from.
        if (mtp.tensors and view.kind == "mlx" and not out
                and not any(c in HEAD_PREREQUISITES for c in errors)):
            out += _check_head(model, view.family, mtp, view.mtp_quantization)
    return out


def _check_head(model: nn.Module, family: Family, mtp: MTPLayout,
                quant: dict[str, ModuleQuant]) -> list[Finding]:
    """The sidecar against the head decoder/model/head.py builds on this trunk: its constructor runs
    as at load, with its load step recording instead of loading, so its parameters stay the
    ones it expects."""
    from mtpkit.decoder.model.head import Contract, MTPHead, canonical_name
    from mtpkit.decoder.model.trunk import Trunk

    stand_ins = _stand_ins(mtp.tensors)
    if stand_ins is None:
        return []
    head = MTPHead.__new__(MTPHead)
    loaded: dict[str, mx.array] = {}  # what the head hands its load (a router dequantized)

    def record(weights: list[tuple[str, mx.array]], strict: bool = True) -> MTPHead:
        loaded.update((canonical_name(k), v) for k, v in weights)
        return head

    object.__setattr__(head, "load_weights", record)
    try:
        MTPHead.__init__(head, Trunk(model), stand_ins, Contract(), family.mtp_layer_kind, quant)
    except ValueError as exc:  # a quantized triple whose parts do not fit together
        return [finding("weights.shape_mismatch", f"the MTP head cannot be built: {exc}",
                        mtp.location or "")]
    expected = {canonical_name(k): v for k, v in tree_flatten(head.parameters())}
    return _compare(expected, loaded, mtp.tensors, "the MTP head the decoder builds",
                    mtp.source_names)


def blocking(view: BundleView) -> list[Finding]:
    """What keeps a bundle from loading: the view's errors and the model check's (load and
    convert refuse on these, doctor reports them)."""
    return [*view.errors, *(f for f in check_model(view) if f.severity == "error")]


__all__ = ["blocking", "check_model"]
