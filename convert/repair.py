"""`mtpkit doctor BUNDLE --fix --out DIR`: write a repaired copy of an MLX bundle.

Nothing is requantized and the source is never modified: tensors are moved, renamed, stacked
or re-encoded as the findings require, metadata is rewritten from the measured tensors, and a
missing or broken chat template is restored from the first source that has one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.convert.convert import ConvertError, check_source, write_config
from mtpkit.convert.experts import stack_experts
from mtpkit.convert.manifest import build_manifest
from mtpkit.convert.quant_record import config_entries, measured_policy, sidecar_record
from mtpkit.convert.writer import staged_output, write_safetensors, write_shards, write_text
from mtpkit.loaders.arrays import mtp_arrays
from mtpkit.loaders.bundle import BundleView, open_bundle
from mtpkit.loaders.findings import Finding
from mtpkit.loaders.manifest import MANIFEST_FILE
from mtpkit.loaders.norms import ABSOLUTE, reencode
from mtpkit.loaders.paths import bundle_file
from mtpkit.loaders.template_sources import find_template
from mtpkit.loaders.weights import INDEX_FILE, SIDECAR_FILE

TEMPLATE_ERRORS = {"template.missing", "template.invalid", "template.unsafe",
                   "template.render_failed", "template.legacy_location"}


@dataclass
class RepairResult:
    out: Path
    applied: list[dict[str, str]] = field(default_factory=list)
    template_provenance: str | None = None

    def note(self, code: str, action: str) -> None:
        self.applied.append({"code": code, "action": action})


def _codes(view: BundleView) -> set[str]:
    return {f.code for f in view.findings if f.severity in ("error", "warning")}


def _lazy(view: BundleView, files: list[str]) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for name in files:
        out.update(mx.load(str(view.root / name)))
    return out


def _trunk(view: BundleView, stage: Path, codes: set[str], result: RepairResult,
           progress: Callable[[int], None]) -> None:
    moved = set(view.mtp.source_names.values()) & set(view.weights.trunk)
    if moved or codes & {"index.invalid", "index.tensor_mismatch"}:
        tensors = {k: v for k, v in _lazy(view, view.weights.trunk_files).items()
                   if k not in moved}
        write_shards(stage, tensors, progress=progress)
        if moved:
            result.note("mtp.in_trunk", f"moved {len(moved)} MTP tensors out of the trunk shards")
        for code in sorted(codes & {"index.invalid", "index.tensor_mismatch"}):
            result.note(code, "rebuilt the shards' index from their headers")
        return
    for name in view.weights.trunk_files:
        shutil.copyfile(view.root / name, stage / name)
        progress((view.root / name).stat().st_size)
    if (view.root / INDEX_FILE).is_file():
        shutil.copyfile(view.root / INDEX_FILE, stage / INDEX_FILE)


def _sidecar(view: BundleView, stage: Path, codes: set[str], result: RepairResult,
             progress: Callable[[int], None]) -> bool:
    """Write the canonical sidecar; return whether anything in it changed."""
    if not view.mtp.tensors:
        return False
    arrays = mtp_arrays(view)
    changed = (view.weights.sidecar_file != SIDECAR_FILE or view.mtp.location != "sidecar"
               or any(c != s for c, s in view.mtp.source_names.items()))
    if "mtp.experts_unstacked" in codes:
        arrays = stack_experts(arrays, view.config.dim("hidden_size") or 0)
        result.note("mtp.experts_unstacked", "stacked the MTP experts into switch_mlp tensors")
        changed = True
    shifts = view.mtp.norms.shifts(ABSOLUTE) if view.mtp.norms is not None else None
    if "mtp.norm_encoding" in codes and shifts:
        arrays = reencode(arrays, shifts)
        result.note("mtp.norm_encoding", f"re-encoded {len(shifts)} of {len(view.mtp.norms.offsets)} "
                    f"MTP norm gains to the trunk's encoding (absolute), decided from "
                    f"{view.mtp.norms.describe()}")
        changed = True
    if changed:
        write_safetensors(stage / SIDECAR_FILE, arrays, sorted(arrays), progress=progress)
    else:
        shutil.copyfile(view.root / SIDECAR_FILE, stage / SIDECAR_FILE)
    return changed


def _config(view: BundleView, stage: Path, codes: set[str], result: RepairResult) -> None:
    config: dict[str, Any] = json.loads(json.dumps(view.config.raw))
    if "quant.config_mismatch" in codes:
        entries = config_entries(view.quantization)
        for key in ("quantization", "quantization_config"):
            if entries is None:
                config.pop(key, None)
            else:
                config[key] = dict(entries)
        result.note("quant.config_mismatch", "rewrote config.json quantization from the tensors")
    record = None
    if view.mtp.tensors:
        old = view.config.mtp_quantization or {}
        record = sidecar_record(view.mtp_quantization,
                                measured_policy(view.mtp_quantization, True))
        for code in ("mtp.group_mismatch", "mtp.unknown_policy"):
            if code in codes:
                result.note(code, f"rewrote mtplx_mtp_quantization from the sidecar tensors "
                            f"(policy {old.get('policy')!r} -> {record['policy']!r})")
        # Per-module entries naming sidecar modules would contradict the record: drop them.
        for key in ("quantization", "quantization_config"):
            if isinstance(config.get(key), dict):
                config[key] = {k: v for k, v in config[key].items() if not k.startswith("mtp.")}
        if "config.invalid" in codes and view.config.num_mtp_layers == 0:
            result.note("config.invalid", "declared the MTP layer count")
    write_config(stage, config, record, max(view.mtp.declared_layers, view.mtp.blocks))


def _other_files(view: BundleView, stage: Path) -> None:
    """Everything that is neither weights nor rewritten metadata, as the source had it."""
    skip = {*view.weights.trunk_files, view.weights.sidecar_file, INDEX_FILE, "config.json",
            MANIFEST_FILE}
    ignored: list[Finding] = []
    for path in sorted(view.root.rglob("*")):
        rel = path.relative_to(view.root).as_posix()
        if rel in skip or path.is_dir() or path.suffix in (".gguf", ".bin", ".pt", ".pth"):
            continue
        src = bundle_file(view.root, rel, ignored)
        if src is not None and not (stage / rel).exists():
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, stage / rel)


def _template(view: BundleView, stage: Path, codes: set[str], template_from: Path | None,
              result: RepairResult) -> None:
    broken = codes & TEMPLATE_ERRORS
    if not broken and template_from is None:
        return
    if broken == {"template.legacy_location"} and template_from is None:
        write_text(stage / "chat_template.jinja", view.template.text or "")
        result.template_provenance = "legacy chat_template.json"
        result.note("template.legacy_location", "wrote chat_template.jinja from chat_template.json")
        return
    found = find_template(view, template_from)
    if found is None:
        return  # reported by the check of the copy
    write_text(stage / "chat_template.jinja", found.text)
    result.template_provenance = found.provenance
    for code in sorted(broken) or ["template.missing"]:
        result.note(code, f"restored the chat template from {found.provenance}")


def repair(src: str | Path, out: Path, template_from: Path | None = None, force: bool = False,
           progress: Callable[[int], None] = lambda n: None) -> RepairResult:
    view = open_bundle(src)
    if view.kind != "mlx":
        raise ConvertError("usage", f"{src} is a Hugging Face checkpoint, not an MLX bundle",
                           "use mtpkit convert to make a bundle from it")
    check_source(view)
    codes = _codes(view)
    result = RepairResult(out)
    with staged_output(out, view.root, force=force) as stage:
        _trunk(view, stage, codes, result, progress)
        _sidecar(view, stage, codes, result, progress)
        _other_files(view, stage)
        _template(view, stage, codes, template_from, result)
        _config(view, stage, codes, result)
        for code in sorted(codes & {"manifest.invalid", "manifest.stale"}):
            result.note(code, "regenerated mtpkit.json from the repaired files")
        manifest = build_manifest(open_bundle(stage), source={"kind": "mlx", "path": str(view.root)},
                                  template_provenance=result.template_provenance)
        write_text(stage / MANIFEST_FILE, json.dumps(manifest, indent=2))
    return result
