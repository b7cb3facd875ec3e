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
class Sublayer:
    """One pre-norm residual step of an MTP block that no single layer class of the trunk
    computes: x + module(norm(x)), the module a class of the trunk's own mlx-lm module built
    from the config (decoder/model/head.py). name: where its weights sit in the block ("self_attn.0":
    the first of a list, as the trunk layer names its attentions); attends: called with the
    mask and the block's cache."""

    name: str
    cls: str
    norm: str
    args: dict[str, Any] = field(default_factory=dict)
    attends: bool = False


@dataclass(frozen=True)
class Family:
    """How one family stores its MTP head.

    mtp_patterns match a tensor name (first match wins, before the canonical `mtp.` names) and
    yield `rest` (the name inside the MTP block, `.param` appended when the pattern has that
    group) and, for families that number their blocks, `block`. block_offset_key names the
    config value subtracted from `block` (DeepSeek stores its head as layer
    num_hidden_layers + k). head_roles maps the family's head-level module names to canonical
    roles; they are per block (`mtp.heads.K.<role>` beyond block 0) unless shared_roles (one
    head around several physical layers, as Nemotron-H's). required_roles and layer_parts are
    what a complete head holds (per block for layer_parts). unsupported, when set, says why the
    decoder cannot run this layout: the head is kept and diagnosed, and `mtp.unsupported` says
    so wherever it would run. sources: where the names come from (docs/families.md).
    """

    name: str
    model_types: tuple[str, ...]
    mtp_patterns: tuple[str, ...] = ()
    block_offset_key: str | None = None
    head_roles: dict[str, str] = field(default_factory=dict)
    shared_roles: bool = False
    required_roles: tuple[str, ...] = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                       "norm")
    layer_parts: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm", "self_attn",
                                    "mlp")
    # A head whose config names no count (LongCat-Flash builds exactly one layer).
    default_mtp_layers: int = 0
    unsupported: str = ""
    # Why this family's rows cannot decode in one batch exactly (options.invalid for a batch
    # above 1; serve decodes one request at a time), where its caches alone would allow it.
    unbatchable: str = ""
    sources: str = ""
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
    # Keyword arguments of the draft layer's mlx-lm constructor beyond the config (MiMo-V2's
    # DecoderLayer(config, is_moe, is_sliding_window)); its cache is the one mlx-lm makes for
    # the first trunk layer whose attributes agree with those it keeps (decoder/model/trunk.py).
    mtp_layer_args: dict[str, Any] = field(default_factory=dict)
    # Config values the draft layer is built under, set on a copy of the trunk's mlx-lm args:
    # vLLM builds some draft layers under a changed config (Kimi-K3's without the block-residual
    # mixing, MiniMax-M3's forced to sparse attention and MoE by clearing the per-layer lists
    # that would say otherwise, so mlx-lm's defaults say so).
    mtp_config: dict[str, Any] = field(default_factory=dict)
    # The head's own norms (fusion and final) as a class of the trunk's mlx-lm module, where
    # they are not plain RMSNorms (MiniMax-M3's GemmaRMSNorm: (1 + w) gains, stored so).
    norm_class: str = ""
    # Modules of the published draft layer that the layer vLLM builds has no parameter for
    # (Kimi-K3's block-residual weights, which vLLM's loader skips): kept in the sidecar, not
    # loaded (names inside the layer, before mlx-lm's renames and after: `x.` or `x_`).
    unused_layer_parts: tuple[str, ...] = ()
    # The head's layer modules the checkpoint names apart from mlx-lm's class (a pattern over
    # the published path inside the layer -> mlx-lm's, groups allowed; the longest pattern
    # wins), and the config key of the head's RMSNorm epsilon.
    layer_names: dict[str, str] = field(default_factory=dict)
    eps_key: str = "rms_norm_eps"
    # Where mlx-lm's inner text model keeps the token embedding the head embeds with (Bailing:
    # word_embeddings, Nemotron-H: embeddings).
    embed_module: str = "embed_tokens"
    # MiMo zeroes the token embedding of the MTP input at sequence position 0.
    zero_first_embedding: bool = False
    # An MTP block built from the trunk module's classes, where it is no one trunk layer
    # (LongCat-Flash: one MLA attention and a dense MLP); empty: a layer of the trunk's class.
    mtp_block: tuple[Sublayer, ...] = ()
    # A draft step that runs every physical MTP layer in a row, each a trunk-class layer
    # (Nemotron-H's mtp_hybrid_override_pattern, which mlx-lm's ModelArgs does not keep): the
    # constructor argument, its value per layer read from the module the layer holds (first
    # match), and the value whose layer attends with the step's KV cache (the rest take none).
    mtp_pattern: tuple[str, dict[str, str], str] | None = None
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

