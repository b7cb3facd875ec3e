"""Infer each module's quantization from tensor shapes and dtypes, and compare with what the
bundle declares. The measured values win; every disagreement becomes a finding.

MLX layouts (reference/checkpoints.md): affine weight uint32 [..., out, in*bits/32] with float
scales and biases [..., out, in/group]; mxfp4 / nvfp4 / mxfp8 keep uint8 scales and no biases.
From shapes alone bits*group is fixed but not the pair, so the module's true input width
decides; without it the declared value is accepted when it fits, else the result is ambiguous.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from mtpkit.loaders.families import IN_FEATURES_RULES
from mtpkit.loaders.safetensors_header import FLOAT_DTYPES, TensorInfo

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (64, 32, 128)  # preference order when nothing else decides
SCALED_FP_MODES = {(4, 32): "mxfp4", (4, 16): "nvfp4", (8, 32): "mxfp8"}
MODE_DEFAULTS = {"affine": (4, 64), "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
PARAM_SUFFIXES = ("weight", "scales", "biases", "bias", "global_scale")

# Sidecar policy names in the wild and what each quantizes: "layers" = the decoder layer only
# (fc and norms full precision), "all" = every linear, None = no claim about which modules.
SIDECAR_POLICIES: dict[str | None, str | None] = {
    None: None, "all": "all", "cyankiwi": "layers", "prequantized-int4": "layers",
    "keep": "keep", "layers": "layers",
}


@dataclass(frozen=True)
class Quant:
    mode: str
    bits: int
    group_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "bits": self.bits, "group_size": self.group_size}

    def __str__(self) -> str:
        return f"{self.mode} {self.bits}-bit g{self.group_size}"


@dataclass
class ModuleQuant:
    """One quantized module as measured: the answer (when decided) and how it was decided."""

    path: str
    candidates: tuple[Quant, ...]
    in_features: int | None
    quant: Quant | None = None
    decided_by: str = "shape"  # shape | in_features | declared | ambiguous
    problem: str | None = None  # set when the tensors fit no supported layout
    incomplete: str | None = None


@dataclass
class Module:
    path: str
    params: dict[str, TensorInfo] = field(default_factory=dict)


def group_modules(tensors: dict[str, TensorInfo]) -> dict[str, Module]:
    """Group tensors by module path (the name minus weight/scales/biases/...)."""
    modules: dict[str, Module] = {}
    for name, info in tensors.items():
        path, _, param = name.rpartition(".")
        if param not in PARAM_SUFFIXES or not path:
            continue
        modules.setdefault(path, Module(path)).params[param] = info
    return modules


def in_features(path: str, modules: dict[str, Module], config: dict[str, Any]) -> int | None:
    """True input width of the linear at `path`, from a sibling's rows or the config dims."""
    for pattern, rule in IN_FEATURES_RULES:
        if not re.search(pattern, path):
            continue
        if isinstance(rule, str):
            sibling = modules.get(path.rsplit(".", 1)[0] + "." + rule)
            weight = sibling.params.get("weight") if sibling else None
            return weight.shape[-2] if weight is not None and len(weight.shape) >= 2 else None
        try:
            return rule(config, path)
        except (KeyError, TypeError):
            return None
    return None


def candidates_for(weight: TensorInfo, scales: TensorInfo, has_biases: bool) -> tuple[Quant, ...]:
    packed, groups = weight.shape[-1], scales.shape[-1]
    if scales.dtype == "U8":
        pairs = [(b, g, mode) for (b, g), mode in SCALED_FP_MODES.items()]
    else:
        pairs = [(b, g, "affine") for g in AFFINE_GROUPS for b in AFFINE_BITS]
    out = []
    for bits, group, mode in pairs:
        if (packed * 32) % bits == 0 and (packed * 32) // bits == group * groups:
            out.append(Quant(mode, bits, group))
    return tuple(out)


def _incomplete(mod: Module) -> str | None:
    w, s, b = (mod.params.get(k) for k in ("weight", "scales", "biases"))
    if s is None:
        return "uint32 weight without scales" if w is not None and w.dtype == "U32" else None
    if w is None:
        return "scales without a weight"
    if w.dtype != "U32":
        return f"scales next to a {w.dtype} weight (packed weights are uint32)"
    if s.dtype in FLOAT_DTYPES and b is None:
        return "affine scales without biases"
    if b is not None and b.shape != s.shape:
        return f"biases {list(b.shape)} do not match scales {list(s.shape)}"
    if len(w.shape) < 2 or w.shape[:-1] != s.shape[:-1]:
        return f"weight {list(w.shape)} and scales {list(s.shape)} disagree on the leading dims"
    return None


def measure(modules: dict[str, Module], config: dict[str, Any],
            declared: dict[str, Quant]) -> dict[str, ModuleQuant]:
    """Measure every module that carries scales (or a packed weight). `declared` maps module
    paths to what the bundle claims, used only to settle shape ambiguity."""
    out: dict[str, ModuleQuant] = {}
    for path, mod in modules.items():
        w, s = mod.params.get("weight"), mod.params.get("scales")
        if s is None and (w is None or w.dtype != "U32"):
            continue
        width = in_features(path, modules, config)
        mq = ModuleQuant(path, (), width, incomplete=_incomplete(mod))
        out[path] = mq
        if mq.incomplete:
            continue
        mq.candidates = candidates_for(w, s, "biases" in mod.params)
        fitting = [q for q in mq.candidates if width and q.group_size * s.shape[-1] == width]
        claim = declared.get(path)
        if fitting:
            mq.quant, mq.decided_by = fitting[0], "in_features"
        elif width and mq.candidates:
            mq.problem = (f"packed width {w.shape[-1]} with {s.shape[-1]} scale groups fits no "
                          f"supported quantization of {width} inputs")
        elif len(mq.candidates) == 1:
            mq.quant = mq.candidates[0]
        elif claim in mq.candidates:
            mq.quant, mq.decided_by = claim, "declared"
        elif mq.candidates:
            mq.quant, mq.decided_by = mq.candidates[0], "ambiguous"
        else:
            mq.problem = (f"packed width {w.shape[-1]} with {s.shape[-1]} scale groups fits no "
                          "supported MLX quantization")
    return out


def parse_declared(entry: Any) -> Quant | None | bool:
    """A config quantization entry as a Quant; False for an explicit `false`; None if unusable."""
    if entry is False:
        return False
    if not isinstance(entry, dict):
        return None
    mode = entry.get("mode", "affine")
    default_bits, default_group = MODE_DEFAULTS.get(mode, (None, None))
    bits, group = entry.get("bits", default_bits), entry.get("group_size", default_group)
    if isinstance(bits, int) and isinstance(group, int) and isinstance(mode, str):
        return Quant(mode, bits, group)
    return None


def summarize(measured: dict[str, ModuleQuant]) -> dict[str, Any]:
    """Counts of modules per measured quantization, for reports and the manifest."""
    counts: dict[str, int] = defaultdict(int)
    for mq in measured.values():
        counts[str(mq.quant) if mq.quant else "unresolved"] += 1
    return dict(sorted(counts.items()))
