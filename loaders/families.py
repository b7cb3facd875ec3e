"""Family quirks as data: how each model family names its MTP head, lays out MoE experts,
encodes RMSNorm gains, and how wide each linear's input is.

This is the one place that knows family names (like gguf-py's tensor_mapping): every other
module asks these tables instead of testing model types itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ShapeRule:
    """A config value that a tensor's shape pins, for checking the config against the weights.

    pattern matches a trunk tensor name with its model prefixes stripped
    (`layers.3.self_attn.k_proj.weight`); axis is the dimension that holds the value (the last
    one is read through quantized packing); says names the config values that set it (the
    first name in it is the key findings point at), expected computes it from the flat config (None:
    the config does not say).
    """

    pattern: str
    axis: int
    says: str
    expected: Callable[[dict[str, Any]], int | None]


@dataclass(frozen=True)
class Family:
    """How one family stores its MTP head.

    mtp_pattern matches a tensor name and yields `rest` (the name inside the MTP block) and,
    for families that number their blocks, `block`. block_offset_key names the config value
    subtracted from `block` (DeepSeek stores its head as layer num_hidden_layers + k).
    head_roles maps the family's head-level module names to canonical roles.
    """

    name: str
    model_types: tuple[str, ...]
    mtp_pattern: str | None = None
    block_offset_key: str | None = None
    head_roles: dict[str, str] = field(default_factory=dict)
    zero_centred_norms: bool = False
    concat_order: str = "embedding_first"
    experts_key: str = "num_experts"
    # Run the trunk model's own sanitize over the MTP decoder layer (renamed to trunk layer k):
    # for families whose layer needs it (DeepSeek's MLA kv_b_proj split, FP8 dequant) and whose
    # sanitize does not depend on trunk-wide signals.
    sanitize_mtp_layer: bool = False
    # The MTP contract (recorded in the manifest, overridable at load): which trunk hidden feeds
    # the head, which head output feeds the next chained draft step, and which trunk layer kind
    # the head's decoder layer is ("full_attention": like the trunk's softmax-attention layers;
    # "after_trunk": built as trunk layer num_hidden_layers, as DeepSeek numbers it).
    hidden_feed: str = "post_norm"
    next_hidden: str = "post_mtp_norm"
    mtp_layer_kind: str = "full_attention"
    # MiMo zeroes the token embedding of the MTP input at sequence position 0.
    zero_first_embedding: bool = False
    # The config value that counts the trunk's decoder layers (`layers.0` .. `layers.N-1`).
    layers_key: str = "num_hidden_layers"
    # Shapes this family's tensors pin beyond UNIVERSAL_SHAPE_RULES (head counts, MLP widths).
    shape_rules: tuple[ShapeRule, ...] = ()


def _int(c: dict[str, Any], key: str) -> int | None:
    value = c.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _key(key: str) -> Callable[[dict[str, Any]], int | None]:
    return lambda c: _int(c, key)


def _head_dim(c: dict[str, Any]) -> int | None:
    """head_dim, else hidden_size / num_attention_heads (how mlx-lm's classes default it)."""
    hidden, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    return _int(c, "head_dim") or (hidden // heads if hidden and heads else None)


def _q_head_dim(c: dict[str, Any]) -> int | None:
    """A query head's width: DeepSeek's MLA splits it into a no-rope and a rope part."""
    nope, rope = _int(c, "qk_nope_head_dim"), _int(c, "qk_rope_head_dim")
    return nope + rope if nope and rope else _head_dim(c)


def _times(*parts: Callable[[dict[str, Any]], int | None], factor: int = 1
             ) -> Callable[[dict[str, Any]], int | None]:
    def get(c: dict[str, Any]) -> int | None:
        out = factor
        for part in parts:
            value = part(c)
            if value is None:
                return None
            out *= value
        return out
    return get


def _experts(c: dict[str, Any]) -> int | None:
    return _int(c, "num_experts") or _int(c, "n_routed_experts")


def _kv_a(c: dict[str, Any]) -> int | None:
    rank, rope = _int(c, "kv_lora_rank"), _int(c, "qk_rope_head_dim")
    return rank + rope if rank and rope else None


# Prefixes before a trunk tensor's own path: `model.`, mlx-lm's `language_model.model.`, HF's
# `model.language_model.`. Vision towers (`model.visual.blocks.N`) and MTP heads keep theirs.
TRUNK_PREFIX = r"^(?:(?:model|language_model)\.)*"
TRUNK_LAYER = r"^layers\.(?P<layer>\d+)\."
_LAYER = r"^layers\.\d+\."
_HIDDEN = "hidden_size"
# What every family's tensors say about the config (shapes any decoder-only LM in mlx-lm has):
# the embedding is [vocab, hidden], norms are [hidden], attention and MLP outputs are hidden wide.
UNIVERSAL_SHAPE_RULES: tuple[ShapeRule, ...] = (
    ShapeRule(r"^embed_tokens\.weight$", 0, "vocab_size", _key("vocab_size")),
    ShapeRule(r"^lm_head\.weight$", 0, "vocab_size", _key("vocab_size")),
    ShapeRule(r"^embed_tokens\.weight$", -1, _HIDDEN, _key("hidden_size")),
    ShapeRule(r"^norm\.weight$", -1, _HIDDEN, _key("hidden_size")),
    ShapeRule(_LAYER + r"input_layernorm\.weight$", -1, _HIDDEN, _key("hidden_size")),
    ShapeRule(_LAYER + r"self_attn\.o_proj\.weight$", -2, _HIDDEN, _key("hidden_size")),
    ShapeRule(_LAYER + r"mlp\.(?:\w+\.)*down_proj\.weight$", -2, _HIDDEN, _key("hidden_size")),
)
_KV = ShapeRule(_LAYER + r"self_attn\.k_proj\.weight$", -2, "num_key_value_heads x head_dim",
                _times(_key("num_key_value_heads"), _head_dim))
_Q_KEYS = "num_attention_heads x head_dim"
_Q = ShapeRule(_LAYER + r"self_attn\.q_proj\.weight$", -2, _Q_KEYS,
               _times(_key("num_attention_heads"), _q_head_dim))
# Qwen3-Next / Qwen3.5 attention gates its output: q_proj also carries one gate per query value.
_GATED_Q = ShapeRule(_LAYER + r"self_attn\.q_proj\.weight$", -2, "2 x " + _Q_KEYS,
                     _times(_key("num_attention_heads"), _head_dim, factor=2))
_MOE_KEYS = "moe_intermediate_size"
_EXPERT_KEYS = "num_experts (or n_routed_experts)"
# Head counts and MLP widths, for the families whose attention and MLP layouts are known here.
_ATTENTION_AND_MLP: tuple[ShapeRule, ...] = (
    _KV,
    ShapeRule(_LAYER + r"self_attn\.q_b_proj\.weight$", -2, _Q_KEYS,
              _times(_key("num_attention_heads"), _q_head_dim)),
    ShapeRule(_LAYER + r"self_attn\.kv_a_proj_with_mqa\.weight$", -2,
              "kv_lora_rank + qk_rope_head_dim", _kv_a),
    ShapeRule(_LAYER + r"mlp\.gate_proj\.weight$", -2, "intermediate_size",
              _key("intermediate_size")),
    ShapeRule(_LAYER + r"mlp\.gate\.weight$", -2, _EXPERT_KEYS, _experts),
    ShapeRule(_LAYER + r"mlp\.switch_mlp\.(?:gate|up|down)_proj\.weight$", 0, _EXPERT_KEYS,
              _experts),
    ShapeRule(_LAYER + r"mlp\.switch_mlp\.(?:gate|up)_proj\.weight$", -2, _MOE_KEYS,
              _key("moe_intermediate_size")),
    ShapeRule(_LAYER + r"mlp\.experts\.\d+\.(?:gate|up)_proj\.weight$", -2, _MOE_KEYS,
              _key("moe_intermediate_size")),
    ShapeRule(_LAYER + r"mlp\.experts\.gate_up_proj$", 0, _EXPERT_KEYS, _experts),
    ShapeRule(_LAYER + r"mlp\.experts\.gate_up_proj$", -2, "2 x moe_intermediate_size",
              _times(_key("moe_intermediate_size"), factor=2)),
    ShapeRule(_LAYER + r"mlp\.shared_expert\.gate_proj\.weight$", -2,
              "shared_expert_intermediate_size", _key("shared_expert_intermediate_size")),
    ShapeRule(_LAYER + r"mlp\.shared_experts\.gate_proj\.weight$", -2,
              "moe_intermediate_size x n_shared_experts",
              _times(_key("moe_intermediate_size"), _key("n_shared_experts"))),
)
PLAIN_ATTENTION_RULES = (_Q, *_ATTENTION_AND_MLP)
GATED_ATTENTION_RULES = (_GATED_Q, *_ATTENTION_AND_MLP)

# Canonical MTP names are Qwen's: mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden,
# mtp.norm, mtp.layers.K.<decoder layer>; extra heads of multi-block families: mtp.heads.K.<role>.
CANONICAL_PATTERN = r"^(?:model\.)?(?:language_model\.)?mtp\.(?P<rest>.+)$"
HEAD_ROLES = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")

FAMILIES: tuple[Family, ...] = (
    Family("qwen3_5", ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_6",
                       "qwen3_6_moe"),
           CANONICAL_PATTERN, zero_centred_norms=True, shape_rules=GATED_ATTENTION_RULES),
    Family("qwen3_next", ("qwen3_next",), CANONICAL_PATTERN, zero_centred_norms=True,
           shape_rules=GATED_ATTENTION_RULES),
    Family("deepseek", ("deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe", "glm4_moe_lite"),
           r"^model\.layers\.(?P<block>\d+)\.(?P<rest>.+)$", block_offset_key="num_hidden_layers",
           head_roles={"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
                       "eh_proj": "fc", "shared_head.norm": "norm",
                       "shared_head.head": "shared_head", "embed_tokens": "embed_tokens"},
           experts_key="n_routed_experts", sanitize_mtp_layer=True,
           next_hidden="pre_mtp_norm", mtp_layer_kind="after_trunk",
           shape_rules=PLAIN_ATTENTION_RULES),
    Family("mimo", ("mimo",), r"^model\.mtp_layers\.(?P<block>\d+)\.(?P<rest>.+)$",
           head_roles={"token_layernorm": "pre_fc_norm_embedding",
                       "hidden_layernorm": "pre_fc_norm_hidden", "input_proj": "fc",
                       "final_layernorm": "norm"},
           concat_order="hidden_first", zero_first_embedding=True,
           shape_rules=PLAIN_ATTENTION_RULES),
    Family("llama", ("llama", "mistral", "smollm3"), shape_rules=PLAIN_ATTENTION_RULES),
)
GENERIC = Family("generic", (), CANONICAL_PATTERN)


def family_for(model_type: str | None) -> Family:
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    return GENERIC


def _canonical_from_block(rest: str, block: int, fam: Family) -> str:
    for source, role in sorted(fam.head_roles.items(), key=lambda kv: -len(kv[0])):
        if rest == source or rest.startswith(source + "."):
            scope = "mtp." if block == 0 else f"mtp.heads.{block}."
            return scope + role + rest[len(source):]
    return f"mtp.layers.{block}.{rest}"


def canonical_mtp_name(name: str, fam: Family, config: dict[str, Any]) -> str | None:
    """The canonical `mtp.` name of tensor `name`, or None when it is not part of an MTP head."""
    canonical = re.match(CANONICAL_PATTERN, name)
    if canonical:
        return "mtp." + canonical["rest"]
    if fam.mtp_pattern is None:
        return None
    m = re.match(fam.mtp_pattern, name)
    if not m:
        return None
    block = int(m["block"])
    if fam.block_offset_key:
        offset = config.get(fam.block_offset_key)
        if not isinstance(offset, int) or block < offset:
            return None
        block -= offset
    return _canonical_from_block(m["rest"], block, fam)


# MoE expert layouts, family-independent: (layout, pattern over a tensor name).
EXPERT_LAYOUTS: tuple[tuple[str, str], ...] = (
    ("numbered", r"^(?P<moe>.+)\.experts\.(?P<expert>\d+)\."
                 r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<param>weight|scales|biases)$"),
    ("fused", r"^(?P<moe>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)"
              r"(?:\.(?P<param>weight|scales|biases))?$"),
    ("stacked", r"^(?P<moe>.+)\.switch_mlp\.(?P<proj>gate_proj|up_proj|down_proj)"
                r"\.(?P<param>weight|scales|biases)$"),
)


def expert_layout(name: str) -> tuple[str, re.Match[str]] | None:
    for layout, pattern in EXPERT_LAYOUTS:
        m = re.match(pattern, name)
        if m:
            return layout, m
    return None


def stacked_modules(path: str) -> tuple[str, ...]:
    """The stacked switch_mlp module(s) an expert module belongs to, so layouts compare equal:
    `X.experts.3.up_proj` -> (`X.switch_mlp.up_proj`,), fused gate_up -> gate and up."""
    hit = expert_layout(path + ".weight")
    if hit is None or hit[0] == "stacked":
        return (path,)
    proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}.get(hit[1]["proj"],
                                                                          hit[1]["proj"])
    projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)
    return tuple(f"{hit[1]['moe']}.switch_mlp.{p}" for p in projs)