# DeepSeek's "nextn" head roles (enorm, hnorm, eh_proj, shared_head): GLM, Kimi, Step and
# the rest of the DS-nextn families use these names (docs/families.md).
_NEXTN_ROLES = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
                "eh_proj": "fc", "shared_head.norm": "norm", "shared_head.head": "shared_head",
                "embed_tokens": "embed_tokens"}
_NEXTN_FINAL = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
                "final_layernorm": "norm"}
_AFTER_TRUNK = r"^model\.layers\.(?P<block>\d+)\.(?P<rest>.+)$"
# mlx-lm's Bailing sanitize renames the MoE router (bailing_moe.py, bailing_hybrid.py).
_BAILING_ROUTER = {"mlp.gate.weight": "mlp.gate.gate_proj.weight",
                   "mlp.gate.bias": "mlp.gate.gate_proj.bias"}

FAMILIES: tuple[Family, ...] = (
    Family("qwen3_5", ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_6",
                       "qwen3_6_moe"),
           zero_centred_norms=True, shape_rules=GATED_ATTENTION_RULES),
    Family("qwen3_next", ("qwen3_next",), zero_centred_norms=True,
           shape_rules=GATED_ATTENTION_RULES),
    Family("deepseek", ("deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite"),
           (_AFTER_TRUNK,), block_offset_key="num_hidden_layers", head_roles=_NEXTN_ROLES,
           experts_key="n_routed_experts", sanitize_mtp_layer=True,
           next_hidden="pre_mtp_norm", mtp_layer_kind="after_trunk",
           shape_rules=PLAIN_ATTENTION_RULES,
           sources="vLLM deepseek_mtp.py, glm4_moe_mtp.py; mlx-lm deepseek_v3.py, glm4_moe.py"),
    Family("deepseek_dsa", ("deepseek_v32", "glm_moe_dsa"), (_AFTER_TRUNK,),
           block_offset_key="num_hidden_layers", head_roles=_NEXTN_ROLES,
           experts_key="n_routed_experts", sanitize_mtp_layer=True,
           next_hidden="pre_mtp_norm", mtp_layer_kind="after_trunk",
           shape_rules=PLAIN_ATTENTION_RULES,
           sources="vLLM deepseek_v32 mtp.py (DeepseekV32MTPModel); mlx-lm deepseek_v32.py, "
                   "glm_moe_dsa.py"),
    Family("mimo", ("mimo",), (r"^model\.mtp_layers\.(?P<block>\d+)\.(?P<rest>.+)$",),
           head_roles={"token_layernorm": "pre_fc_norm_embedding",
                       "hidden_layernorm": "pre_fc_norm_hidden", "input_proj": "fc",
                       "final_layernorm": "norm"},
           concat_order="hidden_first", zero_first_embedding=True,
           shape_rules=PLAIN_ATTENTION_RULES),
    Family("ernie4_5", ("ernie4_5_moe",),
           (r"^model\.mtp_block\.(?P<block>\d+)\.(?P<rest>.+)$",
            r"^model\.(?P<rest>mtp_emb_norm|mtp_hidden_norm|mtp_linear_proj)\.(?P<block>\d+)"
            r"\.(?P<param>weight|bias)$"),
           head_roles={"mtp_emb_norm": "pre_fc_norm_embedding",
                       "mtp_hidden_norm": "pre_fc_norm_hidden", "mtp_linear_proj": "fc"},
           required_roles=("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden"),
           experts_key="moe_num_experts", zero_first_embedding=True, mtp_layer_kind="after_trunk",
           next_hidden="pre_mtp_norm",
           sources="vLLM ernie_mtp.py (ErnieMultiTokenPredictorLayer); mlx-lm ernie4_5_moe.py "
                   "sanitize"),
    Family("nemotron_h", ("nemotron_h",),
           (r"^(?:language_model\.)?mtp\.layers\.(?P<block>\d+)\.(?P<rest>.+)$",),
           head_roles=_NEXTN_FINAL, shared_roles=True, layer_parts=("norm", "mixer"),
           experts_key="n_routed_experts", embed_module="embeddings",
           eps_key="layer_norm_epsilon",
           # vLLM nemotron_h_mtp.py: one step runs a layer per pattern character (attention
           # "*", then the non-gated MoE "E"): mlx-lm's NemotronHBlock(args, block_type)
           mtp_pattern=("block_type", {"mixer.q_proj": "*", "mixer.gate": "E",
                                       "mixer.up_proj": "-"}, "*"),
           # its non-gated experts are mlx-lm's SwitchMLP fc1 / fc2 (nemotron_h.py sanitize)
           layer_names={r"mixer\.experts\.(\d+)\.up_proj": r"mixer.experts.\1.fc1",
                        r"mixer\.experts\.(\d+)\.down_proj": r"mixer.experts.\1.fc2"},
           sources="vLLM nemotron_h_mtp.py; SGLang nemotron_h_mtp.py; mlx-lm nemotron_h.py"),
    Family("longcat_flash", ("longcat_flash", "longcat_flash_ngram"),
           (r"^model\.mtp\.layers\.(?P<block>\d+)\.(?P<rest>.+)$",
            r"^model\.mtp\.(?P<rest>(?:norm|embed_tokens)\..+)$"),
           head_roles={"enorm.m": "pre_fc_norm_embedding", "hnorm.m": "pre_fc_norm_hidden",
                       "eh_proj": "fc", "norm": "norm", "embed_tokens": "embed_tokens"},
           shared_roles=True, layer_parts=("input_layernorm", "post_attention_layernorm",
                                           "self_attn", "mlp"),
           default_mtp_layers=1, layers_key="num_layers",
           # vLLM builds a DeepseekV2DecoderLayer without experts: LongCat's own MLA class (its
           # q/kv LoRA scaling) and dense MLP; the attention sits where the trunk layer's first
           # one does, so mlx-lm's sanitize splits its kv_b_proj as it does the trunk's.
           mtp_block=(Sublayer("self_attn.0", "LongcatFlashMLA", "input_layernorm",
                               attends=True),
                      Sublayer("mlp", "LongcatFlashMLP", "post_attention_layernorm",
                               {"is_expert": False})),
           layer_names={"self_attn": "self_attn.0", "transformer_layer.mlp": "mlp"},
           sanitize_mtp_layer=True,
           sources="vLLM longcat_flash_mtp.py; mlx-lm longcat_flash.py"),
    Family("step3p5", ("step3p5",), (_AFTER_TRUNK,), block_offset_key="num_hidden_layers",
           head_roles={**_NEXTN_ROLES, "transformer.shared_head.norm": "norm",
                       "transformer.shared_head.output": "shared_head"},
           experts_key="moe_num_experts", zero_centred_norms=True,
           next_hidden="pre_mtp_norm", mtp_layer_kind="after_trunk",
           sources="vLLM step3p5_mtp.py (docs.vllm.ai); NeMo/Megatron Step-3.5 bridge "
                   "(transformer.shared_head.{norm,output} per depth); mlx-lm step3p5.py"),
    Family("kimi_k3", ("kimi_k3", "kimi_linear"),
           (r"^(?:language_model\.)?model\.layers\.(?P<block>\d+)\.(?P<rest>.+)$",),
           block_offset_key="num_hidden_layers", head_roles=_NEXTN_ROLES,
           mtp_layer_kind="after_trunk", next_hidden="pre_mtp_norm", zero_first_embedding=True,
           # vLLM kimi_k3 mtp.py: layer N + i is a KimiDecoderLayer (MLA: N + i + 1 is no KDA
           # layer) built with attn_res_block_size None; its MoE, block_sparse_moe in the
           # checkpoint, is mlx-lm's mlp (the moves kimi_k3.py's sanitize does for trunk MoE
           # layers); the sanitize splits the MLA kv_b_proj of the layer renamed to trunk layer k
           mtp_config={"attn_res_block_size": None},
           unused_layer_parts=("self_attention_res", "mlp_res"),
           layer_names={r"block_sparse_moe\.(?:gate\.)?e_score_correction_bias":
                        "mlp.e_score_correction_bias", r"block_sparse_moe": "mlp"},
           sanitize_mtp_layer=True,
           sources="vLLM kimi_k3 nvidia/mtp.py, common/mtp.py; mlx-lm kimi_k3.py"),
    Family("mimo_v2", ("mimo_v2_flash",),
           (r"^model\.mtp\.layers\.(?P<block>\d+)\.(?P<rest>.+)$",),
           head_roles=_NEXTN_FINAL, experts_key="n_routed_experts",
           mtp_layer_args={"is_moe": False, "is_sliding_window": True},
           layer_names={"pre_mlp_layernorm": "post_attention_layernorm"},
           eps_key="layernorm_epsilon",
           sources="vLLM mimo_v2_mtp.py; SGLang mimo_v2_flash_nextn.py; mlx-lm mimo_v2_flash.py"),
    Family("bailing", ("bailing_moe",), (_AFTER_TRUNK,),
           block_offset_key="num_hidden_layers", head_roles=_NEXTN_FINAL,
           layer_parts=("input_layernorm", "attention", "post_attention_layernorm", "mlp"),
           mtp_layer_kind="after_trunk", embed_module="word_embeddings",
           layer_names=_BAILING_ROUTER,
           sources="SGLang bailing_moe_nextn.py; vLLM bailing_moe_mtp.py; mlx-lm bailing_moe.py"),
    Family("bailing_hybrid", ("bailing_hybrid",), (_AFTER_TRUNK,),
           block_offset_key="num_hidden_layers", head_roles=_NEXTN_FINAL,
           layer_parts=("input_layernorm", "attention", "post_attention_layernorm", "mlp"),
           mtp_layer_kind="after_trunk", embed_module="word_embeddings",
           # vLLM bailing_moe_mtp.py: the router bias is e_score_correction_bias in the MTP
           # layer (mlx-lm's expert_bias), the embedding zeroed at position 0; mlx-lm's
           # sanitize splits the MLA's kv_b_proj
           layer_names={**_BAILING_ROUTER,
                        "mlp.gate.e_score_correction_bias": "mlp.gate.expert_bias"},
           sanitize_mtp_layer=True, zero_first_embedding=True,
           sources="vLLM bailing_moe_mtp.py (BailingMoeV25MTPModel); mlx-lm bailing_hybrid.py"),
    Family("minimax_m3", ("minimax_m3_vl", "minimax_m3_vl_text"),
           (r"^(?:language_model\.)?model\.mtp\.layers\.(?P<block>\d+)\.(?P<rest>.+)$",),
           head_roles=_NEXTN_FINAL, experts_key="num_local_experts",
           layer_parts=("input_layernorm", "post_attention_layernorm", "self_attn",
                        "block_sparse_moe"),
           mtp_layer_kind="after_trunk", next_hidden="pre_mtp_norm", zero_first_embedding=True,
           # vLLM minimax_m3 mtp.py: transformer_layer is a MiniMaxM3DecoderLayer with
           # force_sparse_attn and force_moe, its norms and the head's Gemma-style (1 + w)
           mtp_config={"layer_types": None, "sparse_attention_freq": None,
                       "mlp_layer_types": None, "moe_layer_freq": None},
           norm_class="GemmaRMSNorm",
           layer_names={r"transformer_layer\.(\w+)": r"\1"},
           unbatchable="its sparse attention picks key blocks by cache slot, so a row's left "
                       "padding in a batch changes which keys it keeps",
           sources="vLLM minimax_m3 nvidia/mtp.py, nvidia/model.py; mlx-lm minimax_m3_vl.py"),
    Family("llama", ("llama", "mistral", "smollm3"), shape_rules=PLAIN_ATTENTION_RULES),
)
GENERIC = Family("generic", ())


