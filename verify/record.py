"""The verification record: weights fingerprint, package versions, machine; and `--stamp`,
which writes it into a bundle's mtpkit.json and model card (atomically)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from mtpkit.convert.writer import replace_files
from mtpkit.loaders.bundle import BundleView
from mtpkit.loaders.config import read_json
from mtpkit.loaders.digest import sha256_file
from mtpkit.loaders.findings import UserError
from mtpkit.loaders.manifest import MANIFEST_FILE
from mtpkit.schemas import finding_codes

PACKAGES = ("mtpkit", "mlx", "mlx-lm", "safetensors", "numpy")
CARD_MARK = "## Verification (mtpkit verify-run)"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    cpu = "unknown"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(
        os, "sysconf") else None
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_bytes": memory, "python": platform.python_version(),
            "versions": {p: _version(p) for p in PACKAGES}}


def fingerprint(view: BundleView) -> dict[str, Any]:
    """sha256 of every weight file (trunk shards and the sidecar), and one over all of them."""
    names = sorted({*view.weights.trunk_files, *([view.weights.sidecar_file]
                                                 if view.weights.sidecar_file else [])})
    files = {n: sha256_file(view.root / n) for n in names}
    overall = hashlib.sha256("".join(f"{n}:{h}\n" for n, h in files.items()).encode())
    return {"sha256": overall.hexdigest(), "files": files}


def require_manifest(root: Path) -> Path:
    """The bundle's manifest path; a bundle mtpkit did not write has no record to extend."""
    path = root / MANIFEST_FILE
    if not path.exists():
        raise UserError("manifest.missing", f"{root} has no {MANIFEST_FILE} to stamp",
                        "mtpkit convert writes a bundle with one; or run without --stamp")
    return path


def stamp(root: Path, report: dict[str, Any]) -> None:
    """Record the verdict in README.md's own section and in mtpkit.json ("verification"), and
    keep the manifest's entry for the card true (bytes, sha256). Needs a manifest: a bundle
    mtpkit did not write has no record to extend."""
    manifest_path = require_manifest(root)
    hint = finding_codes()["manifest.invalid"]["hint"]
    try:  # the bundle's file: bounded like every bundle JSON (a deep one was a RecursionError)
        manifest = read_json(manifest_path)
    except (ValueError, OSError) as exc:
        raise UserError("manifest.invalid", f"{MANIFEST_FILE} is unreadable: {exc}", hint) from None
    if not isinstance(manifest, dict):
        raise UserError("manifest.invalid", f"{MANIFEST_FILE} is not a JSON object", hint)
    card_path = root / "README.md"
    card = card_path.read_text(encoding="utf-8") if card_path.exists() else ""
    card = card.split(CARD_MARK)[0].rstrip() + "\n\n" if card.strip() else ""
    lines = [CARD_MARK, "", f"Verdict: **{'pass' if report['passed'] else 'FAIL'}** "
             f"(weights sha256 `{report['record'].get('fingerprint', {}).get('sha256', '?')}`).",
             "", "| check | result | evidence |", "|---|---|---|"]
    lines += [f"| {c['name']} | {c['status']} | {c['summary']} |" for c in report["checks"]]
    card = card + "\n".join(lines) + "\n"
    data = card.encode("utf-8")
    for entry in manifest.get("files", []):
        if entry.get("path") == "README.md":
            entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    manifest["verification"] = {k: report[k] for k in ("passed", "checks", "speed", "record")}
    # The manifest goes last: it records the card's bytes, so it commits both.
    replace_files({card_path: card, manifest_path: json.dumps(manifest, indent=2) + "\n"})