# Attributes under which mlx-lm's decoder layers hold a recurrent (non-trimmable) mixer.
RECURRENT_ATTRIBUTES = ("linear_attn",)
# mlx-lm model types whose attention applies its mask with mx.where, so a traced pass must give
# them a bool mask (the rest add it): decoder/traced.py.
SELECTING_MASK = frozenset({"bailing_hybrid", "bailing_moe_v3", "deepseek_v3", "deepseek_v32",
                            "gemma2", "glm4_moe_lite", "kimi_k3", "kimi_linear", "longcat_flash",
                            "mistral4"})
# mlx-lm model types whose shard() repeats KV heads when the ranks outnumber them (Qwen3.5):
# decoder/sharding.py.
KV_REPEATING = frozenset({"qwen3_5", "qwen3_5_moe"})


# RMSNorm gains that Qwen3-Next / Qwen3.5 checkpoints store zero-centred, by name suffix -> role
# (the gated linear_attn.norm is not among them: mlx-lm's sanitize leaves it alone).
NORM_ROLES = {
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "q_norm.weight": "q_norm", "k_norm.weight": "k_norm",
    "pre_fc_norm_embedding.weight": "pre_fc_norm_embedding",
    "pre_fc_norm_hidden.weight": "pre_fc_norm_hidden",
    "model.norm.weight": "final_norm", "mtp.norm.weight": "final_norm",
}
# Which of the trunk's roles an MTP head gain is compared with. The pre-fc norms have no twin in
# the trunk; trained, they share the layer norms' statistics (zero-centred means 0.30-0.39 in
# published Qwen3.5/3.6 heads), so they are compared with those.
NORM_TWINS = {
    "pre_fc_norm_embedding": ("input_layernorm", "post_attention_layernorm"),
    "pre_fc_norm_hidden": ("input_layernorm", "post_attention_layernorm"),
}