def family_for(model_type: str | None) -> Family:
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    return GENERIC


def _canonical_from_block(rest: str, block: int, fam: Family) -> str:
    for source, role in sorted(fam.head_roles.items(), key=lambda kv: -len(kv[0])):
        if rest == source or rest.startswith(source + "."):
            scope = "mtp." if block == 0 or fam.shared_roles else f"mtp.heads.{block}."
            return scope + role + rest[len(source):]
    for source in sorted(fam.layer_names, key=len, reverse=True):
        m = re.match(rf"(?:{source})(?=\.|$)", rest)
        if m:
            rest = m.expand(fam.layer_names[source]) + rest[m.end():]
            break
    return f"mtp.layers.{block}.{rest}"


def _family_match(name: str, fam: Family) -> tuple[str, int] | None:
    """(rest, block) from the first of the family's patterns that matches."""
    for pattern in fam.mtp_patterns:
        m = re.match(pattern, name)
        if m:
            groups = m.groupdict()
            rest = m["rest"] + (f".{groups['param']}" if groups.get("param") else "")
            return rest, int(groups.get("block") or 0)
    return None


def canonical_mtp_name(name: str, fam: Family, config: dict[str, Any]) -> str | None:
    """The canonical `mtp.` name of tensor `name`, or None when it is not part of an MTP head.
    The family's own names come first: several (Nemotron-H, LongCat, MiMo-V2) start with
    `mtp.` or `model.mtp.` and would otherwise read as canonical names."""
    hit = _family_match(name, fam)
    if hit is None:
        canonical = re.match(CANONICAL_PATTERN, name)
        return "mtp." + canonical["rest"] if canonical else None
    rest, block = hit
    if fam.block_offset_key:
        offset = config.get(fam.block_offset_key)
        if not isinstance(offset, int) or block < offset:
            return None
        block -= offset
    return _canonical_from_block(rest, block, fam)


