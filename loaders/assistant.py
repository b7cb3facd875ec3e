"""Gemma 4's "assistant" drafter: a separate checkpoint read beside its target, and the pair.

An assistant (`model_type gemma4_assistant`) keeps no K/V of its own: each of its layers attends
over the K/V the target keeps for its last layer of the same kind (full or sliding attention),
its input is the target's embedding of the last token beside the target's last hidden state
(`pre_projection`), and its output goes back to the target's width (`post_projection`). So it
only runs beside the target it was trained with: same vocabulary, the target's hidden size, and
target layers of the kinds it reads with the head sizes it expects. Everything here reads
headers and configs only (names from transformers' `gemma4_assistant` and mlx-lm's
`gemma4_text`; docs/assistant.md cites them).

Bundle layout: the assistant lives in a subfolder of the bundle (`assistant/` by default, or the
folder `mtpkit.json`'s `drafter.path` names) with its own `config.json` and `*.safetensors`;
the trunk stays at the root, so stock mlx-lm still loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpkit.loaders.drafters import drafter_folder, read_folder
from mtpkit.loaders.findings import Finding, finding

ASSISTANT_TYPE = "gemma4_assistant"
DRAFTER_DIR = "assistant"  # where convert puts it, and where doctor looks without a manifest
TARGET_TYPES = ("gemma4", "gemma4_text")
KINDS = ("full_attention", "sliding_attention")
INT_DTYPES = ("I64", "I32", "U32", "I16", "U16", "U8", "I8")
QUANT_PARTS = (".scales", ".biases")


@dataclass(frozen=True)
class AssistantSpec:
    """What an assistant's config.json says, checked for the values its shapes depend on."""

    backbone_hidden: int  # the target's hidden size it was trained against
    hidden: int
    layers: int
    layer_types: tuple[str, ...]
    heads: int
    head_dim: int  # sliding layers
    global_head_dim: int  # full-attention layers
    intermediate: int
    vocab: int
    ordered: bool  # the centroid-routed sparse LM head (E2B / E4B assistants)
    num_centroids: int
    top_k: int
    tied: bool
    sliding_window: int
    text: dict[str, Any] = field(default_factory=dict, compare=False)

    def head_dim_of(self, kind: str) -> int:
        return self.global_head_dim if kind == "full_attention" else self.head_dim

    @property
    def lm_head(self) -> str:
        return "centroids" if self.ordered else ("tied" if self.tied else "dense")

    def kinds(self) -> list[str]:
        return sorted(set(self.layer_types))