def norm_role(name: str) -> str | None:
    """The role of a zero-centred-by-convention RMSNorm gain, or None for any other tensor."""
    return next((r for suffix, r in NORM_ROLES.items() if name.endswith(suffix)), None)


def is_shifted_norm(name: str) -> bool:
    return norm_role(name) is not None


def _attn_out(c: dict[str, Any]) -> int | None:
    heads = c.get("num_attention_heads")
    per_head = c.get("v_head_dim") or c.get("head_dim")
    if per_head is None and heads and c.get("hidden_size"):
        per_head = c["hidden_size"] // heads
    return heads * per_head if heads and per_head else None


def _product(*keys: str) -> Callable[[dict[str, Any]], int | None]:
    def get(c: dict[str, Any]) -> int | None:
        values = [c.get(k) for k in keys]
        if all(isinstance(v, int) for v in values):
            out = 1
            for v in values:
                out *= v
            return out
        return None
    return get


# Input width of a linear, by module path: first matching rule wins. A string value names a
# sibling module whose output rows equal this module's input (GLU down_proj <- up_proj).
IN_FEATURES_RULES: tuple[tuple[str, Callable[[dict[str, Any]], int | None] | str], ...] = (
    (r"(?:^|\.)(?:fc|eh_proj|input_proj)$", lambda c: 2 * c["hidden_size"]),
    (r"\.down_proj$", "up_proj"),
    (r"\.w2$", "w3"),
    (r"\.self_attn\.o_proj$", _attn_out),
    (r"\.linear_attn\.out_proj$", _product("linear_num_value_heads", "linear_value_head_dim")),
    (r"\.q_b_proj$", _product("q_lora_rank")),
    (r"\.(?:kv_b_proj|unembed_out)$", _product("kv_lora_rank")),
    (r"\.embed_q$", _product("qk_nope_head_dim")),
    (r".", _product("hidden_size")),
)
