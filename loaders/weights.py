"""Find a bundle's weight files the way real readers do, and read every header.

Trunk: mlx-lm loads every `model*.safetensors` by glob; transformers and MTP runtimes follow
`model.safetensors.index.json`. Both views are checked against each other. Sidecar: MTPLX's
lookup order (config `mlx_lm_extra_tensors.mtp_file`, then the usual file names). Where none
of those is present, every other safetensors file a loader may open (the audit's set) is a
candidate stray sidecar: a head saved under a name no runtime looks for (loaders/mtp.py decides
whether its tensors are a head). No path from the bundle's own files is trusted to stay inside
the bundle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from mtpkit.loaders.config import ModelConfig, read_json
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.paths import bundle_file, loaded_names, plain, vet
from mtpkit.loaders.safetensors_header import SafetensorsHeader, TensorInfo, read_header

INDEX_FILE = "model.safetensors.index.json"
TRUNK_GLOB = "model*.safetensors"  # mlx-lm's load_model: glob.glob(model_path / TRUNK_GLOB)
SIDECAR_FILE = "mtp.safetensors"  # what mtpkit writes; the first name MTP runtimes look for
SIDECAR_NAMES = (SIDECAR_FILE, "mtp/weights.safetensors", "model-mtp.safetensors")


@dataclass
class Weights:
    trunk_files: list[str] = field(default_factory=list)
    sidecar_file: str | None = None
    headers: dict[str, SafetensorsHeader] = field(default_factory=dict)
    trunk: dict[str, TensorInfo] = field(default_factory=dict)
    sidecar: dict[str, TensorInfo] = field(default_factory=dict)
    index: dict[str, str] | None = None
    findings: list[Finding] = field(default_factory=list)
    # Without a known sidecar: the headers of the other safetensors files a loader may open,
    # which may hold a head under a name runtimes do not look for (see adopt()).
    strays: dict[str, SafetensorsHeader] = field(default_factory=dict)

    def adopt(self, name: str) -> None:
        """Read stray `name` as the sidecar: the head is diagnosed (and repaired) from it,
        instead of being reported missing while it sits in the folder."""
        header = self.strays.pop(name)
        self.sidecar_file = name
        self.headers[name] = header
        self.findings.extend(header.findings)
        self.sidecar.update(header.tensors)


def _read_index(root: Path, out: Weights) -> None:
    path = bundle_file(root, INDEX_FILE, out.findings)
    if path is None:
        return
    try:
        data = read_json(path)
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        out.findings.append(finding("index.invalid", f"unreadable: {exc}", INDEX_FILE))
        return
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
    ):
        out.findings.append(finding("index.invalid", "weight_map must map tensor names to file "
                                    "names", INDEX_FILE))
        return
    out.index = wmap


def _shard_names(root: Path, out: Weights) -> list[str]:
    """Shards named by the index (validated) plus every file mlx-lm's glob picks up."""
    names: list[str] = []
    refused: set[str] = set()
    for shard in sorted(set((out.index or {}).values())):
        if not plain(shard):
            out.findings.append(finding("index.path_escape",
                                        f"shard path {shard!r} leaves the bundle", INDEX_FILE))
            continue
        target, problem = vet(root, shard)
        if problem is not None:
            out.findings.append(problem)
            refused.add(shard)
        elif target is None:
            out.findings.append(finding("index.missing_shard", f"shard {shard!r} is not present",
                                        INDEX_FILE))
        else:
            names.append(shard)
    # Every entry the glob matches, whatever its type: mlx-lm opens them all (a FIFO blocks it).
    try:
        globbed = sorted(n for n in os.listdir(root) if fnmatchcase(n, TRUNK_GLOB))
    except OSError:
        globbed = []
    for name in globbed:
        if name in names or name in refused:
            continue
        target, problem = vet(root, name)
        if problem is not None:
            out.findings.append(problem)
            continue
        if target is None:
            continue
        if out.index is not None and name not in SIDECAR_NAMES:
            out.findings.append(finding(
                "index.tensor_mismatch",
                f"{name} is not in the index, yet mlx-lm loads every model*.safetensors",
                name, severity="warning"))
        names.append(name)
    return names


def _sidecar_name(root: Path, config: ModelConfig, out: Weights) -> str | None:
    extra = config.raw.get("mlx_lm_extra_tensors")
    declared = extra.get("mtp_file") if isinstance(extra, dict) else None
    if isinstance(declared, str):
        if not plain(declared):
            out.findings.append(finding("index.path_escape",
                                        f"mlx_lm_extra_tensors.mtp_file {declared!r} leaves the "
                                        "bundle", "config.json"))
            return None
        target, problem = vet(root, declared)
        if problem is not None:
            out.findings.append(problem)
            return None
        if target is not None:
            return declared
        out.findings.append(finding("mtp.missing", f"config names sidecar {declared!r} but it "
                                    "is not present", "config.json"))
    for name in SIDECAR_NAMES:
        # The first name present is the one MTP runtimes open, so a bad one ends the lookup.
        target, problem = vet(root, name)
        if problem is not None:
            out.findings.append(problem)
            return None
        if target is not None:
            return name
    return None


def _read_strays(root: Path, out: Weights) -> None:
    """Headers of the safetensors files no reader picks up (not a trunk shard, not a known
    sidecar name), among those the audit vets; a file it refuses is never opened here."""
    known = {*out.trunk_files, *(out.index or {}).values(), *SIDECAR_NAMES}
    for name in loaded_names(root):
        if not name.endswith(".safetensors") or name in known or fnmatchcase(name, TRUNK_GLOB):
            continue
        target, problem = vet(root, name)
        if target is not None and problem is None:
            header = read_header(target, label=name)
            if header.readable and header.tensors:
                out.strays[name] = header


def _check_index(out: Weights) -> None:
    if out.index is None:
        return
    listed = set(out.index)
    for name, shard in sorted(out.index.items()):
        header = out.headers.get(shard)
        if header is not None and header.readable and name not in header.tensors:
            out.findings.append(finding("index.tensor_mismatch",
                                        f"index puts it in {shard} but that shard lacks it", name))
    for shard in set(out.index.values()):
        header = out.headers.get(shard)
        for name in sorted(set(header.tensors) - listed) if header else ():
            out.findings.append(finding("index.tensor_mismatch",
                                        f"in {shard} but not in the index", name))


def read_weights(root: Path, config: ModelConfig) -> Weights:
    out = Weights()
    _read_index(root, out)
    out.sidecar_file = _sidecar_name(root, config, out)
    out.trunk_files = [n for n in _shard_names(root, out) if n != out.sidecar_file]
    for name in [*out.trunk_files, *([out.sidecar_file] if out.sidecar_file else [])]:
        header = read_header(root / name, label=name)
        out.headers[name] = header
        out.findings.extend(header.findings)
        target = out.sidecar if name == out.sidecar_file else out.trunk
        for tname, info in header.tensors.items():
            if tname in target:
                out.findings.append(finding("index.tensor_mismatch",
                                            f"stored twice: in {target[tname].file} and {name}",
                                            tname))
            target[tname] = info
    if not out.trunk_files and not any(f.code.startswith(("index.", "files."))
                                       for f in out.findings):
        out.findings.append(finding("files.missing_weights", "no model*.safetensors files",
                                    str(root.name)))
    _check_index(out)
    if out.sidecar_file is None:
        _read_strays(root, out)
    return out