def _int(scope: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = scope.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def default_layer_types(text: dict[str, Any], layers: int) -> list[str]:
    """mlx-lm gemma4_text's default: (pattern - 1) sliding layers, then one full, repeated."""
    pattern = text.get("sliding_window_pattern", 5)
    pattern = pattern if isinstance(pattern, int) and pattern > 0 else 5
    unit = ["sliding_attention"] * (pattern - 1) + ["full_attention"]
    return (unit * (layers // len(unit) + 1))[:layers]


def read_spec(raw: dict[str, Any], where: str) -> tuple[AssistantSpec | None, list[Finding]]:
    """The assistant's config as a spec, or drafter.invalid naming the first key that is wrong.
    The constraints are those transformers' Gemma4AssistantConfig.validate_architecture states."""
    def bad(message: str) -> tuple[None, list[Finding]]:
        return None, [finding("drafter.invalid", message, where)]

    if raw.get("model_type") != ASSISTANT_TYPE:
        return bad(f"model_type is {raw.get('model_type')!r}, not {ASSISTANT_TYPE!r}")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return bad("no text_config object (the assistant's Gemma4TextConfig)")
    ints = {k: _int(text, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "head_dim", "intermediate_size", "vocab_size")}
    ints["backbone_hidden_size"] = _int(raw, "backbone_hidden_size", 1536)
    missing = [k for k, v in ints.items() if v is None]
    if missing:
        return bad(f"{missing[0]} is missing or not a positive integer")
    layers = ints["num_hidden_layers"]
    assert layers is not None
    shared = text.get("num_kv_shared_layers") or layers  # HF: unset means every layer
    if shared != layers:
        return bad(f"num_kv_shared_layers is {shared}, not num_hidden_layers ({layers}): every "
                   "assistant layer must read the target's K/V")
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if text.get(key, 0) not in (0, None):
            return bad(f"{key} is {text.get(key)}; an assistant has no per-layer inputs (0)")
    for key in ("enable_moe_block", "use_double_wide_mlp"):
        if text.get(key, False):
            return bad(f"{key} is true; an assistant's layers are dense, single-width")
    types = text.get("layer_types") or default_layer_types(text, layers)
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(KINDS):
        return bad(f"layer_types must list {layers} of {KINDS}")
    ordered = bool(raw.get("use_ordered_embeddings", False))
    centroids = _int(raw, "num_centroids", 2048) or 0
    top_k = _int(raw, "centroid_intermediate_top_k", 32) or 0
    vocab = ints["vocab_size"]
    assert vocab is not None
    if ordered and (not centroids or not top_k or vocab % centroids or top_k > centroids):
        return bad(f"the centroid head needs vocab_size ({vocab}) divisible by num_centroids "
                   f"({centroids}) and 0 < centroid_intermediate_top_k ({top_k}) <= it")
    spec = AssistantSpec(
        backbone_hidden=ints["backbone_hidden_size"] or 0, hidden=ints["hidden_size"] or 0,
        layers=layers, layer_types=tuple(types), heads=ints["num_attention_heads"] or 0,
        head_dim=ints["head_dim"] or 0,
        global_head_dim=_int(text, "global_head_dim") or ints["head_dim"] or 0,
        intermediate=ints["intermediate_size"] or 0, vocab=vocab, ordered=ordered,
        num_centroids=centroids, top_k=top_k, tied=bool(raw.get("tie_word_embeddings", True)),
        sliding_window=_int(text, "sliding_window", 512) or 512, text=text)
    return spec, []


def expected_tensors(spec: AssistantSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor an assistant checkpoint holds, by its published (transformers) name."""
    h, b = spec.hidden, spec.backbone_hidden
    names: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (spec.vocab, h), "model.norm.weight": (h,),
        "pre_projection.weight": (h, 2 * b), "post_projection.weight": (b, h),
    }
    for i, kind in enumerate(spec.layer_types):
        d, p = spec.head_dim_of(kind), f"model.layers.{i}."
        names |= {p + "self_attn.q_proj.weight": (spec.heads * d, h),
                  p + "self_attn.q_norm.weight": (d,),
                  p + "self_attn.o_proj.weight": (h, spec.heads * d),
                  p + "mlp.gate_proj.weight": (spec.intermediate, h),
                  p + "mlp.up_proj.weight": (spec.intermediate, h),
                  p + "mlp.down_proj.weight": (h, spec.intermediate),
                  p + "layer_scalar": (1,)}
        names |= {p + f"{n}_layernorm.weight": (h,)
                  for n in ("input", "post_attention", "pre_feedforward", "post_feedforward")}
    if spec.ordered:
        names |= {"masked_embedding.centroids.weight": (spec.num_centroids, h),
                  "masked_embedding.token_ordering": (spec.vocab,)}
    if not spec.tied:
        names["lm_head.weight"] = (spec.vocab, h)
    return names


# A tied checkpoint may still carry its head's copy (transformers saves tied weights once,
# other exporters twice); these are accepted, never required.
OPTIONAL = ("lm_head.weight",)


@dataclass(frozen=True)
class TargetKV:
    """Which target layer keeps the K/V each kind of assistant layer reads, and its sizes."""

    layer: dict[str, int]  # kind -> index of the target layer (and its mlx-lm cache)
    kv_heads: dict[str, int]
    head_dim: dict[str, int]
    hidden: int
    vocab: int


def target_text(raw: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 4 target's text config: `text_config` of the multimodal `gemma4`, else itself."""
    text = raw.get("text_config")
    return text if raw.get("model_type") == "gemma4" and isinstance(text, dict) else raw


def target_kv(raw: dict[str, Any]) -> TargetKV | None:
    """The target's K/V-owning layer per kind: the last layer of that kind that keeps its own
    K/V (layers past num_hidden_layers - num_kv_shared_layers reuse an earlier layer's, which
    is the one the assistant reads too: mlx-lm's Gemma4TextModel.previous_kvs); None when the
    config is not a Gemma 4 one."""
    if raw.get("model_type") not in TARGET_TYPES:
        return None
    text = target_text(raw)
    layers, hidden, vocab = (_int(text, k) for k in ("num_hidden_layers", "hidden_size",
                                                     "vocab_size"))
    if layers is None or hidden is None or vocab is None:
        return None
    types = text.get("layer_types") or default_layer_types(text, layers)
    owning = layers - (text.get("num_kv_shared_layers") or 0)
    kv, k_eq_v = _int(text, "num_key_value_heads", 1) or 1, bool(text.get("attention_k_eq_v"))
    global_kv = _int(text, "num_global_key_value_heads") if k_eq_v else None
    head, global_head = _int(text, "head_dim", 256) or 256, _int(text, "global_head_dim")
    found: dict[str, int] = {}
    for i, kind in enumerate(types[:max(owning, 0)]):
        found[kind] = i
    return TargetKV(
        layer=found,
        kv_heads={"sliding_attention": kv, "full_attention": global_kv or kv},
        head_dim={"sliding_attention": head, "full_attention": global_head or head},
        hidden=hidden, vocab=vocab)


def check_pair(spec: AssistantSpec, target: dict[str, Any], where: str) -> list[Finding]:
    """Does this assistant fit this target? drafter.mismatch for the hidden size, the layers it
    reads and their head sizes; tokenizer.vocab_mismatch for the vocabulary."""
    kv = target_kv(target)
    if kv is None:
        return [finding("drafter.mismatch", f"the target is model_type "
                        f"{target.get('model_type')!r}; a Gemma 4 assistant reads a Gemma 4 "
                        f"target's K/V ({' or '.join(TARGET_TYPES)})", where)]
    out = []
    if spec.backbone_hidden != kv.hidden:
        out.append(finding("drafter.mismatch", f"backbone_hidden_size {spec.backbone_hidden} but "
                           f"the target's hidden_size is {kv.hidden}", where))
    if spec.vocab != kv.vocab:
        out.append(finding("tokenizer.vocab_mismatch", f"the assistant's vocab_size {spec.vocab} "
                           f"but the target's is {kv.vocab}", where))
    for kind in spec.kinds():
        if kind not in kv.layer:
            out.append(finding("drafter.mismatch", f"the assistant reads the target's last "
                               f"{kind} layer, but the target keeps no K/V of that kind", where))
            continue
        dim, want = kv.head_dim[kind], spec.head_dim_of(kind)
        if dim != want:
            out.append(finding("drafter.mismatch", f"{kind}: the assistant's queries are {want} "
                               f"wide, the target's keys {dim} (layer {kv.layer[kind]})", where))
        elif spec.heads % kv.kv_heads[kind]:
            out.append(finding("drafter.mismatch", f"{kind}: {spec.heads} query heads cannot "
                               f"share the target's {kv.kv_heads[kind]} K/V heads", where))
    return out


def check_tensors(spec: AssistantSpec, tensors: dict[str, Any], prefix: str) -> list[Finding]:
    """Names and shapes against the config: weights.missing, weights.unexpected,
    weights.shape_mismatch (a quantized linear's packed weight is not compared), and
    weights.dtype_mismatch for a token ordering stored as floats (it indexes the vocabulary)."""
    want = expected_tensors(spec)
    quantized = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(QUANT_PARTS)}
    out: list[Finding] = []
    missing = [n for n in want if n not in tensors and n not in OPTIONAL]
    if missing:
        out.append(finding("weights.missing", f"{len(missing)} assistant tensor(s) missing, "
                           f"first {missing[0]}", prefix + missing[0]))
    extra = [n for n in tensors if n not in want and n not in OPTIONAL
             and not (n.endswith(QUANT_PARTS) and n.rsplit(".", 1)[0] + ".weight" in want)]
    if extra:
        out.append(finding("weights.unexpected", f"{len(extra)} tensor(s) no assistant layer "
                           f"has, first {extra[0]}", prefix + extra[0]))
    for name, shape in want.items():
        info = tensors.get(name)
        if info is None or name.rsplit(".", 1)[0] in quantized:
            continue
        if tuple(info.shape) != shape:
            out.append(finding("weights.shape_mismatch", f"{name} is {list(info.shape)}, the "
                               f"config makes it {list(shape)}", prefix + name))
    order = tensors.get("masked_embedding.token_ordering")
    if order is not None and order.dtype not in INT_DTYPES:
        out.append(finding("weights.dtype_mismatch", f"token_ordering is {order.dtype}; it "
                           "indexes the vocabulary and must be an integer tensor",
                           prefix + "masked_embedding.token_ordering"))
    return out


@dataclass
class DrafterReport:
    """The assistant found in a bundle (or not), and what is wrong with it or with the pair."""

    path: str | None = None  # relative to the bundle root
    spec: AssistantSpec | None = None
    files: list[str] = field(default_factory=list)  # relative to the bundle root
    tensors: dict[str, Any] = field(default_factory=dict)
    reads: dict[str, int] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    def manifest_section(self) -> dict[str, Any] | None:
        if self.spec is None or self.path is None:
            return None
        return {"kind": ASSISTANT_TYPE, "path": self.path, "layers": self.spec.layers,
                "layer_types": list(self.spec.layer_types), "reads": dict(self.reads),
                "backbone_hidden_size": self.spec.backbone_hidden, "lm_head": self.spec.lm_head,
                "weights": "as_given"}


def read_drafter(root: Path, target: dict[str, Any],
                 manifest: dict[str, Any] | None = None) -> DrafterReport:
    """Find the bundle's drafter, read its config and headers, and check it and the pair."""
    rel, found = drafter_folder(root, manifest, (ASSISTANT_TYPE, None), DRAFTER_DIR, "drafter")
    if rel is None:
        return DrafterReport(findings=found)
    report = _read(root, rel, target, root)
    report.findings[:0] = found
    return report


def read_assistant(folder: Path, target: dict[str, Any], target_root: Path) -> DrafterReport:
    """An assistant checkpoint folder given on its own (convert's --drafter), checked against
    the target whose config and tokenizer are given; paths in findings are relative to the
    folder's parent."""
    if not (folder / "config.json").is_file():
        return DrafterReport(findings=[finding("drafter.invalid", "no config.json: not a "
                                               "checkpoint folder", str(folder))])
    return _read(folder.parent, folder.name, target, target_root)


def _read(root: Path, rel: str, target: dict[str, Any], target_root: Path) -> DrafterReport:
    report = DrafterReport(path=rel)
    read_folder(report, root, rel, target, target_root, "assistant", read_spec, check_tensors,
                check_pair)
    if report.spec is None:
        return report
    spec = report.spec
    kv = target_kv(target)
    report.reads = {k: kv.layer[k] for k in spec.kinds() if kv and k in kv.layer}
    return report



