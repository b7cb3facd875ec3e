"""Paths inside an untrusted bundle: nothing the bundle names or links may lead outside it."""

from __future__ import annotations

from pathlib import Path

from mtpkit.loaders.findings import Finding, finding


def trusted_base(root: Path) -> Path:
    """Where a bundle's links may point: the folder itself, or for a Hugging Face cache
    snapshot (`models--org--name/snapshots/<rev>`) the cached repo, whose blobs/ it links to."""
    resolved = root.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent
    return resolved


def inside(root: Path, relative: str) -> Path | None:
    """`root/relative` if it names a place inside root (no absolute paths, no `..`) and, links
    resolved, still lands inside the bundle's trusted base; else None."""
    parts = relative.split("/")
    if not relative or relative.startswith("/") or "\\" in relative or "\x00" in relative or (
            ".." in parts):
        return None
    candidate = (root / relative).resolve()
    try:
        candidate.relative_to(trusted_base(root))
    except ValueError:
        return None
    return root / relative


def bundle_file(root: Path, name: str, findings: list[Finding]) -> Path | None:
    """The bundle's own file `name` if present and safe to read; a link leading outside the
    bundle is reported (index.path_escape) and not followed."""
    path = root / name
    if not path.is_file():
        return None
    if inside(root, name) is None:
        findings.append(finding("index.path_escape", f"{name} links outside the bundle; not read",
                                name))
        return None
    return path
