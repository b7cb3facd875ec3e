"""Where the MTP head is, what layout it uses, and whether a runtime can build it from it."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import numpy as np

from mtpkit.loaders.config import ModelConfig
from mtpkit.loaders.families import (
    HEAD_ROLES,
    Family,
    canonical_mtp_name,
    expert_layout,
    is_shifted_norm,
)
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.norms import DESCRIPTIONS, NormDecision, decide
from mtpkit.loaders.quant import SIDECAR_POLICIES
from mtpkit.loaders.safetensors_header import TensorInfo
from mtpkit.loaders.tensor_data import read_small
from mtpkit.loaders.weights import SIDECAR_NAMES, Weights

# Values MTPLX reads as "sidecar norms are stored zero-centred; add +1 when loading".
DELTA_ENCODINGS = {"delta", "delta_plus_one", "mlx_delta"}


@dataclass
class MTPLayout:
    """The MTP head as found: canonical name -> tensor, and facts about its layout."""

    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    source_names: dict[str, str] = field(default_factory=dict)  # canonical -> stored name
    location: str | None = None  # "sidecar", "trunk", "both" or None when absent
    declared_layers: int = 0
    blocks: int = 0
    expert_layout: str | None = None
    num_experts: int | None = None
    norm_encoding: str | None = None
    norms: NormDecision | None = None  # the head's norm convention and its evidence
    stray: str | None = None  # the head was found in this file, a name no runtime looks for
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "present": bool(self.tensors), "location": self.location,
            "declared_layers": self.declared_layers, "blocks": self.blocks,
            "tensor_count": len(self.tensors), "expert_layout": self.expert_layout,
            "num_experts": self.num_experts, "norm_encoding": self.norm_encoding,
            "norm_evidence": [e.to_dict() for e in self.norms.evidence] if self.norms else [],
        }


def _canonical(name: str, fam: Family, cfg: ModelConfig, in_sidecar: bool) -> str | None:
    found = canonical_mtp_name(name, fam, cfg.text)
    if found is None and in_sidecar:
        # Some sidecars store names with the `mtp.` namespace stripped.
        first = name.split(".", 1)[0]
        if first in HEAD_ROLES or first in ("layers", "heads"):
            found = "mtp." + name
    return found


def _is_head(names: list[str], fam: Family, cfg: ModelConfig) -> bool:
    """Every tensor is part of an MTP head and one of them is the head's own (a role such as
    fc or norm, or a decoder layer under mtp.), so a stray adapter or trunk copy is not one."""
    canon = [_canonical(n, fam, cfg, True) for n in names]
    return bool(canon) and all(canon) and any(
        c.startswith(("mtp.layers.", *(f"mtp.{r}." for r in HEAD_ROLES))) for c in canon if c)


def _adopt_stray(weights: Weights, fam: Family, cfg: ModelConfig) -> str | None:
    """The first stray safetensors file whose tensors are a head, read as the sidecar."""
    for name, header in sorted(weights.strays.items()):
        if _is_head(list(header.tensors), fam, cfg):
            weights.adopt(name)
            return name
    return None


def collect(weights: Weights, fam: Family, cfg: ModelConfig) -> MTPLayout:
    layout = MTPLayout(declared_layers=cfg.num_mtp_layers)
    if weights.sidecar_file is None and not any(
            canonical_mtp_name(n, fam, cfg.text) for n in weights.trunk):
        layout.stray = _adopt_stray(weights, fam, cfg)
    seen = {"trunk": False, "sidecar": False}
    for scope, tensors in (("trunk", weights.trunk), ("sidecar", weights.sidecar)):
        for name, info in tensors.items():
            canon = _canonical(name, fam, cfg, scope == "sidecar")
            if canon is None:
                continue
            seen[scope] = True
            layout.tensors[canon] = info
            layout.source_names[canon] = name
    layout.location = ("both" if all(seen.values()) else
                       "trunk" if seen["trunk"] else "sidecar" if seen["sidecar"] else None)
    blocks = {int(m[1]) for c in layout.tensors if (m := re.match(r"mtp\.layers\.(\d+)\.", c))}
    layout.blocks = max(blocks) + 1 if blocks else 0
    if layout.tensors and not layout.declared_layers:
        layout.declared_layers = fam.default_mtp_layers
    return layout


def check(layout: MTPLayout, weights: Weights, fam: Family, cfg: ModelConfig, kind: str,
          root: Path) -> None:
    add = layout.findings.append
    if not layout.tensors:
        if layout.declared_layers > 0:
            add(finding("mtp.missing", f"config declares {layout.declared_layers} MTP layer(s) but "
                        "no MTP tensors exist (a converter dropped them?)", "config.json"))
        else:
            add(finding("mtp.absent", "no MTP head in this bundle", ""))
        return
    if layout.declared_layers == 0:
        add(finding("config.invalid", f"{len(layout.tensors)} MTP tensors present but the config "
                    "declares no MTP layers (mtp_num_hidden_layers / num_nextn_predict_layers), "
                    "so runtimes will not build the head", "config.json", fixable=True,
                    hint="set mtp_num_hidden_layers (mtpkit doctor --fix)"))
    if layout.stray is not None:
        layout.findings.append(finding(
            "mtp.stray_sidecar", f"the MTP head is in {layout.stray}, a file MTP runtimes do not "
            f"look for ({', '.join(SIDECAR_NAMES)} or config mlx_lm_extra_tensors.mtp_file), so "
            "they run without it", layout.stray))
    if fam.unsupported:
        add(finding("mtp.unsupported", f"{fam.name} MTP head recognised and kept "
                    f"({len(layout.tensors)} tensors), but mtpkit's decoder cannot run it: "
                    f"{fam.unsupported}", next(iter(layout.tensors.values())).file))
    _check_placement(layout, weights, kind)
    _check_complete(layout, fam)
    _check_experts(layout, cfg, fam, kind)
    _check_norms(layout, weights, fam, cfg, root, kind)
    _check_policy(layout, cfg)


def _check_placement(layout: MTPLayout, weights: Weights, kind: str) -> None:
    if kind != "mlx":
        return  # a Hugging Face checkpoint keeps its head in its shards; that is its format
    in_trunk = sorted({i.file for c, i in layout.tensors.items() if i.file in weights.trunk_files})
    for file in in_trunk:
        count = sum(1 for i in layout.tensors.values() if i.file == file)
        layout.findings.append(finding(
            "mtp.in_trunk", f"{count} MTP tensors inside trunk shard {file}: stock mlx-lm fails "
            "strict load on them and MTP runtimes look for a sidecar", file))
    sidecar = weights.sidecar_file
    if sidecar and fnmatch(sidecar, "model*.safetensors"):
        layout.findings.append(finding(
            "mtp.in_trunk", f"sidecar {sidecar} matches model*.safetensors, so mlx-lm loads it "
            "as trunk weights and fails strict load", sidecar))


def _has(layout: MTPLayout, prefix: str) -> bool:
    return any(c.startswith(prefix) for c in layout.tensors)


def _check_complete(layout: MTPLayout, fam: Family) -> None:
    """Every block holds the family's layer parts, and the head its roles (per block, for
    families that give each block its own)."""
    n = max(layout.declared_layers, layout.blocks)
    per_block_heads = fam.head_roles != {} and not fam.shared_roles
    missing: list[str] = []
    for k in range(n):
        scope = "mtp." if k == 0 else f"mtp.heads.{k}."
        if k == 0 or per_block_heads:
            missing += [scope + r for r in fam.required_roles
                        if f"{scope}{r}.weight" not in layout.tensors]
        layer = f"mtp.layers.{k}."
        missing += [layer + part for part in fam.layer_parts if not _has(layout, f"{layer}{part}.")]
        if _has(layout, layer + "self_attn.") and not any(  # (LongCat's: self_attn.0.o_proj)
                re.match(rf"{re.escape(layer)}self_attn\.(?:\d+\.)?o_proj\.", c)
                for c in layout.tensors):
            missing.append(layer + "self_attn.o_proj")
    if missing:
        shown = ", ".join(missing[:6]) + (f" (+{len(missing) - 6} more)" if len(missing) > 6 else "")
        layout.findings.append(finding("mtp.incomplete", f"missing {shown}",
                                       missing[0]))


def _check_experts(layout: MTPLayout, cfg: ModelConfig, fam: Family, kind: str) -> None:
    layouts: dict[str, set[int]] = {}
    stacked_counts: set[int] = set()
    for canon, info in layout.tensors.items():
        hit = expert_layout(canon)
        if not hit:
            continue
        name, m = hit
        layouts.setdefault(name, set())
        if name == "numbered":
            layouts[name].add(int(m["expert"]))
        elif len(info.shape) >= 3:
            stacked_counts.add(info.shape[0])
    if not layouts:
        return
    layout.expert_layout = "mixed" if len(layouts) > 1 else next(iter(layouts))
    expected = cfg.dim(fam.experts_key) or cfg.dim("num_experts") or cfg.dim("n_routed_experts")
    counts = {len(layouts["numbered"])} if "numbered" in layouts else set()
    counts |= stacked_counts
    layout.num_experts = max(counts) if counts else None
    if expected and counts and counts != {expected}:
        layout.findings.append(finding(
            "mtp.incomplete", f"MTP MoE holds {sorted(counts)} experts; config says {expected}",
            "mtp.layers.0.mlp"))
    unstacked = set(layouts) - {"stacked"}
    if kind == "mlx" and unstacked:
        layout.findings.append(finding(
            "mtp.experts_unstacked",
            f"MTP experts stored {'/'.join(sorted(unstacked))} "
            f"({sum(1 for c in layout.tensors if '.experts.' in c)} tensors); MLX runtimes "
            "expect them stacked as mlp.switch_mlp.* and some leave them at random values",
            layout.source_names[next(c for c in layout.tensors if ".experts." in c)]))


def _means(root: Path, infos: dict[str, TensorInfo]) -> dict[str, float]:
    """Mean of each small 1-D gain that reads back finite (damage is --deep's to report)."""
    out = {}
    for name, info in infos.items():
        values = read_small(root, info)
        if values is not None and values.size:
            mean = float(values.astype(np.float64).mean())
            if math.isfinite(mean):
                out[name] = mean
    return out


def _check_norms(layout: MTPLayout, weights: Weights, fam: Family, cfg: ModelConfig,
                 root: Path, kind: str) -> None:
    """Decide the head's norm convention against the trunk's gains (reads only 1-D gains)."""
    if not fam.zero_centred_norms:
        return
    trunk = _means(root, {n: i for n, i in weights.trunk.items()
                          if is_shifted_norm(n) and n not in layout.source_names.values()
                          and len(i.shape) == 1})
    head = _means(root, {c: i for c, i in layout.tensors.items()
                         if is_shifted_norm(c) and len(i.shape) == 1})
    if not trunk or not head:
        return
    decision = decide(head, trunk, trunk_level=1 if kind == "mlx" else 0)
    layout.norms, layout.norm_encoding = decision, decision.encoding
    declared = str((cfg.mtp_quantization or {}).get("norm_encoding", "")).strip().lower()
    delta = kind == "mlx" and declared in DELTA_ENCODINGS
    expected = (0 if delta else decision.trunk_level) - decision.trunk_level
    if decision.consistent and decision.offset in (None, expected):
        return
    trunk_is = DESCRIPTIONS[decision.trunk_level]
    if decision.consistent:
        level = decision.trunk_level + decision.offset
        how = (f"MTP norm gains are {DESCRIPTIONS[level]}"
               + (", declared delta, so a runtime adds +1 again" if delta else
                  ", not declared delta, so runtimes load them as is" if level == 0 else "")
               + f"; the trunk's are {trunk_is}")
    else:
        counts = Counter(DESCRIPTIONS.get(decision.trunk_level + o, "undecided")
                         if o is not None else "undecided" for o in decision.offsets.values())
        how = (f"MTP norm gains mix conventions ({', '.join(f'{n} {k}' for k, n in counts.items())}); "
               f"the trunk's are {trunk_is}")
    layout.findings.append(finding(
        "mtp.norm_encoding", f"{how} [head vs trunk mean gain: {decision.describe()}]",
        layout.source_names.get("mtp.norm.weight", "mtp.norm"),
        **({} if decision.shifts(decision.trunk_level) is not None else {
            "fixable": False, "hint": "some gains' convention cannot be told from the trunk's; "
            "re-convert the MTP head from the original checkpoint"})))


def _check_policy(layout: MTPLayout, cfg: ModelConfig) -> None:
    declared = cfg.mtp_quantization
    if declared is None or "policy" not in declared:
        return
    policy = declared["policy"]
    if not isinstance(policy, str | type(None)) or policy not in SIDECAR_POLICIES:
        layout.findings.append(finding(
            "mtp.unknown_policy", f"sidecar policy {policy!r} is not one MTP runtimes know "
            f"({', '.join(repr(p) for p in SIDECAR_POLICIES)})",
            "config.json:mtplx_mtp_quantization.policy"))
