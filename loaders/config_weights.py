"""config.json against the tensors: the layer count and every dimension a tensor's shape pins.

mlx-lm builds the model from the config before it reads a weight, so a config claiming 100000
layers on a 4-layer bundle allocates until the process dies (issue 31). The headers already say
how many layers there are and how wide each is: a config they contradict is reported
(config.weights_mismatch, an error, so generate and serve refuse before building anything).
Only names and shapes are used; no tensor data is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from mtpkit.loaders.config import ModelConfig
from mtpkit.loaders.families import (
    GENERIC,
    TRUNK_LAYER,
    TRUNK_PREFIX,
    UNIVERSAL_SHAPE_RULES,
    Family,
    ShapeRule,
)
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.quant import ModuleQuant
from mtpkit.loaders.safetensors_header import TensorInfo
from mtpkit.loaders.weights import Weights

_PREFIX = re.compile(TRUNK_PREFIX)
_LAYER = re.compile(TRUNK_LAYER)
_INDEX = re.compile(r"\.\d+\.")


@dataclass
class _Contradiction:
    rule: ShapeRule
    want: int
    name: str
    shape: tuple[int, ...]
    got: int
    count: int = 1


def check_config_weights(cfg: ModelConfig, fam: Family, weights: Weights,
                         mtp_names: Iterable[str],
                         quantization: dict[str, ModuleQuant]) -> list[Finding]:
    """Findings for config values the trunk's tensors contradict (the MTP head is not counted:
    DeepSeek numbers it after the trunk's layers, and its own checks cover it)."""
    if not cfg.text:
        return []
    head = set(mtp_names)
    trunk = {name: info for name, info in weights.trunk.items() if name not in head}
    paths = {name: _PREFIX.sub("", name, count=1) for name in trunk}
    # Absent tensors prove nothing when a shard was refused or unreadable.
    whole = not any(f.severity == "error" for f in weights.findings)
    out = _layers(cfg, fam, paths, whole)
    out += _shapes(cfg, fam, trunk, paths, quantization)
    return out


def _span(indices: list[int]) -> str:
    return f"{indices[0]}..{indices[-1]}" if len(indices) > 1 else str(indices[0])


def _gaps(held: list[int], limit: int = 5) -> list[int]:
    """The first missing indices below the highest one held (walks the held list, never the
    declared range, which may be astronomically large)."""
    out: list[int] = []
    expect = 0
    for i in held:
        while expect < i and len(out) < limit:
            out.append(expect)
            expect += 1
        if len(out) >= limit:
            break
        expect = i + 1
    return out


def _layers(cfg: ModelConfig, fam: Family, paths: dict[str, str], whole: bool) -> list[Finding]:
    key = fam.layers_key
    declared = cfg.dim(key)
    found = sorted({int(m["layer"]) for p in paths.values() if (m := _LAYER.match(p))})
    if declared is None or declared <= 0 or not found:
        return []  # no count to check, or a naming the table does not know
    held = [i for i in found if i < declared]
    beyond = [i for i in found if i >= declared]
    where = f"config.json:{key}"
    if whole and len(held) < declared:
        gaps = _gaps(held)
        return [finding("config.weights_mismatch", f"config says {key} = {declared}, but the "
                        f"tensors hold {len(found)} layer(s) ({_span(found)})"
                        + (f"; no tensors for layer(s) {', '.join(map(str, gaps))}"
                           if gaps else ""), where)]
    if beyond and fam is not GENERIC:
        # An unknown family may number extra blocks (an MTP head) after the trunk's layers.
        return [finding("config.weights_mismatch", f"config says {key} = {declared}, but the "
                        f"tensors hold layer(s) {_span(beyond)} beyond it", where)]
    return []


def _width(name: str, info: TensorInfo, quantization: dict[str, ModuleQuant]) -> int | None:
    """A tensor's logical last dimension: a quantized weight packs it, so its measured
    quantization unpacks it. None when that cannot be told from the shapes alone (a width
    decided from this very config proves nothing about it)."""
    mq = quantization.get(name.rsplit(".", 1)[0])
    if mq is None:
        return info.shape[-1] if info.dtype != "U32" else None
    if mq.quant is None or mq.decided_by in ("in_features", "ambiguous") or not name.endswith(
            ".weight"):
        return None
    return info.shape[-1] * 32 // mq.quant.bits


def _shapes(cfg: ModelConfig, fam: Family, trunk: dict[str, TensorInfo], paths: dict[str, str],
            quantization: dict[str, ModuleQuant]) -> list[Finding]:
    rules = (*UNIVERSAL_SHAPE_RULES, *fam.shape_rules)
    expected = {rule: rule.expected(cfg.text) for rule in rules}
    matching: dict[str, list[tuple[ShapeRule, re.Pattern[str]]]] = {}
    compiled = {rule: re.compile(rule.pattern) for rule in rules if expected[rule] is not None}
    hits: dict[str, _Contradiction] = {}
    for name, path in sorted(paths.items()):
        # Rules are matched once per name pattern (layer and expert numbers blanked), since a
        # large MoE bundle holds 100k tensors of a few dozen kinds.
        kind = _INDEX.sub(".#.", path)
        if kind not in matching:
            matching[kind] = [(r, c) for r, c in compiled.items() if c.match(path)]
        info = trunk[name]
        for rule, _ in matching[kind]:
            if len(info.shape) < -rule.axis if rule.axis < 0 else len(info.shape) <= rule.axis:
                continue
            got = (_width(name, info, quantization) if rule.axis == -1
                   else info.shape[rule.axis])
            want = expected[rule]
            if got is None or got == want or want is None:
                continue
            key = re.search(r"[a-z][a-z_]*", rule.says)
            label = key[0] if key else rule.says
            if label in hits:
                hits[label].count += 1
            else:
                hits[label] = _Contradiction(rule, want, name, info.shape, got)
    return [finding("config.weights_mismatch",
                    f"config says {c.rule.says} = {c.want}{_parts(c.rule, cfg)}, but {c.name} "
                    f"{list(c.shape)} holds {c.got}"
                    + (f" (and {c.count - 1} more tensor(s) disagree)" if c.count > 1 else ""),
                    f"config.json:{label}")
            for label, c in sorted(hits.items())]


def _parts(rule: ShapeRule, cfg: ModelConfig) -> str:
    """The config values behind a compound expectation, so the finding names each one."""
    names = re.findall(r"[a-z][a-z_]*", rule.says)
    if len(names) < 2:
        return ""
    shown = [f"{n} = {cfg.text[n]}" for n in names if n in cfg.text]
    return f" ({', '.join(shown)})" if shown else ""
