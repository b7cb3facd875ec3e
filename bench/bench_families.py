"""MTP mechanics per family on a GPU: c(T) and oracle decoding at each family's real dimensions.

A MECHANICS benchmark, bench_gpu.py's for every family of loaders/families.py whose MTP head the
decoder runs: for each, a trunk of random weights built through mlx-lm's own model class from
a config at the published checkpoint's per-layer dimensions (hidden size, heads, KV heads or MLA
ranks, expert widths, vocabulary) but only --layers layers that keep the family's layer pattern
(a hybrid's linear / full mix, dense and MoE layers), 4-bit g64 as bench_gpu's q4 trunk
(bench_gpu.oracle_ready: its greedy continuation a walk rounding cannot flip; MoE routers,
which mlx-lm quantizes at 8 bits, stay bf16), and the family's MTP head at the same dimensions
(decoder/model/head.py's MTPHead, random weights, its layers 4-bit), with the linears `mtpkit.load`
gives the backend. The configs are tests/fixtures/configs.py's family configs with the
dimensions replaced (SPECS says which checkpoint, and what of it is assumed rather than read
from its config); --small keeps the fixtures' own (tiny: a CPU smoke run). A family whose
estimated build peak passes --max-gb has its routed experts halved until it fits (--experts
caps them all), said in its row: a round's rows then share more experts than the real model's.

Per family:
1. c(T), T = 1..4, the plain step and the head's draft step (decoder/tuning/costs.py's measure at a
   --context-token cache, medians after warm-up, in about --budget seconds), as `mtpkit.load`
   runs this backend (traced on a GPU) and, with --arms both, the other way too.
2. Oracle decoding (bench_gpu's Oracle: right with per-position acceptance 73/48/32%, free;
   `auto` priced by the real head's curve): depth 0, 3 and auto for --tokens tokens after a
   --prompt-token prompt, --runs runs with the arms interleaved: tok/s medians and spread; the
   measured depth-3 / plain ratio beside the ideal one from c(T): E[tokens per round] /
   (c(4) / plain step) (and with the real head's three draft steps added to c(4)).

Names the table or issue 51 holds that are not run (no mlx-lm class of their own, a drafter
that is no MTP head, a build too large for --max-gb, past --time-limit) are listed as skipped
with the reason. Progress on stderr, a line per family with an ETA; one JSON (common.save) after
every family, so a run cut short keeps what it measured.

    python bench/bench_families.py [--families a,b] [--layers 4] [--experts N] [--tokens 128]
        [--runs 3] [--max-gb 80] [--time-limit S] [--arms both|default] [--small] [--estimate]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import common  # noqa: E402
from bench_gpu import RATES, SUCCESSOR, Oracle, oracle_ready, quantizable  # noqa: E402
from common import summary  # noqa: E402

from fixtures.configs import config_for  # noqa: E402
from mtpkit.loaders.families import FAMILIES, family_for  # noqa: E402
from mtpkit.verify.run import mean_by_position  # noqa: E402

T_MAX = 4  # c(T) reported for T = 1..T_MAX (a depth-3 round verifies 4 rows)
DEPTHS = (0, 3, "auto")
GB = 2**30
_MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _mla(q: int, kv: int, nope: int, rope: int, v: int) -> dict[str, int]:
    return dict(zip(_MLA, (q, kv, nope, rope, v), strict=True))


def _qwen_rope(theta: float) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}}


_QWEN_LINEAR = {"linear_num_key_heads": 16, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "head_dim": 256, "full_attention_interval": 4}
_DSV3 = {"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
         **_mla(1536, 512, 128, 64, 128), "intermediate_size": 18432,
         "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
         "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
         "vocab_size": 129280}


def _first_dense(n: int) -> dict[str, Any]:
    """One dense layer, then MoE (the published trunks open with 1-3 dense layers)."""
    return {"first_k_dense_replace": 1}


def _step3p5(n: int) -> dict[str, Any]:
    """Three sliding-window layers to one full (the trunk's 3:1), each kind with its head
    counts and RoPE, dense first then MoE; per-layer lists over the trunk and 3 MTP depths."""
    kinds = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)]
    kinds += ["sliding_attention"] * 3
    return {"layer_types": kinds, "num_nextn_predict_layers": 3,
            "partial_rotary_factors": [0.5 if k == "full_attention" else 1.0 for k in kinds],
            "rope_theta": [5000000.0 if k == "full_attention" else 10000.0 for k in kinds],
            "moe_layers_enum": ",".join(str(i) for i in range(1, n))}


@dataclass(frozen=True)
class Spec:
    """A family's benchmark trunk: the fixture config it starts from, the published checkpoint
    whose per-layer dimensions replace the fixture's, the layer pattern at `n` layers, and
    what of it is not read from a published config (`assumed`)."""

    fixture: str
    checkpoint: str
    dims: dict[str, Any]
    pattern: Any = None  # n -> config values that lay out n layers
    assumed: str = ""
    layers_key: str = "num_hidden_layers"


SPECS: dict[str, Spec] = {
    "qwen3_5": Spec("qwen3_5", "Qwen3.5-9B", {
        "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 16,
        "num_key_value_heads": 4, "linear_num_value_heads": 32, "vocab_size": 248320,
        **_QWEN_LINEAR, **_qwen_rope(10000000.0)}),
    "qwen3_5_moe": Spec("qwen3_5_moe", "Qwen3.5-397B-A17B", {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 2,
        "linear_num_value_heads": 64, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
        "intermediate_size": 1024, "vocab_size": 248320, **_QWEN_LINEAR,
        **_qwen_rope(10000000.0)}),
    "qwen3_next": Spec("qwen3_next", "Qwen3-Next-80B-A3B", {
        "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
        "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "intermediate_size": 5120, "vocab_size": 151936, **_QWEN_LINEAR}),
    "deepseek_v3": Spec("deepseek_v3", "DeepSeek-V3", _DSV3, _first_dense),
    "deepseek_v32": Spec("deepseek_v32", "DeepSeek-V3.2-Exp", {
        **_DSV3, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}, _first_dense),
    "glm_moe_dsa": Spec("glm_moe_dsa", "GLM-5", {
        "hidden_size": 6144, "num_attention_heads": 64, "num_key_value_heads": 64,
        **_mla(2048, 512, 192, 64, 256), "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "index_n_heads": 32,
        "index_head_dim": 128, "index_topk": 2048, "vocab_size": 154880}, _first_dense),
    "glm4_moe": Spec("glm4_moe", "GLM-4.5", {
        "hidden_size": 5120, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "n_routed_experts": 160, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "vocab_size": 151552, "num_nextn_predict_layers": 1},
        _first_dense),
    "glm4_moe_lite": Spec("glm4_moe_lite", "GLM-4.7-Flash", {
        "hidden_size": 2048, "num_attention_heads": 20, "num_key_value_heads": 20,
        **_mla(768, 512, 192, 64, 256), "intermediate_size": 10240,
        "moe_intermediate_size": 1536, "n_routed_experts": 64, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "vocab_size": 154880}, _first_dense,
        assumed="dimensions as recalled, not read from its config.json here"),
    "mimo": Spec("mimo", "MiMo-7B", {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 11008, "vocab_size": 151680}),
    "ernie4_5_moe": Spec("ernie4_5_moe", "ERNIE-4.5-300B-A47B", {
        "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 28672, "moe_num_experts": 64, "moe_k": 8,
        "moe_intermediate_size": 3584, "vocab_size": 103424},
        lambda n: {"moe_layer_start_index": 1, "moe_layer_end_index": n - 1}),
    "nemotron_h": Spec("nemotron_h", "NVIDIA-Nemotron-3-Nano-30B-A3B", {
        "hidden_size": 2688, "num_attention_heads": 32, "num_key_value_heads": 2,
        "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128,
        "n_groups": 8, "intermediate_size": 1856, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "n_routed_experts": 128,
        "num_experts_per_tok": 6, "vocab_size": 131072},
        lambda n: {"hybrid_override_pattern": ("ME*E" * n)[:n]},
        assumed="Nano's dimensions: Super's (LatentMoE) config was not read here"),
    "longcat_flash": Spec("longcat_flash", "LongCat-Flash-Chat", {
        "hidden_size": 6144, "num_attention_heads": 64, **_mla(1536, 512, 128, 64, 128),
        "ffn_hidden_size": 12288, "expert_ffn_hidden_size": 2048, "n_routed_experts": 512,
        "zero_expert_num": 256, "moe_topk": 12, "routed_scaling_factor": 6.0,
        "vocab_size": 131072}, layers_key="num_layers",
        assumed="dimensions as recalled, not read from its config.json here"),
    "step3p5": Spec("step3p5", "Step-3.5-Flash", {
        "hidden_size": 4096, "num_attention_heads": 64, "num_attention_groups": 8,
        "head_dim": 128, "intermediate_size": 11264, "moe_num_experts": 288, "moe_top_k": 8,
        "moe_intermediate_size": 1280, "share_expert_dim": 1280, "vocab_size": 128896,
        "sliding_window": 512,
        "attention_other_setting": {"attention_type": "sliding_attention",
                                    "num_attention_heads": 96, "num_attention_groups": 8,
                                    "head_dim": 128}}, _step3p5),
    "kimi_k3": Spec("kimi_k3", "Kimi-K3", {
        "hidden_size": 7168, "num_attention_heads": 96, "num_key_value_heads": 96,
        "intermediate_size": 33792, "vocab_size": 163840, **_mla(1536, 512, 128, 64, 128),
        "num_experts": 384, "num_experts_per_token": 16, "moe_intermediate_size": 2048,
        "routed_expert_hidden_size": 3584},
        lambda n: {"first_k_dense_replace": 1, "attn_res_block_size": 2,
                   "linear_attn_config": {
                       "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                       "use_full_rank_gate": True, "gate_lower_bound": -5.0,
                       "kda_layers": [i + 1 for i in range(n) if i % 4 != 3],
                       "full_attn_layers": [i + 1 for i in range(n) if i % 4 == 3]}},
        assumed="hidden, heads, dense width, vocabulary: mlx-lm's kimi_k3 defaults; MLA ranks, "
                "experts, latent width and KDA heads assumed (Kimi-K2-like)"),
    "mimo_v2_flash": Spec("mimo_v2_flash", "MiMo-V2-Flash", {
        "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 4,
        "head_dim": 192, "v_head_dim": 128, "swa_num_attention_heads": 64,
        "swa_num_key_value_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128,
        "intermediate_size": 16384, "moe_intermediate_size": 2048, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "partial_rotary_factor": 0.334, "vocab_size": 152576},
        lambda n: {"hybrid_layer_pattern": [0 if i % 6 == 0 else 1 for i in range(n)],
                   "moe_layer_freq": [0] + [1] * (n - 1)}),
    "bailing_moe": Spec("bailing_moe", "Ling-flash-2.0", {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 9216, "moe_intermediate_size": 1024,
        "num_experts": 256, "num_experts_per_tok": 8, "vocab_size": 157184}, _first_dense),
    "bailing_hybrid": Spec("bailing_hybrid", "Ling-2.5", {
        "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 128, **_mla(1536, 512, 128, 64, 128), "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_experts": 256, "num_experts_per_tok": 8,
        "vocab_size": 157184}, lambda n: {"first_k_dense_replace": 1, "layer_group_size": 4},
        assumed="Ling-flash-2.0's widths with DeepSeek-V3's MLA ranks; an MLA layer every 4th"),
    "minimax_m3_vl": Spec("minimax_m3_vl", "MiniMax-M3", {
        "hidden_size": 6144, "intermediate_size": 3072, "dense_intermediate_size": 12288,
        "shared_intermediate_size": 3072, "num_attention_heads": 64, "num_key_value_heads": 4,
        "head_dim": 128, "rotary_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
        "vocab_size": 200064},
        lambda n: {"moe_layer_freq": [0] + [1] * (n - 1), "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": 128, "sparse_num_index_heads": 4,
            "sparse_topk_blocks": 16, "sparse_block_size": 64, "sparse_local_block": 1,
            "sparse_init_block": 0, "sparse_score_type": "max",
            "sparse_attention_freq": [0] + [1] * (n - 1),
            "sparse_disable_index_value": [0] + [1] * (n - 1)}},
        assumed="mlx-lm's minimax_m3_vl defaults; sparse-attention widths assumed"),
}
# Named in issue 51 or the family table, and not benchmarked here: why (never dropped silently).
NOT_RUN = {
    "kimi_k2": "mlx-lm runs it as deepseek_v3 (MODEL_REMAPPING): deepseek_v3's row stands for it",
    "qwen3_6": "no mlx-lm 0.32.2 class of its own: qwen3_5's row stands for it",
    "qwen3_6_moe": "no mlx-lm 0.32.2 class of its own: qwen3_5_moe's row stands for it",
    "longcat_flash_ngram": "longcat_flash's layers (n-gram embedding aside): its row stands for it",
    "deepseek_v41": "ships DSpark stages under mtp.*, no MTP head (vLLM); not in the family table",
    "hunyuan": "mlx-lm's hunyuan is the older HunYuan MoE without MTP; HY-V3/V4 (with MTP) have "
               "no mlx-lm 0.32.2 class and no table row",
    "gemma4": "drafts with a separate assistant checkpoint (decoder/drafters/assistant.py), not an MTP head",
    "llama": "the table's llama row has no MTP head",
}
# The families issue 51 added to the table: run first (a --time-limit cuts the older ones).
ISSUE_51 = ("glm_moe_dsa", "deepseek_v32", "nemotron_h", "longcat_flash", "step3p5", "kimi_k3",
            "mimo_v2_flash", "ernie4_5_moe", "bailing_moe", "bailing_hybrid", "minimax_m3_vl")
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "moe_num_experts", "num_local_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_k", "moe_top_k", "moe_topk", "num_experts_per_token")


def config(name: str, layers: int, experts: int | None, small: bool, vocab: int | None = None
           ) -> tuple[dict, dict]:
    """(the family's config.json, what it changed of the published one): the fixture config
    with the published dimensions (small: the fixture's own), `layers` trunk layers laid out as
    the family lays them, routed experts capped at `experts`, an lm_head of its own (the
    oracle's walk needs one); `vocab` caps the vocabulary (a CPU check of the real widths)."""
    spec = SPECS[name]
    out = config_for(spec.fixture)
    text = out.get("text_config", out)
    notes: dict[str, Any] = {}
    if not small:
        text.update(copy.deepcopy(spec.dims))
        text[spec.layers_key] = layers
        if spec.pattern is not None:
            text.update(spec.pattern(layers))
    for key in _EXPERT_KEYS:
        if experts is not None and isinstance(text.get(key), int) and text[key] > experts:
            notes["experts_capped"] = f"{text[key]} -> {experts}"
            text[key] = experts
            for k in _TOPK_KEYS:
                if isinstance(text.get(k), int):
                    text[k] = min(text[k], experts)
            groups = max(1, text.get("n_group") or 1)
            if experts % groups or experts // groups < 2:  # (group scores sum a group's top 2)
                text["n_group"] = text["topk_group"] = 1
    if vocab is not None and text["vocab_size"] > vocab:
        notes["vocab_capped"] = f"vocabulary {text['vocab_size']} -> {vocab}"
        text["vocab_size"] = vocab
    for cfg in (out, text):
        if cfg.get("tie_word_embeddings"):
            notes["untied"] = "tie_word_embeddings false (the oracle's walk needs an lm_head)"
            cfg["tie_word_embeddings"] = False
    return out, notes


def model_classes(cfg: dict) -> tuple[Any, Any]:
    from mlx_lm.utils import _get_classes

    return _get_classes(cfg)


def build_trunk(cfg: dict, bits: int):
    """mlx-lm's model of `cfg`, random weights as bench_gpu's oracle trunk (4-bit g64)."""
    cls, args_cls = model_classes(cfg)
    return oracle_ready(cls, args_cls.from_dict(cfg), bits)


def head_names(trunk, family) -> list[str]:
    """Parameter names that tell MTPHead how many physical layers the head has and, for a
    pattern head (Nemotron-H's "*E"), each layer's kind: one layer, else one per character."""
    if family.mtp_pattern is None:
        return ["layers.0."]
    _, by_module, _ = family.mtp_pattern
    module_of = {kind: module for module, kind in by_module.items()}
    pattern = getattr(trunk.args, "mtp_hybrid_override_pattern", None) or "*E"
    return [f"layers.{j}.{module_of[c]}.weight" for j, c in enumerate(pattern)]


def build_head(trunk, family, bits: int):
    """The family's MTP head at the trunk's dimensions (decoder/model/head.py, one draft block of the
    trunk's own class as the family builds it), random bf16 weights, its layers quantized g64
    as convert quantizes a sidecar's layers (fc and norms float)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mtpkit.decoder.model.head import Contract, MTPHead, _layers

    kind = family.mtp_layer_kind
    _, layers, _, _ = _layers(trunk, family, kind, head_names(trunk, family))
    h = trunk.args.hidden_size
    weights = {f"mtp.layers.{j}.{k}": v for j, layer in enumerate(layers)
               for k, v in tree_flatten(layer.parameters())}
    weights["mtp.fc.weight"] = mx.random.normal((h, 2 * h)) * (2 * h) ** -0.5
    for role in family.required_roles:
        if role != "fc":
            weights[f"mtp.{role}.weight"] = mx.ones((h,))
    contract = Contract(family.hidden_feed, family.next_hidden, family.concat_order,
                        family.zero_first_embedding)
    head = MTPHead(trunk, weights, contract, kind, {})
    head.set_dtype(mx.bfloat16)
    trunk_picks = quantizable(trunk.model)
    nn.quantize(head, group_size=64, bits=bits, class_predicate=lambda path, module: (
        path.startswith("layers.") and trunk_picks(path, module)))
    for _, module in tree_flatten(head.leaf_modules(), is_leaf=nn.Module.is_module):
        mx.eval(module.parameters())
    return head


def fast_linears(trunk, head) -> None:
    """The linears `mtpkit.load` gives this backend: the verify kernel's twins on CUDA, the
    few-row linears on a CPU."""
    import mlx.core as mx

    from mtpkit.decoder.model import kernels
    from mtpkit.decoder.model.rows import use_few_rows_linears, use_kernel_linears

    if mx.default_device().type == mx.DeviceType.cpu:
        use_few_rows_linears(trunk.inner)
        use_few_rows_linears(head)
    elif kernels.cuda_available():
        use_kernel_linears(trunk.text)
        use_kernel_linears(head)


# --- memory estimate (no weights materialized: mlx-lm's constructors draw lazily) ---


def _bytes(module, bits: int, picks) -> float:
    """Bytes of `module` once built as bench_gpu builds it: what `picks` quantizes at `bits`
    plus a bf16 scale and bias per 64 weights, the rest bf16."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    total = 0.0
    for path, leaf in tree_flatten(module.leaf_modules(), is_leaf=nn.Module.is_module):
        quantized = picks(path, leaf)
        for name, value in tree_flatten(leaf.parameters()):
            total += value.size * ((bits / 8 + 4 / 64) if quantized and name == "weight" else 2)
    return total


def estimate(cfg: dict, bits: int) -> dict[str, float]:
    """GB a family's trunk and head take at 4-bit, and the build's peak (the largest weight
    drawn in float32 and cast to bf16 before it is quantized), from the lazily built model."""
    from mlx.utils import tree_flatten

    from mtpkit.decoder.model.trunk import parts

    cls, args_cls = model_classes(cfg)
    model = cls(args_cls.from_dict(cfg))
    picks = quantizable(model)
    text, inner_name, _ = parts(model)
    inner = getattr(text, inner_name)
    layers = [_bytes(layer, bits, picks) for layer in inner.layers]
    trunk = _bytes(model, bits, picks)
    largest = max(v.size for _, v in tree_flatten(model.parameters()))
    head = max(layers) + 2 * cfg.get("text_config", cfg)["hidden_size"] ** 2 * 2
    del model, inner, text  # (nothing was drawn: no array above was evaluated)
    gc.collect()
    return {"trunk_gb": trunk / GB, "head_gb": head / GB, "largest_layer_gb": max(layers) / GB,
            "build_peak_gb": (trunk + head + 6 * largest) / GB}


# --- the measurements ---


def curve_row(curve) -> dict[str, Any]:
    return {"c_ms": [1000 * c for c in curve.verify[:T_MAX]], "plain_ms": 1000 * curve.plain,
            "draft_ms": 1000 * curve.draft,
            "ratios": [c / curve.verify[0] for c in curve.verify[:T_MAX]]}


def decode_arms(mtp, prompt: list[int], tokens: int, runs: int, ref: list[int]) -> dict:
    """Depth 0, 3 and auto on the oracle runner, warmed up, then `runs` runs with the arms
    interleaved (the machine's drift hits each alike)."""
    import numpy as np

    for depth in DEPTHS:
        mtp.generate(prompt, tokens, depth=depth)
    got: dict = {depth: [] for depth in DEPTHS}
    for run in range(runs):
        for depth in DEPTHS:
            mtp.head.rng = np.random.default_rng(run)
            got[depth].append(mtp.generate(prompt, tokens, depth=depth))
    rows: dict = {}
    for depth, results in got.items():
        tps = [r.stats.decode_tps for r in results]
        rows[str(depth)] = {"tps": summary(tps),
                            "spread": max(tps) / min(tps) if min(tps) > 0 else None,
                            "identical": all(r.tokens == ref for r in results)}
        if depth != 0:
            rows[str(depth)]["paired"] = statistics.median(
                t / p.stats.decode_tps for t, p in zip(tps, got[0], strict=True))
            rows[str(depth)]["acceptance"] = mean_by_position(
                [r.stats.acceptance_by_depth for r in results])
        if depth == "auto":
            rows["auto"]["depths"] = results[-1].stats.depths
    return rows


def bench_family(name: str, args, cap: int | None, log) -> dict[str, Any]:
    """Build one family's trunk and head, measure c(T) both ways and decode with the oracle."""
    import mlx.core as mx

    from mtpkit.decoder.cache.shapes import bounded_by_default
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.runner import Runner
    from mtpkit.decoder.tuning.costs import measure

    cfg, notes = config(name, args.layers, cap, args.small, args.vocab)
    text_cfg = cfg.get("text_config", cfg)
    family = family_for(cfg["model_type"])
    began = time.perf_counter()
    model = build_trunk(cfg, 4)
    trunk = Trunk(model, family.hidden_feed)
    head = build_head(trunk, family, 4)
    fast_linears(trunk, head)
    built = time.perf_counter() - began
    log(f"built in {built:.1f} s, {mx.get_active_memory() / GB:.1f} GB active")
    vocab = trunk.args.vocab_size
    prompt = [(13 * i + 7) % vocab for i in range(args.prompt)]
    default = bounded_by_default()  # traced where `mtpkit.load` traces (a GPU)
    arm = {True: "traced", False: "untraced"}
    trunk.use_traced(default)
    real = Runner(trunk, head, None)
    plain = real.generate(prompt, args.tokens, depth=0)
    walk = [int(t) for t in [prompt[-1], *plain.tokens]]
    successor = SUCCESSOR.pop(id(model))
    follows = sum(int(successor[a].item()) == b for a, b in zip(walk, walk[1:], strict=False))
    log(f"reference decoded ({time.perf_counter() - began:.0f} s in)")
    at = {"budget_s": args.budget, "longer": [], "context": args.context}
    curves = {arm[default]: measure(real, **at)}
    if args.arms == "both":  # the other arm too (on a CPU the traced one compiles per width)
        trunk.use_traced(not default)
        curves[arm[not default]] = measure(real, **at)
        trunk.use_traced(default)
    log(f"c(T) {', '.join(curves)} ({time.perf_counter() - began:.0f} s in)")
    first = curves[arm[default]]
    mtp = Runner(trunk, Oracle(prompt + plain.tokens, vocab, RATES, seed=0), None)
    mtp._costs = first  # auto priced as with the real head (the oracle's drafts cost ~nothing)
    arms = decode_arms(mtp, prompt, args.tokens, args.runs, plain.tokens)
    expected = 1 + sum(RATES[:3])
    c4, step = first.verify[T_MAX - 1], first.plain
    ratio = arms["3"]["tps"]["median"] / arms["0"]["tps"]["median"]
    log(f"c(1..4) {[round(1000 * c, 2) for c in first.verify[:T_MAX]]} ms, plain "
        f"{1000 * step:.2f} ms; d0 {arms['0']['tps']['median']:.1f} tok/s, d3/d0 {ratio:.2f} "
        f"(ideal {expected / (c4 / step):.2f}), auto {arms['auto']['tps']['median']:.1f} tok/s "
        f"({time.perf_counter() - began:.0f} s)")
    return {"checkpoint": SPECS[name].checkpoint, "family": family.name,
            "model_type": cfg["model_type"], "layers": text_cfg.get(SPECS[name].layers_key),
            "assumed": SPECS[name].assumed, "notes": notes,
            "config": {k: v for k, v in text_cfg.items() if not isinstance(v, dict | list)},
            "build_s": built, "greedy_walk_kept": follows / max(1, len(walk) - 1),
            "arm": arm[default], "curves": {k: curve_row(v) for k, v in curves.items()},
            "head_draft_ms": 1000 * first.draft, "oracle": arms,
            "d3_over_plain": ratio,
            "d3_over_plain_ideal": expected / (c4 / step),
            "d3_over_plain_ideal_real_head": expected / ((c4 + 3 * first.draft) / step),
            "peak_gb": mx.get_peak_memory() / GB, "seconds": time.perf_counter() - began}


def table(rows: dict[str, dict], skipped: dict[str, str]) -> str:
    """One line a family: c(1..4) and the plain step in the backend's default arm (traced on
    a GPU; the other arm's c(4) beside it), the real head's draft step, oracle tok/s at depth
    0, 3 and auto, the measured d3 / d0 ratio and the ideal one from c(T), the d3 acceptance
    per position, how much of the greedy walk held, peak GB."""
    head = (f"{'family':15} {'arm':4} {'c(1..4) ms':23} {'c4 alt':>6} {'plain':>6} "
            f"{'draft':>6} {'d0 tok/s':>8} {'d3 tok/s':>8} {'auto':>7} {'d3/d0':>5} "
            f"{'ideal':>5} {'acc d3':>14} {'walk':>4} {'GB':>5}")
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"{name:15} FAILED: {r['error']}")
            continue
        o, main = r["oracle"], r["curves"][r["arm"]]
        other = [c["c_ms"][-1] for k, c in r["curves"].items() if k != r["arm"]]
        acc = "/".join(f"{a:.2f}" for a in o["3"]["acceptance"])
        lines.append(
            f"{name:15} {r['arm'][:4]:4} {' '.join(f'{c:5.2f}' for c in main['c_ms']):23} "
            f"{other[0] if other else float('nan'):6.2f} {main['plain_ms']:6.2f} "
            f"{r['head_draft_ms']:6.2f} {o['0']['tps']['median']:8.1f} "
            f"{o['3']['tps']['median']:8.1f} {o['auto']['tps']['median']:7.1f} "
            f"{r['d3_over_plain']:5.2f} {r['d3_over_plain_ideal']:5.2f} {acc:>14} "
            f"{r['greedy_walk_kept']:4.2f} {r['peak_gb']:5.1f}"
            + (f"  [{'; '.join(r['notes'].values())}]" if r["notes"] else ""))
    lines += [f"{name:15} skipped: {why}" for name, why in skipped.items()]
    return "\n".join(lines)


def runnable() -> tuple[list[str], dict[str, str]]:
    """The SPECS of the table's families whose head the decoder runs, in table order, and why
    each other name the table or issue 51 holds is not run."""
    skipped = dict(NOT_RUN)
    names: list[str] = []
    for fam in FAMILIES:
        ours = [t for t in fam.model_types if t in SPECS]
        for t in fam.model_types:
            if fam.unsupported:
                skipped[t] = f"the decoder cannot run its head: {fam.unsupported}"
            elif t in SPECS:
                names.append(t)
            elif t not in skipped:
                skipped[t] = (f"runs the class of {ours[0]}, whose row stands for it" if ours
                              else "no MTP head in the family table")
    return names, skipped


def fitted(name: str, args) -> tuple[int | None, dict[str, float]]:
    """(the routed-experts cap the family runs with, its memory estimate): --experts, and below
    it the family's experts halved until the build's estimated peak fits --max-gb."""
    cap = args.experts
    while True:
        cfg, _ = config(name, args.layers, cap, args.small, args.vocab)
        est = estimate(cfg, 4)
        text = cfg.get("text_config", cfg)
        experts = max((text[k] for k in _EXPERT_KEYS if isinstance(text.get(k), int)), default=0)
        if est["build_peak_gb"] <= args.max_gb or experts <= 8:
            return cap, {**est, "experts": experts}
        cap = experts // 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", help="comma list (default: every runnable family)")
    ap.add_argument("--layers", type=int, default=4, help="trunk layers (the pattern kept)")
    ap.add_argument("--experts", type=int, help="cap every family's routed experts at N")
    ap.add_argument("--max-gb", type=float, default=80.0,
                    help="a family whose estimated build peak exceeds this has its experts "
                         "halved until it fits (said in the output)")
    ap.add_argument("--time-limit", type=float,
                    help="seconds: start no family past this (the rest listed as not run)")
    ap.add_argument("--vocab", type=int, help="cap the vocabulary (a CPU check of real widths)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--context", type=int, default=512,
                    help="the cache length c(T) is measured at (decoder/tuning/curve.py's CONTEXT)")
    ap.add_argument("--budget", type=float, default=2.0,
                    help="seconds per c(T) measurement (decoder/tuning/costs.py's budget)")
    ap.add_argument("--arms", choices=["both", "default"], default="both",
                    help="c(T) traced and untraced, or only as `mtpkit.load` runs this backend "
                         "(traced on a GPU); --small: default")
    ap.add_argument("--small", action="store_true",
                    help="the fixtures' tiny dimensions (a CPU smoke run)")
    ap.add_argument("--estimate", action="store_true",
                    help="print the memory estimates and stop (nothing is built)")
    ap.add_argument("--out", type=Path, help="the JSON (default bench/results/<tag>.json)")
    ap.add_argument("--tag", default="gpu-families")
    args = ap.parse_args()
    if args.small:
        args.prompt, args.budget = min(args.prompt, 32), min(args.budget, 0.5)
        args.context, args.arms = min(args.context, 64), "default"
        args.tag = args.tag + "-small"

    import mlx.core as mx

    names, skipped = runnable()
    if args.families:
        wanted = args.families.split(",")
        unknown = [n for n in wanted if n not in SPECS]
        if unknown:
            ap.error(f"unknown families {unknown}; known: {', '.join(SPECS)}")
        names = [n for n in names if n in wanted]
    names.sort(key=lambda n: n not in ISSUE_51)  # issue 51's first, each in table order
    caps, estimates = {}, {}
    for n in names:
        caps[n], estimates[n] = fitted(n, args)
    print(f"{'family':15} {'checkpoint':32} {'experts':>14} {'trunk GB':>8} {'head GB':>8} "
          f"{'peak GB':>8}", file=sys.stderr)
    for n, e in estimates.items():
        experts = f"{e['experts'] or '-'}{' (capped)' if caps[n] is not None else ''}"
        print(f"{n:15} {SPECS[n].checkpoint:32} {experts:>14} {e['trunk_gb']:8.1f} "
              f"{e['head_gb']:8.1f} {e['build_peak_gb']:8.1f}", file=sys.stderr)
    if args.estimate:
        return
    for n in [n for n in names if estimates[n]["build_peak_gb"] > args.max_gb]:
        skipped[n] = (f"its build peaks at ~{estimates[n]['build_peak_gb']:.0f} GB > --max-gb "
                      f"{args.max_gb:.0f} with its experts capped")
        names.remove(n)
    if args.out is not None:
        common.RESULTS, args.tag = args.out.parent, args.out.stem
    rows: dict[str, dict] = {}
    began = time.perf_counter()
    for i, name in enumerate(names):
        spent = time.perf_counter() - began
        each = spent / i if i else 0.0
        if args.time_limit is not None and spent + each > args.time_limit:
            skipped |= {n: f"not started: --time-limit {args.time_limit:.0f} s" for n in names[i:]}
            break
        print(f"[{i + 1}/{len(names)}] {name} ({SPECS[name].checkpoint}), {spent:.0f} s so far, "
              f"ETA {each * (len(names) - i):.0f} s" + (" (the first family compiles MLX's "
              "CUDA kernels where no cache has them)" if not i else ""),
              file=sys.stderr, flush=True)

        def log(message: str, name: str = name) -> None:
            print(f"    {name}: {message}", file=sys.stderr, flush=True)

        try:
            rows[name] = bench_family(name, args, caps[name], log)
        except Exception as exc:  # one family's failure is reported, the others still run
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            log(f"FAILED {rows[name]['error']}")
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        save(args, rows, skipped, estimates, began)  # after each: a cut-short run keeps its rows
    text = table(rows, skipped)
    print(text)
    print(f"saved {save(args, rows, skipped, estimates, began, text)}", file=sys.stderr)


def save(args, rows: dict, skipped: dict, estimates: dict, began: float, text: str = ""
         ) -> Path:
    import mlx.core as mx

    return common.save(args.tag, {
        "rates": RATES, "tokens": args.tokens, "runs": args.runs, "prompt": args.prompt,
        "layers": args.layers, "experts_cap": args.experts, "max_gb": args.max_gb,
        "small": args.small, "budget_s": args.budget, "context": args.context,
        "families": rows, "skipped": skipped, "estimates": estimates, "table": text,
        "seconds": time.perf_counter() - began,
        "device": mx.device_info() if hasattr(mx, "device_info") else {}})


if __name__ == "__main__":
    main()
