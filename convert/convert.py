"""`mtpkit convert`: any supported source -> a publishable bundle with its MTP sidecar.

Everything is written into a staging folder beside OUT, checked with doctor, and only then
renamed into place; the source is never modified."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mtpkit.convert.card import model_card
from mtpkit.convert.errors import ConvertError
from mtpkit.convert.manifest import build_manifest
from mtpkit.convert.sidecar import SidecarOptions, build_sidecar
from mtpkit.convert.trunk import QuantOptions, build_trunk
from mtpkit.convert.writer import (
    Tensor,
    claim_output,
    scratch,
    staged_output,
    write_safetensors,
    write_shards,
    write_text,
)
from mtpkit.loaders.assistant import DRAFTER_DIR, DrafterReport, read_assistant
from mtpkit.loaders.bundle import BundleView, open_bundle
from mtpkit.loaders.config import MTP_COUNT_KEYS
from mtpkit.loaders.dflash import DFLASH_DIR, DFlashReport, is_dflash, read_dflash_folder
from mtpkit.loaders.digest import sha256_file
from mtpkit.loaders.findings import Finding
from mtpkit.loaders.model_check import blocking, check_model
from mtpkit.loaders.paths import bundle_file
from mtpkit.loaders.source import NotABundle, resolve
from mtpkit.loaders.weights import SIDECAR_FILE

# Files carried over as the source had them (weights, configs and cards are written anew).
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json", "generation_config.json")
# Source problems convert cannot work around (the rest are repaired by converting).
BLOCKING = ("files.", "config.", "index.path_escape", "index.missing_shard", "safetensors.",
            "tokenizer.invalid", "quant.incomplete", "quant.unsupported", "weights.",
            "mtp.incomplete", "mtp.norm_encoding")
# Findings a fresh bundle may inherit from its source without the conversion being wrong.
INHERITED = ("template.", "tokenizer.", "mtp.absent", "mtp.unsupported")


@dataclass
class ConvertOptions:
    quant: QuantOptions = field(default_factory=QuantOptions)
    sidecar: SidecarOptions | None = None  # None: layers when the trunk is quantized, else keep
    force: bool = False
    command: str = "mtpkit convert"
    # a drafter that ships apart (Gemma 4's assistant: a folder or a cached repo id), copied
    # into the bundle's assistant/ as given; None keeps the source bundle's own drafter, if any
    drafter: str | None = None


@dataclass
class ConvertResult:
    out: Path
    manifest: dict[str, Any]
    findings: list[Finding]


def _source_record(view: BundleView, src: str) -> dict[str, Any]:
    """Where the bundle came from; the fingerprint hashes each weight file's name, size and
    header (cheap, and changes whenever a tensor's layout, dtype or placement changes)."""
    digest = hashlib.sha256()
    for name in sorted(view.weights.headers):
        path = view.root / name
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            digest.update(f"{name}\0{path.stat().st_size}\0".encode())
            digest.update(fh.read(min(n, 100_000_000)))
    record: dict[str, Any] = {"kind": view.kind, "path": str(view.root),
                              "fingerprint": digest.hexdigest()}
    snapshot = view.root.resolve()
    if snapshot.parent.name == "snapshots" and snapshot.parent.parent.name.startswith("models--"):
        record.update(kind="hf_cache", repo_id=snapshot.parent.parent.name[len("models--"):]
                      .replace("--", "/"), revision=snapshot.name)
    elif not Path(src).exists():
        record["repo_id"] = src
    return record


def _base_model(view: BundleView, source: dict[str, Any]) -> str | None:
    name = source.get("repo_id") or view.config.raw.get("_name_or_path")
    return name if isinstance(name, str) and name else None


def _carry_files(view: BundleView, stage: Path) -> None:
    skipped: list[Finding] = []
    for name in CARRIED_FILES:
        path = bundle_file(view.root, name, skipped)
        if path is not None:
            shutil.copyfile(path, stage / name)
    extra = view.root / "additional_chat_templates"
    for p in sorted(extra.glob("*.jinja")):
        path = bundle_file(view.root, f"additional_chat_templates/{p.name}", skipped)
        if path is not None:
            (stage / "additional_chat_templates").mkdir(exist_ok=True)
            shutil.copyfile(path, stage / "additional_chat_templates" / p.name)
    if view.template.text is not None and not (stage / "chat_template.jinja").exists():
        write_text(stage / "chat_template.jinja", view.template.text)


def write_config(stage: Path, config: dict[str, Any], mtp_record: dict[str, Any] | None,
                  num_mtp_layers: int) -> None:
    from mlx_lm.utils import save_config

    config = dict(config)
    config.pop("mtplx_mtp_quantization", None)
    config.pop("mlx_lm_extra_tensors", None)
    if mtp_record is not None:
        config["mtplx_mtp_quantization"] = mtp_record
        scope = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        if not any(k in scope for k in MTP_COUNT_KEYS):
            scope["mtp_num_hidden_layers"] = num_mtp_layers
    save_config(config, stage / "config.json")


def finish_bundle(stage: Path, name: str, source: dict[str, Any], base_model: str | None,
                  command: str, provenance: str | None, hashes: dict[str, str],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check the staged bundle with doctor, then write its model card and manifest (plus
    `extra` manifest sections). Raises ConvertError when the bundle fails its own check."""
    written = open_bundle(stage)
    bad = [f for f in [*written.errors, *check_model(written)]
           if f.severity == "error" and not f.code.startswith(INHERITED)]
    if bad:
        raise ConvertError(bad[0].code, "the written bundle fails its own check: "
                           f"{bad[0].message} [{bad[0].location}]",
                           "this is a bug in mtpkit; please report it with the source")
    manifest = {**build_manifest(written, source, provenance, known_sha256=hashes),
                **(extra or {})}
    write_text(stage / "README.md", model_card(name, base_model, manifest, command))
    manifest = {**build_manifest(open_bundle(stage), source, provenance, known_sha256=hashes),
                **(extra or {})}
    write_text(stage / "mtpkit.json", json.dumps(manifest, indent=2))
    return manifest


def check_source(view: BundleView) -> None:
    """Refuse sources convert cannot work around, naming the most fundamental problem first
    (a truncated shard before the quantized module it cut in half): what doctor reports,
    tensors against mlx-lm's model class included, and a tokenizer the bundle could not
    use (it would be published as it is)."""
    errors = blocking(view)
    for prefix in BLOCKING:
        for f in errors:
            if f.code.startswith(prefix) and not f.fixable:
                raise ConvertError(f.code, f"source: {f.message} [{f.location}]", f.hint)


Drafter = DrafterReport | DFlashReport


def check_drafter(view: BundleView, drafter: str | None) -> tuple[Path, Drafter] | None:
    """The drafter to carry into the bundle, checked against the source as its target: the one
    named (`--drafter`: Gemma 4's assistant, or a DFlash drafter where its config says so),
    else the source bundle's own; ConvertError with the first error's code for a drafter that
    is damaged or does not fit this target."""
    if drafter is None:
        if view.drafter.path is None:
            return None
        report, folder = view.drafter, view.root / view.drafter.path
    else:
        try:
            folder = resolve(drafter)
        except NotABundle as exc:
            raise ConvertError("drafter.invalid", f"--drafter {drafter}: {exc}",
                               exc.hint) from None
        read = read_dflash_folder if is_dflash(folder) else read_assistant
        report = read(folder, view.config.raw, view.root)
    errors = [f for f in report.findings if f.severity == "error"]
    if errors or report.spec is None:
        f = errors[0]
        raise ConvertError(f.code, f"drafter: {f.message} [{f.location}]", f.hint)
    return folder, report


def drafter_dir(report: Drafter) -> str:
    """Where a drafter of this kind lives in a bundle convert writes."""
    return DFLASH_DIR if isinstance(report, DFlashReport) else DRAFTER_DIR


def _copy_drafter(stage: Path, folder: Path, report: Drafter,
                  progress: Callable[[int], None]) -> dict[str, str]:
    """The drafter's config.json and safetensors copied into its folder of the stage byte for
    byte (its weights kept as published: the tensors are not requantized); returns their
    sha256."""
    rel = drafter_dir(report)
    target = stage / rel
    target.mkdir()
    hashes = {}
    for name in ["config.json", *(Path(f).name for f in report.files)]:
        shutil.copyfile(folder / name, target / name)
        hashes[f"{rel}/{name}"] = sha256_file(target / name)
        progress((target / name).stat().st_size)
    return hashes


def convert(src: str, out: Path, options: ConvertOptions,
            progress: Callable[[int], None] = lambda n: None,
            on_plan: Callable[[int], None] = lambda total: None,
            status: Callable[[str], None] = lambda text: None) -> ConvertResult:
    """Convert `src` into the bundle folder `out`; raises ConvertError for bad input.
    progress: bytes written; on_plan: the total to write, once known; status: what it is doing
    now, a few words per step (the work before the first byte is written takes seconds)."""
    if str(src).endswith(".gguf") and Path(src).is_file():
        return _convert_gguf(Path(src), out, options, progress, on_plan, status)
    pair = Path(src)
    if not (pair / "config.json").exists() and all(
            (pair / d / "config.json").is_file() for d in ("target", DRAFTER_DIR)):
        # a pair given as one folder, MTPLX's layout: target/ + assistant/
        status(f"{src} holds a target/ and an assistant/: converting the pair")
        options = replace(options, drafter=options.drafter or str(pair / DRAFTER_DIR))
        src = str(pair / "target")
    return _convert(src, out, options, progress, on_plan, status)


def _convert_gguf(src: Path, out: Path, options: ConvertOptions,
                  progress: Callable[[int], None], on_plan: Callable[[int], None],
                  status: Callable[[str], None]) -> ConvertResult:
    """Dequantize the GGUF into a temporary Hugging Face folder beside OUT, then convert that."""
    from mtpkit.convert.gguf_import import GGUFError, gguf_to_hf

    claim_output(out, src, options.force)
    with scratch(out) as tmp:
        status(f"reading {src.name} (GGUF) into a temporary checkpoint")
        try:
            hf = gguf_to_hf(src, tmp / "hf", dtype=options.quant.dtype or "bfloat16")
        except GGUFError as exc:
            raise ConvertError("gguf.unsupported", str(exc),
                               "convert the original Hugging Face checkpoint instead") from None
        source = {"kind": "gguf", "path": str(src.resolve()), "fingerprint": sha256_file(src)}
        return _convert(str(hf), out, options, progress, on_plan, status, source=source)


def _convert(src: str, out: Path, options: ConvertOptions, progress: Callable[[int], None],
             on_plan: Callable[[int], None], status: Callable[[str], None],
             source: dict[str, Any] | None = None) -> ConvertResult:
    status("reading the source's headers, config, tokenizer and chat template")
    view = open_bundle(src)
    status(f"checking {len(view.tensors)} tensors against mlx-lm's {view.config.model_type} "
           "model class")
    check_source(view)
    drafter = check_drafter(view, options.drafter)
    source = source or _source_record(view, src)
    quant = options.quant
    sidecar_opts = options.sidecar or SidecarOptions(policy="layers" if quant.quantize else "keep")
    with staged_output(out, view.root, force=options.force) as stage:
        status("building the trunk with mlx-lm's model class (lazily: nothing is read yet)")
        model, trunk, config = build_trunk(view, quant)
        mtp_record = None
        sidecar: dict[str, Tensor] = {}
        if view.mtp.tensors:
            status("planning the MTP sidecar")
            hidden = view.config.dim("hidden_size") or 0
            sidecar, mtp_record = build_sidecar(view, sidecar_opts, model, hidden)
        on_plan(sum(t.nbytes for t in trunk.values()) + sum(t.nbytes for t in sidecar.values())
                + (sum(t.nbytes for t in drafter[1].tensors.values()) if drafter else 0))
        # Drop the model's own references so each tensor is freed right after it is written.
        del model
        hashes = write_shards(stage, trunk, progress=progress)
        if sidecar:
            hashes[SIDECAR_FILE] = write_safetensors(stage / SIDECAR_FILE, sidecar,
                                                     sorted(sidecar), progress=progress)
        if drafter:
            status(f"copying the drafter into {drafter_dir(drafter[1])}/")
            hashes |= _copy_drafter(stage, *drafter, progress)
        write_config(stage, config, mtp_record, max(view.mtp.declared_layers, view.mtp.blocks))
        _carry_files(view, stage)
        status("checking the written bundle (doctor) and writing its manifest")
        provenance = view.template.source and f"source {view.template.source}"
        manifest = finish_bundle(stage, out.name, source, _base_model(view, source),
                                 options.command, provenance, hashes)
    final = open_bundle(out)
    return ConvertResult(out, manifest, final.findings)


__all__ = ["ConvertError", "ConvertOptions", "ConvertResult", "convert"]
