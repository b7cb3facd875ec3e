"""A DFlash drafter (block-diffusion speculative decoding) read beside its target, and the pair.

A DFlash checkpoint (z-lab's `DFlashDraftModel`, e.g. z-lab/Qwen3-8B-DFlash-b16) is a few Qwen3
decoder layers with no embedding and no LM head of their own: it drafts a whole block in one
pass from the target's hidden states at the layers `dflash_config.target_layer_ids` (their
outputs, concatenated, through `fc` and `hidden_norm`) and the target's embeddings of the last
committed token followed by `mask_token_id`s, and its outputs go through the target's LM head.
So it runs only beside the target it was trained on: the target's hidden size, vocabulary and
at least as many layers as its largest target layer id. Everything here reads configs and
headers only (names from z-lab/dflash `dflash/model.py` and `dflash/model_mlx.py`; docs/dflash.md
cites them).

Bundle layout: the drafter lives in a subfolder (`dflash/` by default, or the folder
`mtpkit.json`'s `drafter.path` names when its `kind` is "dflash") with its own `config.json`
and `*.safetensors`; the trunk stays at the root, so stock mlx-lm still loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpkit.loaders.config import read_json
from mtpkit.loaders.drafters import drafter_folder, read_folder
from mtpkit.loaders.findings import Finding, finding

KIND = "dflash"
DFLASH_DIR = "dflash"
ARCHITECTURE = "DFlashDraftModel"  # DFlash2 (a candidate selector, dynamic convolutions) is not
KINDS = ("full_attention", "sliding_attention")
QUANT_PARTS = (".scales", ".biases")


@dataclass(frozen=True)
class DFlashSpec:
    """What a DFlash config.json says, checked for the values its shapes depend on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: bool | None  # None: sliding layers causal inside the block, full layers not
    embedding_scale: float = 1.0  # dflash_config.input_embedding_scale
    output_multiplier: float = 1.0
    softcap: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    def qwen3_args(self) -> dict[str, Any]:
        """The keyword arguments of mlx-lm's qwen3 ModelArgs its layers are built from."""
        raw = self.raw
        rope = raw.get("rope_scaling") or raw.get("rope_parameters")
        theta = raw.get("rope_theta", (rope or {}).get("rope_theta", 10000.0))
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "default":
            rope = None
        return dict(model_type="qwen3", hidden_size=self.hidden, num_hidden_layers=self.layers,
                    intermediate_size=self.intermediate, num_attention_heads=self.heads,
                    rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), vocab_size=self.vocab,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
                    rope_theta=float(theta), rope_scaling=rope, tie_word_embeddings=False)