# MoE expert layouts, family-independent: (layout, pattern over a tensor name).
EXPERT_LAYOUTS: tuple[tuple[str, str], ...] = (
    ("numbered", r"^(?P<moe>.+)\.experts\.(?P<expert>\d+)\."
                 r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3|fc1|fc2)"
                 r"\.(?P<param>weight|scales|biases)$"),
    ("fused", r"^(?P<moe>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)"
              r"(?:\.(?P<param>weight|scales|biases))?$"),
    ("stacked", r"^(?P<moe>.+)\.switch_mlp\.(?P<proj>gate_proj|up_proj|down_proj|fc1|fc2)"
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


# Attributes under which mlx-lm's decoder layers hold a recurrent (non-trimmable) mixer, with
# the layer attribute and value that say the mixer there is the recurrent one (None: always):
# Qwen's linear_attn; Kimi-K3's KDA under self_attn (is_linear); Nemotron-H's Mamba under mixer
# (block_type "M"); Ling 2.5's lightning attention under attention (is_global False, its call
# taking the rope offset). decoder/cache/recording.py records them so a batch commits each row's kept
# positions (a mixer it does not record keeps a batch's rejected drafts in its state).
RECURRENT_ATTRIBUTES: dict[str, tuple[str, Any] | None] = {
    "linear_attn": None, "self_attn": ("is_linear", True), "mixer": ("block_type", "M"),
    "attention": ("is_global", False)}
# Attributes by which mlx-lm's decoder layers say their kind (recurrent, sliding-window, MLA
# among linear layers), which decides the cache mlx-lm's model makes for them: an MTP layer's
# cache is the one made for the trunk layers that agree with it on these (decoder/model/trunk.py).
LAYER_KIND_ATTRIBUTES = ("is_linear", "is_sliding", "is_sliding_window", "is_global")
# mlx-lm model types whose attention applies its mask with mx.where, so a traced pass must give
# them a bool mask (the rest add it): decoder/model/traced.py.
SELECTING_MASK = frozenset({"bailing_hybrid", "bailing_moe_v3", "deepseek_v3", "deepseek_v32",
                            "gemma2", "glm4_moe_lite", "kimi_k3", "kimi_linear", "longcat_flash",
                            "mistral4"})
# mlx-lm model types whose shard() repeats KV heads when the ranks outnumber them (Qwen3.5):
# decoder/sharded/sharding.py.
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


# The final norm of a multi-block head's later blocks (Step-3.5's per-depth shared_head.norm).
_BLOCK_FINAL_NORM = re.compile(r"(?:^|\.)mtp\.heads\.\d+\.norm\.weight$")


def norm_role(name: str) -> str | None:
    """The role of a zero-centred-by-convention RMSNorm gain, or None for any other tensor."""
    if _BLOCK_FINAL_NORM.search(name):
        return "final_norm"
    return next((r for suffix, r in NORM_ROLES.items() if name.endswith(suffix)), None)


def is_shifted_norm(name: str) -> bool:
    return norm_role(name) is not None


def _attn_out(c: dict[str, Any], path: str) -> int | None:
    heads, per_head = c.get("num_attention_heads"), c.get("v_head_dim") or c.get("head_dim")
    other = c.get("attention_other_setting")
    if isinstance(other, dict) and _layer_type(c, path) == other.get("attention_type"):
        # Step-3.5: layers of this type take their own head count (vLLM step3p5.py)
        heads, per_head = other.get("num_attention_heads", heads), other.get("head_dim", per_head)
    if per_head is None and heads and c.get("hidden_size"):
        per_head = c["hidden_size"] // heads
    return heads * per_head if heads and per_head else None


def _layer_type(c: dict[str, Any], path: str) -> str | None:
    """The config's layer_types entry of the layer at `path`: trunk layer i, or MTP block k,
    which per-layer lists number after the trunk's (Step-3.5's cover 45 + 3 layers)."""
    m = re.search(r"(?:^|\.)(mtp\.)?layers\.(\d+)\.", path)
    types, n = c.get("layer_types"), c.get("num_hidden_layers")
    if m is None or not isinstance(types, list) or not isinstance(n, int):
        return None
    index = int(m[2]) + (n if m[1] else 0)
    return types[index] if index < len(types) else None


def _product(*keys: str) -> Callable[[dict[str, Any], str], int | None]:
    def get(c: dict[str, Any], _path: str = "") -> int | None:
        values = [c.get(k) for k in keys]
        if all(isinstance(v, int) for v in values):
            out = 1
            for v in values:
                out *= v
            return out
        return None
    return get


# Input width of a linear, by module path: first matching rule wins; a function of the flat
# config and the module's path. A string value names a sibling module whose output rows equal
# this module's input (GLU down_proj <- up_proj).
IN_FEATURES_RULES: tuple[tuple[str, Callable[[dict[str, Any], str], int | None] | str], ...] = (
    (r"(?:^|\.)(?:fc|eh_proj|input_proj)$", lambda c, _path: 2 * c["hidden_size"]),
    (r"\.down_proj$", "up_proj"),
    (r"\.w2$", "w3"),
    (r"\.fc2$", "fc1"),  # Nemotron-H's stacked non-gated experts (mlx-lm's names)
    (r"\.(?:self_attn(?:\.\d+)?|mixer)\.o_proj$|\.attention\.dense$", _attn_out),
    (r"\.mixer\.out_proj$", _product("mamba_num_heads", "mamba_head_dim")),
    (r"\.linear_attn\.out_proj$", _product("linear_num_value_heads", "linear_value_head_dim")),
    (r"\.q_b_proj$", _product("q_lora_rank")),
    (r"\.(?:kv_b_proj|unembed_out)$", _product("kv_lora_rank")),
    (r"\.embed_q$", _product("qk_nope_head_dim")),
    (r".", _product("hidden_size")),
)
