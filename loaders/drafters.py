"""What every drafter shipped in a folder of its own is read by: its config, its weights' headers,
its tokenizer against the target's, and (decoder side) its float weights. Gemma 4's assistant
(loaders/assistant.py) and DFlash (loaders/dflash.py) differ only in what they check on top."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.loaders.config import read_json
from mtpkit.loaders.findings import Finding, UserError, finding
from mtpkit.loaders.paths import bundle_file, inside
from mtpkit.loaders.safetensors_header import read_header


def drafter_folder(root: Path, manifest: dict[str, Any] | None, kinds: tuple[str | None, ...],
                   default: str, what: str) -> tuple[str | None, list[Finding]]:
    """A drafter's folder: the manifest's `drafter.path` where its `kind` is one of `kinds`
    (None: a manifest that names no kind), else `default` when it holds a config.json; a named
    folder that is not there is drafter.invalid."""
    section = (manifest or {}).get("drafter") or {}
    named = section.get("path") if section.get("kind") in kinds else None
    if isinstance(named, str):
        where = inside(root, named)
        if where is None or not (where / "config.json").is_file():
            return None, [finding("drafter.invalid", f"mtpkit.json names the {what} folder "
                                  f"{named!r}, which holds no config.json", named)]
        return named, []
    return (default, []) if (root / default / "config.json").is_file() else (None, [])


def _config(root: Path, rel: str, findings: list[Finding]) -> dict[str, Any] | None:
    """The drafter's config.json as a dict, or None with a finding (drafter.invalid where it
    cannot be read as a JSON object; bundle_file's own where it escapes or is missing)."""
    config = bundle_file(root, f"{rel}/config.json", findings)
    if config is None:
        return None
    try:
        raw = read_json(config)
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        findings.append(finding("drafter.invalid", f"unreadable: {exc}", f"{rel}/config.json"))
        return None
    if not isinstance(raw, dict):
        findings.append(finding("drafter.invalid", "not a JSON object", f"{rel}/config.json"))
        return None
    return raw


def _headers(root: Path, rel: str, what: str, findings: list[Finding]
                   ) -> tuple[list[str], dict[str, Any]]:
    """The folder's .safetensors files (bundle-relative) and their tensors, read from the
    bounded headers only; weights.missing where there is none (`what` names the drafter)."""
    files = sorted(f"{rel}/{p.name}" for p in (root / rel).glob("*.safetensors"))
    if not files:
        findings.append(finding("weights.missing", f"the {what} folder holds no .safetensors "
                                "file", rel))
    tensors: dict[str, Any] = {}
    for name in files:
        path = bundle_file(root, name, findings)
        if path is not None:
            header = read_header(path, name)
            findings += header.findings
            tensors |= header.tensors
    return files, tensors


def read_folder(report: Any, root: Path, rel: str, target: dict[str, Any], target_root: Path,
                what: str, read_spec: Callable[..., tuple[Any, list[Finding]]],
                check_tensors: Callable[..., list[Finding]],
                check_pair: Callable[..., list[Finding]]) -> None:
    """Fill a drafter's report (findings, spec, files, tensors) from its folder `rel`: the
    config read by the kind's `read_spec`, the headers checked by its `check_tensors`, the pair
    by its `check_pair`, the tokenizer against the target's."""
    raw = _config(root, rel, report.findings)
    if raw is None:
        return
    spec, bad = read_spec(raw, f"{rel}/config.json")
    report.findings += bad
    if spec is None:
        return
    report.spec = spec
    report.files, report.tensors = _headers(root, rel, what, report.findings)
    if report.tensors:
        report.findings += check_tensors(spec, report.tensors, f"{rel}:")
    report.findings += check_pair(spec, target, f"{rel}/config.json")
    report.findings += tokenizer_pair(root, rel, target_root, what)


def bundle_drafter(root: Path, read: Callable[..., Any]) -> tuple[Any, dict[str, Any]]:
    """(the report `read(root, target, manifest)` gives on a bundle, the target's config),
    refused with its first error's code (UserError) where doctor would find one."""
    manifest = read_json(root / "mtpkit.json") if (root / "mtpkit.json").is_file() else None
    target = read_json(root / "config.json")
    report = read(root, target, manifest if isinstance(manifest, dict) else None)
    bad = next((f for f in report.findings if f.severity == "error"), None)
    if bad is not None:
        raise UserError(bad.code, f"{root}: {bad.message}", bad.hint)
    return report, target


def _vocab_of(path: Path) -> dict[str, int] | None:
    try:
        data = read_json(path, 64 << 20)
        model = data.get("model", {}) if isinstance(data, dict) else {}
        vocab = dict(model.get("vocab") or {}) if isinstance(model.get("vocab"), dict) else {}
        for tok in data.get("added_tokens") or []:
            vocab[str(tok.get("content"))] = int(tok.get("id"))
        return vocab
    except (ValueError, OSError, UnicodeDecodeError, TypeError, AttributeError,
            json.JSONDecodeError):
        return None


def tokenizer_pair(root: Path, rel: str, target_root: Path, what: str) -> list[Finding]:
    """A drafter that ships its own tokenizer.json must map tokens to the same ids as the
    target's: its drafts are token ids the target verifies."""
    if not (root / rel / "tokenizer.json").is_file() or not (
            target_root / "tokenizer.json").is_file():
        return []
    ignored: list[Finding] = []
    a = _vocab_of(p) if (p := bundle_file(root, f"{rel}/tokenizer.json", ignored)) else None
    b = _vocab_of(p) if (p := bundle_file(target_root, "tokenizer.json", ignored)) else None
    if a is None or b is None or a == b:
        return ignored
    differ = sorted(set(a.items()) ^ set(b.items()))
    return [*ignored, finding("tokenizer.vocab_mismatch", f"the {what}'s tokenizer maps "
                              f"{len(differ)} token(s) differently from the target's, first "
                              f"{differ[0][0]!r}", f"{rel}/tokenizer.json")]


def float_weights(folder: Path, what: str) -> dict[str, mx.array]:
    """Every tensor of the folder's .safetensors files; a quantized drafter is refused with a
    hint (its decoder reads float weights)."""
    weights: dict[str, mx.array] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights |= mx.load(str(path))
    if any(n.endswith(".scales") for n in weights):
        raise UserError("options.invalid", f"{folder}: the {what} is quantized; its decoder "
                        "reads float weights", f"convert with the {what} as published")
    return weights