def _int(scope: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = scope.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _number(scope: dict[str, Any], key: str, default: float | None) -> float | None:
    value = scope.get(key, default)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def read_spec(raw: dict[str, Any], where: str) -> tuple[DFlashSpec | None, list[Finding]]:
    """The drafter's config as a spec, or drafter.invalid naming the first key that is wrong.
    Keys are read where z-lab's loader reads them: `dflash_config` first, then the top level."""
    def bad(message: str) -> tuple[None, list[Finding]]:
        return None, [finding("drafter.invalid", message, where)]

    arch = (raw.get("architectures") or [None])[0]
    if arch != ARCHITECTURE:
        return bad(f"architectures[0] is {arch!r}, not {ARCHITECTURE!r} (DFlash2 drafters, "
                   "with a candidate selector, are not supported)")
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict):
        return bad("no dflash_config object (target_layer_ids, mask_token_id)")
    ints = {k: _int(raw, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "intermediate_size",
                                      "vocab_size")}
    ints["mask_token_id"] = _int(dflash, "mask_token_id", _int(raw, "mask_token_id"))
    ints["block_size"] = _int(dflash, "block_size", _int(raw, "block_size", 16))
    missing = [k for k, v in ints.items() if not v and k != "mask_token_id" or v is None]
    if missing:
        return bad(f"{missing[0]} is missing or not a positive integer")
    ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    if not isinstance(ids, list) or not ids or any(_int({"i": i}, "i") is None for i in ids):
        return bad("dflash_config.target_layer_ids must list target layer indices (>= 0)")
    layers, vocab = ints["num_hidden_layers"] or 0, ints["vocab_size"] or 0
    types = raw.get("layer_types") or ["full_attention"] * layers
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(KINDS):
        return bad(f"layer_types must list {layers} of {KINDS}")
    window = _int(raw, "sliding_window")
    if "sliding_attention" in types and not window:
        return bad("sliding_attention layers need a positive sliding_window")
    if (ints["mask_token_id"] or 0) >= vocab:
        return bad(f"mask_token_id {ints['mask_token_id']} is outside the vocabulary ({vocab})")
    if (ints["block_size"] or 0) < 2:
        return bad("block_size must be 2 or more (the last token and at least one draft)")
    heads, kv = ints["num_attention_heads"] or 1, ints["num_key_value_heads"] or 1
    if heads % kv:
        return bad(f"{heads} attention heads cannot share {kv} key/value heads")
    scales = {k: _number(dflash, k, _number(raw, k, d)) for k, d in (
        ("input_embedding_scale", 1.0), ("output_multiplier", 1.0))}
    softcap = _number(dflash, "final_logit_softcapping",
                      _number(raw, "final_logit_softcapping", None))
    causal = raw.get("is_causal")
    spec = DFlashSpec(
        hidden=ints["hidden_size"] or 0, layers=layers, heads=heads, kv_heads=kv,
        head_dim=ints["head_dim"] or 0, intermediate=ints["intermediate_size"] or 0, vocab=vocab,
        block_size=ints["block_size"] or 0, target_layer_ids=tuple(ids),
        mask_token_id=ints["mask_token_id"] or 0, layer_types=tuple(types),
        sliding_window=window, causal=causal if isinstance(causal, bool) else None,
        embedding_scale=scales["input_embedding_scale"] or 1.0,
        output_multiplier=scales["output_multiplier"] or 1.0,
        softcap=softcap if softcap else None, raw=raw)
    return spec, []


