"""open_bundle: one header-only view of a model folder that every other part consumes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mtpkit.loaders.assistant import DrafterReport, read_drafter
from mtpkit.loaders.config import ModelConfig, read_config
from mtpkit.loaders.config_weights import check_config_weights
from mtpkit.loaders.dflash import DFlashReport, read_dflash
from mtpkit.loaders.families import Family, family_for
from mtpkit.loaders.findings import SEVERITY_ORDER, Finding
from mtpkit.loaders.manifest import ManifestReport, check_manifest
from mtpkit.loaders.mtp import MTPLayout, check, collect
from mtpkit.loaders.paths import audit
from mtpkit.loaders.quant import ModuleQuant, group_modules, summarize
from mtpkit.loaders.quant_check import check_sidecar, check_trunk
from mtpkit.loaders.source import NotABundle, looks_like_model, resolve
from mtpkit.loaders.templates import TemplateReport, check_template
from mtpkit.loaders.tokenizer import TokenizerReport, check_tokenizer
from mtpkit.loaders.weights import Weights, read_weights


@dataclass
class BundleView:
    """What a bundle holds and what is wrong with it, read without loading any weights."""

    root: Path
    source: str
    kind: str  # "mlx" (converted bundle) or "hf" (Hugging Face checkpoint)
    family: Family
    config: ModelConfig
    weights: Weights
    mtp: MTPLayout
    quantization: dict[str, ModuleQuant]
    mtp_quantization: dict[str, ModuleQuant]
    template: TemplateReport
    tokenizer: TokenizerReport
    manifest: ManifestReport
    findings: list[Finding] = field(default_factory=list)
    # a drafter that ships apart, if any: Gemma 4's assistant or a DFlash drafter
    drafter: DrafterReport | DFlashReport = field(default_factory=DrafterReport)

    @property
    def tensors(self) -> dict[str, Any]:
        return {**self.weights.trunk, **self.weights.sidecar}

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def summary(self) -> dict[str, Any]:
        return {
            "root": str(self.root), "source": self.source, "kind": self.kind,
            "model_type": self.config.model_type, "family": self.family.name,
            "files": {"trunk": self.weights.trunk_files, "sidecar": self.weights.sidecar_file},
            "tensors": {"trunk": len(self.weights.trunk), "sidecar": len(self.weights.sidecar)},
            "quantization": {"trunk": summarize(self.quantization),
                             "sidecar": summarize(self.mtp_quantization)},
            "mtp": self.mtp.to_dict(), "template": self.template.to_dict(),
            "tokenizer": self.tokenizer.to_dict(),
            "drafter": self.drafter.manifest_section(),
        }


def _kind(weights: Weights, config: ModelConfig) -> str:
    if config.quantization is not None or any(
            h.metadata.get("format") == "mlx" for h in weights.headers.values()):
        return "mlx"
    if any(".switch_mlp." in n for n in weights.trunk):
        return "mlx"
    return "hf"


KNOCK_ON = ("quant.incomplete",)  # what a tensor dropped from a damaged file leaves behind


def _fold(findings: list[Finding], weights: Weights) -> list[Finding]:
    """Fold knock-on findings into their root cause: a module left incomplete because its
    tensors sit in a damaged file is counted in that file's finding, not reported again (a cut
    shard otherwise names every module it held, and the first blocking finding is the wrong
    cause)."""
    owner = {name: file for file, h in weights.headers.items() for name in h.dropped}
    folded: dict[str, int] = {}
    kept = []
    for f in findings:
        file = next((owner[n] for n in owner if n.startswith(f.location + ".")), None) \
            if f.code in KNOCK_ON else None
        if file is None:
            kept.append(f)
        else:
            folded[file] = folded.get(file, 0) + 1
    if not folded:
        return kept
    out = []
    for f in kept:
        n = folded.pop(f.location.split(":")[0], 0) if f.severity == "error" else 0
        out.append(replace(f, message=f"{f.message}; {n} quantized module(s) left incomplete by "
                           "it") if n else f)
    return out


def open_bundle(path: str | Path) -> BundleView:
    """Read a bundle folder, an HF checkpoint folder or a cached repo id; raise NotABundle when
    the input is not a model folder at all. Never loads tensor data beyond 1-D norm vectors."""
    root = resolve(path)
    if not looks_like_model(root):
        raise NotABundle(f"{path}: no config.json and no .safetensors files",
                         "pass the folder that holds the model")
    files = audit(root)  # before any read: every file a loader may open, by stat alone
    config = read_config(root)
    family = family_for(config.model_type)
    weights = read_weights(root, config)
    kind = _kind(weights, config)
    mtp = collect(weights, family, config)
    check(mtp, weights, family, config, kind, root)
    trunk_only = {n: i for n, i in weights.trunk.items() if n not in mtp.source_names.values()}
    quantization, trunk_q = check_trunk(group_modules(trunk_only), config)
    mtp_quantization, sidecar_q = check_sidecar(group_modules(mtp.tensors), mtp.source_names,
                                                config)
    tokenizer = check_tokenizer(root, config, weights.trunk)
    template = check_template(root, tokenizer.config, tokenizer.special_tokens(),
                              tokenizer.chat_markers)
    manifest = check_manifest(root)
    drafter: DrafterReport | DFlashReport = read_drafter(root, config.raw, manifest.data)
    if drafter.path is None and not drafter.findings:
        drafter = read_dflash(root, config.raw, manifest.data)
    dims = check_config_weights(config, family, weights, mtp.source_names.values(),
                                quantization)
    # The audit and each reader vet the same files the same way: keep one of each finding.
    findings = _fold(list(dict.fromkeys([
        *files, *config.findings, *weights.findings, *dims, *mtp.findings, *trunk_q,
        *sidecar_q, *tokenizer.findings, *template.findings, *manifest.findings,
        *drafter.findings])), weights)
    findings.sort(key=lambda f: (SEVERITY_ORDER[f.severity], f.code, f.location))
    return BundleView(root, str(path), kind, family, config, weights, mtp, quantization,
                      mtp_quantization, template, tokenizer, manifest, findings, drafter)
