"""Declared quantization versus measured: trunk (config `quantization`) and sidecar
(`mtplx_mtp_quantization` and per-module entries). Disagreements are grouped so a bundle with
3000 mislabelled modules gives one readable finding, not 3000."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from mtpkit.loaders.config import ModelConfig
from mtpkit.loaders.families import stacked_modules
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.quant import (
    MODE_DEFAULTS,
    SIDECAR_POLICIES,
    Module,
    ModuleQuant,
    Quant,
    measure,
    parse_declared,
)


def _examples(paths: list[str]) -> str:
    shown = ", ".join(paths[:3])
    return shown + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")


def _grouped(code: str, groups: dict[tuple[str, str], list[str]],
             severity: dict[tuple[str, str], str]) -> list[Finding]:
    out = []
    for (claim, truth), paths in sorted(groups.items()):
        paths.sort()
        out.append(finding(code, f"{claim}, but the tensors are {truth}: {len(paths)} module(s), "
                           f"e.g. {_examples(paths)}", paths[0], severity=severity[(claim, truth)]))
    return out


def _shape_findings(measured: dict[str, ModuleQuant]) -> list[Finding]:
    out = []
    for mq in measured.values():
        if mq.incomplete:
            out.append(finding("quant.incomplete", mq.incomplete, mq.path))
        elif mq.problem:
            out.append(finding("quant.unsupported", mq.problem, mq.path))
        elif mq.decided_by == "ambiguous":
            out.append(finding("quant.ambiguous", "shapes fit " + " / ".join(
                str(q) for q in mq.candidates) + f"; assuming {mq.quant}", mq.path))
    return out


def _declared_map(cfg: ModelConfig) -> tuple[Quant | None, dict[str, Any]]:
    q = cfg.quantization or {}
    per_module = {k: v for k, v in q.items() if isinstance(v, dict | bool)}
    top = parse_declared(q) if q else None
    return (top if isinstance(top, Quant) else None), per_module


def check_trunk(modules: dict[str, Module], cfg: ModelConfig) -> tuple[dict[str, ModuleQuant],
                                                                         list[Finding]]:
    top, per_module = _declared_map(cfg)
    hints = {p: d for p, e in per_module.items() if isinstance(d := parse_declared(e), Quant)}
    measured = measure(modules, cfg.text, {p: hints.get(p, top) for p in modules})
    findings = _shape_findings(measured)
    raw = cfg.quantization or {}
    if raw and raw.get("mode", "affine") not in MODE_DEFAULTS:
        findings.append(finding("quant.unsupported", f"declared mode {raw.get('mode')!r} is not "
                                "an MLX quantization mode", "config.json:quantization.mode"))
    quantized = {p: mq for p, mq in measured.items() if mq.quant}
    if quantized and cfg.quantization is None:
        findings.append(finding(
            "quant.config_mismatch", f"{len(quantized)} modules are quantized but config.json "
            "declares no quantization, so mlx-lm builds float layers and fails to load",
            "config.json"))
        return measured, findings
    if cfg.quantization is not None and not quantized:
        findings.append(finding("quant.config_mismatch", "config.json declares quantization "
                                "but no tensor is quantized", "config.json", severity="warning"))
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    severity: dict[tuple[str, str], str] = {}
    for path, mq in quantized.items():
        entry = per_module.get(path)
        claim = parse_declared(entry) if entry is not None else top
        if claim == mq.quant:
            continue
        if entry is not None:
            key = (f"config entry for the module says {'not quantized' if claim is False else claim}",
                   str(mq.quant))
            severity[key] = "error"  # mlx-lm trusts per-module entries and fails on shapes
        else:
            key = (f"config.json top-level quantization says {claim}", str(mq.quant))
            severity[key] = "warning"  # mlx-lm infers from shapes; other readers trust it
        groups[key].append(path)
    for path, entry in per_module.items():
        mod = modules.get(path)
        weight = mod.params.get("weight") if mod else None
        if isinstance(parse_declared(entry), Quant) and weight is not None and path not in measured:
            key = ("config entry says quantized", f"unquantized {weight.dtype}")
            severity[key] = "error"
            groups[key].append(path)
    findings += _grouped("quant.config_mismatch", groups, severity)
    return measured, findings


def _sidecar_claims(cfg: ModelConfig) -> tuple[Quant | None, dict[str, Any]]:
    declared = cfg.mtp_quantization or {}
    claim = parse_declared(declared) if {"bits", "group_size"} & set(declared) else None
    return (claim if isinstance(claim, Quant) else None), declared


def check_sidecar(modules: dict[str, Module], source_names: dict[str, str],
                  cfg: ModelConfig) -> tuple[dict[str, ModuleQuant], list[Finding]]:
    """Sidecar modules are keyed by canonical name; per-module config entries by stored name."""
    claim, declared = _sidecar_claims(cfg)
    top, per_module = _declared_map(cfg)
    stored = {c.rsplit(".", 1)[0]: s.rsplit(".", 1)[0] for c, s in source_names.items()}

    def claim_for(path: str) -> Quant | bool | None:
        entry = per_module.get(stored.get(path, path))
        return parse_declared(entry) if entry is not None else claim

    measured = measure(modules, cfg.text, {p: c for p in modules
                                           if isinstance(c := claim_for(p), Quant)})
    findings = _shape_findings(measured)
    quantized = {p: mq for p, mq in measured.items() if mq.quant}
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path, mq in quantized.items():
        said = claim_for(path)
        if said is None:
            if top is not None and top != mq.quant:
                groups[(f"nothing declares the sidecar's quantization (readers fall back to the "
                        f"trunk's {top})", str(mq.quant))].append(path)
        elif said != mq.quant:
            groups[(f"declared {'not quantized' if said is False else said}",
                    str(mq.quant))].append(path)
    findings += _grouped("mtp.group_mismatch", groups, dict.fromkeys(groups, "error"))
    findings += _policy_findings(declared, quantized, modules)
    return measured, findings


def _policy_findings(declared: dict[str, Any], quantized: dict[str, ModuleQuant],
                     modules: dict[str, Module]) -> list[Finding]:
    out: list[Finding] = []
    where = "config.json:mtplx_mtp_quantization"
    meaning = SIDECAR_POLICIES.get(declared.get("policy")) if isinstance(
        declared.get("policy"), str | type(None)) else None
    fc_quantized = any(p.endswith(".fc") or p == "mtp.fc" for p in quantized)
    layers_quantized = any(".layers." in p for p in quantized)
    truth = "all" if fc_quantized else "layers" if layers_quantized else "keep"
    if meaning and meaning != truth:
        out.append(finding("mtp.group_mismatch", f"policy {declared['policy']!r} means "
                           f"{meaning!r} but the sidecar tensors are quantized as {truth!r}", where))
    pre = declared.get("prequantized")
    if isinstance(pre, bool) and pre != bool(quantized):
        out.append(finding("mtp.group_mismatch", f"prequantized is {pre} but the sidecar has "
                           f"{len(quantized)} quantized modules", where))
    listed = declared.get("quantized_modules")
    if isinstance(listed, list) and modules:
        strip = {m.removeprefix("mtp.") for s in listed for m in stacked_modules(str(s))}
        actual = {m.removeprefix("mtp.") for p in quantized for m in stacked_modules(p)}
        if strip != actual:
            diff = sorted(strip ^ actual)
            out.append(finding("mtp.group_mismatch", "quantized_modules lists "
                               f"{len(strip)} modules, the tensors quantize {len(actual)}; "
                               f"differing: {_examples(diff)}", where))
    return out
