"""`mtpkit doctor BUNDLE --fix --out DIR`: write a repaired copy of an MLX bundle.

Nothing is requantized and the source is never modified: tensors are moved, renamed, stacked
or re-encoded as the findings require, metadata is rewritten from the measured tensors, and a
missing or broken chat template is restored from the first source that has one.

Every file of the copy is either the source's, copied byte for byte, or written and named in
the notes (`applied`): a finding's repair under its code, and any other change under
`repair.changed` / `repair.added` / `repair.dropped`. No notes means the copy is the source,
byte for byte."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.convert.convert import ConvertError, check_source
from mtpkit.convert.experts import stack_experts
from mtpkit.convert.manifest import build_manifest
from mtpkit.convert.quant_record import config_entries, measured_policy, sidecar_record
from mtpkit.convert.writer import staged_output, write_safetensors, write_shards, write_text
from mtpkit.loaders.arrays import mtp_arrays
from mtpkit.loaders.bundle import BundleView, open_bundle
from mtpkit.loaders.config import MTP_COUNT_KEYS
from mtpkit.loaders.findings import Finding
from mtpkit.loaders.manifest import MANIFEST_FILE
from mtpkit.loaders.mtp import DELTA_ENCODINGS
from mtpkit.loaders.norms import ABSOLUTE, reencode
from mtpkit.loaders.paths import bundle_file
from mtpkit.loaders.template_sources import fallback_gaps, find_template
from mtpkit.loaders.weights import INDEX_FILE, SIDECAR_FILE

TEMPLATE_ERRORS = {"template.missing", "template.invalid", "template.unsafe", "template.empty",
                   "template.render_failed", "template.legacy_location", "template.fallback"}
CONFIG_FILE = "config.json"


@dataclass
class RepairResult:
    out: Path
    applied: list[dict[str, str]] = field(default_factory=list)
    template_provenance: str | None = None
    copied: set[str] = field(default_factory=set)  # staged files that are the source's bytes

    def note(self, code: str, action: str) -> None:
        self.applied.append({"code": code, "action": action})

    def copy(self, src: Path, stage: Path, rel: str) -> None:
        """Copy a source file into the copy unchanged (so it needs no note)."""
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, stage / rel)
        self.copied.add(rel)

    def mentions(self, rel: str) -> bool:
        return any(rel in a["action"] for a in self.applied)


def _codes(view: BundleView) -> set[str]:
    """What doctor reports for the source, the restored-fallback check included."""
    return {f.code for f in [*view.findings, *fallback_gaps(view)]
            if f.severity in ("error", "warning")}


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
        result.copy(view.root / name, stage, name)
        progress((view.root / name).stat().st_size)
    if (view.root / INDEX_FILE).is_file():
        result.copy(view.root / INDEX_FILE, stage, INDEX_FILE)


def _sidecar(view: BundleView, stage: Path, codes: set[str], result: RepairResult,
             progress: Callable[[int], None]) -> bool:
    """Write the canonical sidecar; return whether its norm gains are now absolute where the
    record must say so (re-encoded, or declared delta while already absolute). A head that only
    needs its file name changed (a stray sidecar, another runtime's name) is copied byte for
    byte, and either way the note says which file the head came from."""
    if not view.mtp.tensors:
        return False
    arrays = mtp_arrays(view)
    source = view.weights.sidecar_file
    in_sidecar = view.mtp.location == "sidecar"
    renamed = in_sidecar and any(c != s for c, s in view.mtp.source_names.items())
    changed = not in_sidecar or renamed
    reencoded = False
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
        changed = reencoded = True
    elif "mtp.norm_encoding" in codes and shifts is not None:
        result.note("mtp.norm_encoding", "declared the MTP norm gains absolute (norm_encoding in "
                    "mtplx_mtp_quantization): they already are, so a runtime must not add +1")
        reencoded = True
    if in_sidecar and source is not None and source != SIDECAR_FILE:
        how = "its bytes unchanged" if not changed else \
            "tensors renamed to mtp.*" if renamed else "with the changes above"
        result.note("mtp.stray_sidecar" if view.mtp.stray == source else "repair.changed",
                    f"took the MTP head from {source} and wrote it as {SIDECAR_FILE} ({how})")
    elif renamed:
        result.note("repair.changed", f"renamed the tensors in {SIDECAR_FILE} to canonical "
                    "mtp.* names")
    if changed:
        write_safetensors(stage / SIDECAR_FILE, arrays, sorted(arrays), progress=progress)
    elif source == SIDECAR_FILE:
        result.copy(view.root / SIDECAR_FILE, stage, SIDECAR_FILE)
    else:
        assert source is not None  # a head stored in a sidecar only
        shutil.copyfile(view.root / source, stage / SIDECAR_FILE)  # noted above
    return reencoded


def _config(view: BundleView, stage: Path, codes: set[str], result: RepairResult,
            reencoded: bool) -> None:
    """Change config.json only where a finding asks for it; otherwise copy it byte for byte.
    A change is noted with the keys it touched."""
    old_raw: dict[str, Any] = view.config.raw
    config: dict[str, Any] = json.loads(json.dumps(old_raw))
    if "quant.config_mismatch" in codes:
        entries = config_entries(view.quantization)
        for key in ("quantization", "quantization_config"):
            if entries is None:
                config.pop(key, None)
            else:
                config[key] = dict(entries)
        result.note("quant.config_mismatch", "rewrote config.json quantization from the tensors")
    if view.mtp.tensors:
        _mtp_config(view, config, codes, result, reencoded)
    if config == old_raw:
        result.copy(view.root / CONFIG_FILE, stage, CONFIG_FILE)
        return
    write_text(stage / CONFIG_FILE, json.dumps(config, indent=4, ensure_ascii=False) + "\n")
    result.note("repair.changed", f"{CONFIG_FILE}: {_describe(old_raw, config)}")


def _mtp_config(view: BundleView, config: dict[str, Any], codes: set[str],
                result: RepairResult, reencoded: bool) -> None:
    """The head's entries: the sidecar record where it is wrong or missing (or the norms were
    re-encoded), per-module mtp.* entries that would contradict it, the layer count, and a
    declared sidecar file name that is no longer the sidecar's."""
    old = view.config.mtp_quantization
    # A record is written where one is wrong, or where this repair made the sidecar (a head
    # moved out of the trunk); a correct one, or none where nothing needs one, is kept.
    rewrite = bool(codes & {"mtp.group_mismatch", "mtp.unknown_policy"}) or (
        old is None and view.mtp.location != "sidecar")
    record_now = config.get("mtplx_mtp_quantization")
    if not rewrite and reencoded and isinstance(record_now, dict) and str(
            record_now.get("norm_encoding", "")).lower() in DELTA_ENCODINGS:
        record_now["norm_encoding"] = "absolute"  # only the declaration was wrong
    if rewrite:
        declared = str((old or {}).get("norm_encoding", "absolute"))
        record = sidecar_record(view.mtp_quantization,
                                measured_policy(view.mtp_quantization, True),
                                "absolute" if reencoded else declared)
        config["mtplx_mtp_quantization"] = record
        for code in ("mtp.group_mismatch", "mtp.unknown_policy"):
            if code in codes:
                result.note(code, f"rewrote mtplx_mtp_quantization from the sidecar tensors "
                            f"(policy {(old or {}).get('policy')!r} -> {record['policy']!r})")
    # Per-module entries naming sidecar modules would contradict the record: drop them.
    for key in ("quantization", "quantization_config"):
        if isinstance(config.get(key), dict):
            config[key] = {k: v for k, v in config[key].items() if not k.startswith("mtp.")}
    if view.config.num_mtp_layers == 0:
        scope = config.get("text_config") if isinstance(config.get("text_config"), dict) \
            else config
        key = next((k for k in MTP_COUNT_KEYS if k in scope), "mtp_num_hidden_layers")
        scope[key] = max(view.mtp.declared_layers, view.mtp.blocks)
        if "config.invalid" in codes:
            result.note("config.invalid", "declared the MTP layer count")
    extra = config.get("mlx_lm_extra_tensors")
    if isinstance(extra, dict) and extra.get("mtp_file", SIDECAR_FILE) != SIDECAR_FILE:
        extra["mtp_file"] = SIDECAR_FILE


