"""Build the mtpkit.json manifest from a BundleView: every claim measured from the files."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from mtpkit import __version__
from mtpkit.convert.quant_record import manifest_section, measured_policy
from mtpkit.loaders.bundle import BundleView
from mtpkit.loaders.digest import sha256_file
from mtpkit.loaders.manifest import MANIFEST_FILE
from mtpkit.loaders.weights import INDEX_FILE

# Drafting deeper than the head's layer count chains the head on its own output; the reference
# decoder is tested to depth 4, so that is the depth a manifest promises.
MAX_CHAINED_DEPTH = 4
ROLE_BY_NAME = {
    "config.json": "config", INDEX_FILE: "index", "README.md": "card",
    "chat_template.jinja": "template", "tokenizer.json": "tokenizer",
    "tokenizer_config.json": "tokenizer", "tokenizer.model": "tokenizer",
    "special_tokens_map.json": "tokenizer", "vocab.json": "tokenizer", "merges.txt": "tokenizer",
    "added_tokens.json": "tokenizer",
}


def _role(rel: str, view: BundleView) -> str:
    if rel in view.weights.trunk_files:
        return "trunk"
    if rel == view.weights.sidecar_file:
        return "sidecar"
    if view.drafter.path and rel.startswith(view.drafter.path + "/"):
        return "drafter"
    if rel.startswith("additional_chat_templates/"):
        return "template"
    return ROLE_BY_NAME.get(rel, "other")


def build_manifest(view: BundleView, source: dict[str, Any],
                   template_provenance: str | None = None,
                   known_sha256: dict[str, str] | None = None) -> dict[str, Any]:
    """known_sha256: digests the writer computed while writing (weights are not read again)."""
    root = view.root
    known = known_sha256 or {}
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST_FILE:
            continue
        files.append({"path": rel, "role": _role(rel, view), "bytes": path.stat().st_size,
                      "sha256": known.get(rel) or sha256_file(path)})
    mtp = view.mtp
    return {
        "format_version": 1,
        "tool": {"name": "mtpkit", "version": __version__},
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "source": source,
        "family": view.family.name,
        "model_type": view.config.model_type,
        "files": files,
        "quantization": {"trunk": manifest_section(view.quantization),
                         "sidecar": manifest_section(view.mtp_quantization)},
        "mtp": {
            "present": bool(mtp.tensors), "file": view.weights.sidecar_file,
            "layers": max(mtp.declared_layers, mtp.blocks),
            "max_depth": MAX_CHAINED_DEPTH if mtp.tensors else 0,
            "hidden_feed": view.family.hidden_feed, "next_hidden": view.family.next_hidden,
            "concat_order": view.family.concat_order, "norm_encoding": mtp.norm_encoding,
            "policy": measured_policy(view.mtp_quantization, bool(mtp.tensors)),
            "source_family": view.family.name,
        },
        "chat_template": {"source": view.template.source, "provenance": template_provenance},
        **({"drafter": drafter} if (drafter := view.drafter.manifest_section()) else {}),
    }
