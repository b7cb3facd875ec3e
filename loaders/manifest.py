"""mtpkit.json, when a bundle has one: schema-valid, and do its file claims still hold?"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema

from mtpkit.loaders.config import read_json
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.paths import bundle_file, inside
from mtpkit.schemas import validate

MANIFEST_FILE = "mtpkit.json"


@dataclass
class ManifestReport:
    data: dict[str, Any] | None = None
    findings: list[Finding] = field(default_factory=list)

    def files(self) -> list[dict[str, Any]]:
        return list((self.data or {}).get("files", []))


def check_manifest(root: Path) -> ManifestReport:
    report = ManifestReport()
    path = bundle_file(root, MANIFEST_FILE, report.findings)
    if path is None:
        return report
    try:
        data = read_json(path)
        validate(data, "manifest")
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        report.findings.append(finding("manifest.invalid", f"unreadable: {exc}", MANIFEST_FILE))
        return report
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        report.findings.append(finding("manifest.invalid", f"{where}: {exc.message[:200]}",
                                       MANIFEST_FILE))
        return report
    report.data = data
    for entry in data["files"]:
        target = inside(root, entry["path"])
        if target is None:
            report.findings.append(finding("index.path_escape", f"manifest names "
                                           f"{entry['path']!r} outside the bundle", MANIFEST_FILE))
        elif not target.is_file():
            report.findings.append(finding("manifest.stale", "listed in mtpkit.json but missing",
                                           entry["path"]))
        elif target.stat().st_size != entry["bytes"]:
            report.findings.append(finding("manifest.stale", f"{target.stat().st_size} bytes, the "
                                           f"manifest says {entry['bytes']}", entry["path"]))
    return report