def _describe(old: Any, new: Any, prefix: str = "") -> str:
    """The keys that differ between two JSON objects: dropped, added, set (old -> new)."""
    parts: list[str] = []

    def short(value: Any) -> str:
        text = json.dumps(value)
        return text if len(text) <= 40 else text[:37] + "..."

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in [*a, *(k for k in b if k not in a)]:
                sub = f"{path}.{k}" if path else str(k)
                if k not in b:
                    parts.append(f"dropped {sub}")
                elif k not in a:
                    parts.append(f"added {sub} = {short(b[k])}")
                else:
                    walk(a[k], b[k], sub)
        elif a != b:
            parts.append(f"set {path} {short(a)} -> {short(b)}")

    walk(old, new, prefix)
    return "; ".join(parts[:8]) + (f" (+{len(parts) - 8} more)" if len(parts) > 8 else "")


def _other_files(view: BundleView, stage: Path, result: RepairResult) -> None:
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
            result.copy(src, stage, rel)


def _template(view: BundleView, stage: Path, codes: set[str], template_from: Path | None,
              result: RepairResult) -> None:
    broken = codes & TEMPLATE_ERRORS
    if not broken and template_from is None:
        return
    if broken == {"template.legacy_location"} and template_from is None:
        write_text(stage / "chat_template.jinja", view.template.text or "")
        result.copied.discard("chat_template.jinja")
        result.template_provenance = "legacy chat_template.json"
        result.note("template.legacy_location", "wrote chat_template.jinja from chat_template.json")
        return
    found = find_template(view, template_from)
    if found is None:
        return  # reported by the check of the copy
    write_text(stage / "chat_template.jinja", found.text)
    result.copied.discard("chat_template.jinja")  # the source's, if any, is replaced
    result.template_provenance = found.provenance
    for code in sorted(broken) or ["template.missing"]:
        result.note(code, f"restored chat_template.jinja from {found.provenance}")


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
        reencoded = _sidecar(view, stage, codes, result, progress)
        _other_files(view, stage, result)
        _template(view, stage, codes, template_from, result)
        _config(view, stage, codes, result, reencoded)
        _account(view, stage, result)
        _manifest(view, stage, codes, result)
    return result