def expected_tensors(spec: DFlashSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash checkpoint holds, by its published name (no embedding, no head)."""
    h, d, i = spec.hidden, spec.head_dim, spec.intermediate
    names: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(spec.target_layer_ids) * h), "hidden_norm.weight": (h,),
        "norm.weight": (h,)}
    for n in range(spec.layers):
        p = f"layers.{n}."
        names |= {p + "self_attn.q_proj.weight": (spec.heads * d, h),
                  p + "self_attn.k_proj.weight": (spec.kv_heads * d, h),
                  p + "self_attn.v_proj.weight": (spec.kv_heads * d, h),
                  p + "self_attn.o_proj.weight": (h, spec.heads * d),
                  p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                  p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                  p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                  p + "post_attention_layernorm.weight": (h,)}
    return names


def check_tensors(spec: DFlashSpec, tensors: dict[str, Any], prefix: str) -> list[Finding]:
    """weights.missing / weights.unexpected / weights.shape_mismatch against the config, the
    first of each (a quantized linear's packed weight is not compared)."""
    want = expected_tensors(spec)
    quantized = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(QUANT_PARTS)}
    checks = (
        ("weights.missing", [n for n in want if n not in tensors], "drafter tensor(s) missing"),
        ("weights.unexpected", [n for n in tensors if n not in want and not (
            n.endswith(QUANT_PARTS) and n.rsplit(".", 1)[0] + ".weight" in want)],
         "tensor(s) no DFlash layer has"),
        ("weights.shape_mismatch", [n for n, s in want.items() if n in tensors and n.rsplit(
            ".", 1)[0] not in quantized and tuple(tensors[n].shape) != s],
         "tensor(s) shaped unlike the config"))
    return [finding(code, f"{len(names)} {what}, first {names[0]}"
                    + (f" {list(tensors[names[0]].shape)} (the config makes it "
                       f"{list(want[names[0]])})" if code == "weights.shape_mismatch" else ""),
                    prefix + names[0]) for code, names, what in checks if names]


def check_pair(spec: DFlashSpec, target: dict[str, Any], where: str) -> list[Finding]:
    """Does this drafter fit this target? drafter.mismatch for the hidden size and the target
    layers it reads; tokenizer.vocab_mismatch for the vocabulary (its drafts are the target's
    token ids, its logits the target's head's)."""
    text = target.get("text_config")  # a multimodal wrapper's (Qwen3.5, Gemma 4), else itself
    text = text if isinstance(text, dict) else target
    hidden, layers, vocab = (_int(text, k) for k in ("hidden_size", "num_hidden_layers",
                                                      "vocab_size"))
    out = []
    if hidden != spec.hidden:
        out.append(finding("drafter.mismatch", f"the drafter's hidden_size is {spec.hidden}, "
                           f"the target's {hidden}", where))
    if vocab != spec.vocab:
        out.append(finding("tokenizer.vocab_mismatch", f"the drafter's vocab_size is "
                           f"{spec.vocab}, the target's {vocab}", where))
    beyond = [i for i in spec.target_layer_ids if layers is None or i >= layers]
    if beyond:
        out.append(finding("drafter.mismatch", f"target_layer_ids {list(spec.target_layer_ids)} "
                           f"name layer {beyond[0]}, but the target has {layers} layers", where))
    declared = _int(spec.raw, "num_target_layers")
    if declared and layers is not None and declared != layers:
        out.append(finding("drafter.mismatch", f"the drafter was trained on a target of "
                           f"{declared} layers (num_target_layers), this one has {layers}",
                           where))
    return out


@dataclass
class DFlashReport:
    """The DFlash drafter found in a bundle (or not), and what is wrong with it or the pair."""

    path: str | None = None  # relative to the bundle root
    spec: DFlashSpec | None = None
    files: list[str] = field(default_factory=list)
    tensors: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    def manifest_section(self) -> dict[str, Any] | None:
        if self.spec is None or self.path is None:
            return None
        return {"kind": KIND, "path": self.path, "layers": self.spec.layers,
                "block_size": self.spec.block_size,
                "target_layer_ids": list(self.spec.target_layer_ids),
                "mask_token_id": self.spec.mask_token_id, "weights": "as_given"}


def read_dflash(root: Path, target: dict[str, Any],
                manifest: dict[str, Any] | None = None) -> DFlashReport:
    """Find the bundle's DFlash drafter, read its config and headers (bounded: bundle_file and
    the header reader refuse what escapes the bundle or is not a regular file), check both."""
    rel, found = drafter_folder(root, manifest, (KIND,), DFLASH_DIR, "DFlash drafter")
    report = DFlashReport(path=rel, findings=found)
    if rel is None:
        return report
    read_folder(report, root, rel, target, root, "DFlash drafter", read_spec, check_tensors,
                check_pair)
    return report


def read_dflash_folder(folder: Path, target: dict[str, Any], target_root: Path) -> DFlashReport:
    """A DFlash drafter folder given on its own (convert's --drafter), checked against the
    target whose config and tokenizer are given; paths in findings are relative to the
    folder's parent."""
    report = DFlashReport(path=folder.name)
    if not (folder / "config.json").is_file():
        report.findings.append(finding("drafter.invalid", "no config.json: not a checkpoint "
                                       "folder", str(folder)))
        return report
    read_folder(report, folder.parent, folder.name, target, target_root, "DFlash drafter",
                read_spec, check_tensors, check_pair)
    return report


def is_dflash(folder: Path) -> bool:
    """Whether a drafter folder's config says DFlash (a `dflash_config`, or a DFlash
    architecture); anything else is read as Gemma 4's assistant, whose reader refuses what is
    neither."""
    try:
        raw = read_json(folder / "config.json")
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    names = raw.get("architectures")
    return "dflash_config" in raw or (isinstance(names, list)
                                      and any("DFlash" in str(n) for n in names))