def _account(view: BundleView, stage: Path, result: RepairResult) -> None:
    """Name every difference no note names yet: a staged file that is not the source's bytes,
    a source file the copy leaves out. By construction, so nothing is hashed twice."""
    staged = {p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file()}
    written = sorted(r for r in staged - result.copied
                     if r != MANIFEST_FILE and not result.mentions(r))
    if written:
        result.note("repair.changed", "wrote " + ", ".join(written))
    moved = {view.weights.sidecar_file} if SIDECAR_FILE in staged else set()
    moved.add(MANIFEST_FILE)  # written next, by _manifest
    left = sorted(r for p in view.root.rglob("*") if p.is_file()
                  and (r := p.relative_to(view.root).as_posix()) not in staged
                  and r not in moved and not result.mentions(r))
    if left:
        result.note("repair.dropped", "left out " + ", ".join(left)
                    + " (not part of an MLX bundle, or not a file a loader may open)")


def _manifest(view: BundleView, stage: Path, codes: set[str], result: RepairResult) -> None:
    """A source manifest that is valid and describes byte-identical files is kept as is;
    otherwise the copy gets a manifest of its own files, and the note says why."""
    manifest_codes = sorted(codes & {"manifest.invalid", "manifest.stale"})
    if view.manifest.data is not None and not manifest_codes and not result.applied:
        result.copy(view.root / MANIFEST_FILE, stage, MANIFEST_FILE)
        return
    manifest = build_manifest(open_bundle(stage), source={"kind": "mlx", "path": str(view.root)},
                              template_provenance=result.template_provenance)
    write_text(stage / MANIFEST_FILE, json.dumps(manifest, indent=2))
    for code in manifest_codes:
        result.note(code, "regenerated mtpkit.json from the repaired files")
    if manifest_codes:
        return
    if view.manifest.data is None and not (view.root / MANIFEST_FILE).exists():
        result.note("repair.added", f"wrote {MANIFEST_FILE} (the source had no manifest)")
    else:
        result.note("repair.changed", f"regenerated {MANIFEST_FILE} to describe the changed files")
