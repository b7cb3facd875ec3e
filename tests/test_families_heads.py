"""The issue-51 families: their heads are found under the names the published checkpoints use,
convert keeps them, doctor diagnoses them with the codes the other families get (and --fix
repairs what it repairs there), and the decoder runs the ones whose layer it can build exactly
as stock mlx-lm decodes; the others are refused with mtp.unsupported, never dropped."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache
from test_exactness import LONG_PROMPT, PROMPT, assert_every_outcome, rounds_of, stock_greedy

import mtpkit
from fixtures import breaker
from fixtures.configs import HEAD_FAMILIES, config_for
from fixtures.decoder_models import OracleHead
from fixtures.heads import build_head_hf, head_weights
from fixtures.numerics import assert_close
from mtpkit.cli import main
from mtpkit.convert.convert import ConvertOptions, convert
from mtpkit.convert.repair import repair
from mtpkit.convert.sidecar import SidecarOptions
from mtpkit.convert.trunk import QuantOptions
from mtpkit.decoder.model.head import WindowKVCache
from mtpkit.decoder.options import OptionError
from mtpkit.decoder.rounds import session as session_module
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import SamplingParams
from mtpkit.loaders import families as families_module
from mtpkit.loaders.families import canonical_mtp_name, family_for
from mtpkit.loaders.findings import UserError
from mtpkit.loaders.safetensors_header import read_header
from mtpkit.schemas import finding_codes
from mtpkit.verify.doctor import report

RUNNABLE = ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "deepseek_v32", "ernie4_5_moe",
            "bailing_moe", "mimo_v2_flash", "step3p5", "longcat_flash", "nemotron_h",
            "bailing_hybrid", "kimi_k3", "minimax_m3_vl")
# Heads with a sliding-window block (a WindowKVCache in the head), and a prompt past the window.
WINDOWED = ("mimo_v2_flash", "step3p5")
WINDOW_PROMPT = [(7 * i + 3) % 97 + 2 for i in range(40)] * 4  # 160 tokens that lookup can copy
# DSA attention (MiniMax-M3's block-sparse too): an indexer cache beside the KV cache
INDEXED = ("glm_moe_dsa", "deepseek_v32", "minimax_m3_vl")
MOE_HEADS = ("glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "deepseek_v32", "nemotron_h", "bailing_moe",
             "bailing_hybrid", "kimi_k3", "minimax_m3_vl")


def baseline(family: str) -> set[str]:
    """What doctor says of a healthy bundle of the family: nothing, or that it cannot run it."""
    return set() if family in RUNNABLE else {"mtp.unsupported"}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Path]:
    """bundles(family, hf) -> the family's checkpoint, or its conversion (trunk 4-bit, sidecar
    layers at group 32), built once per module."""
    root = tmp_path_factory.mktemp("heads")
    cache: dict[tuple[str, bool], Path] = {}

    def get(family: str, hf: bool = False) -> Path:
        if (family, hf) not in cache:
            src = build_head_hf(family, root / f"{family}-hf") if hf else get(family, True)
            cache[(family, hf)] = src if hf else convert(
                str(src), root / f"{family}-mlx",
                ConvertOptions(quant=QuantOptions(quantize=True),
                               sidecar=SidecarOptions(group_size=32))).out
        return cache[(family, hf)]

    return get


def codes(path: Path, deep: bool = False) -> set[str]:
    return {f["code"] for f in report(path, deep=deep)["findings"]} - {"mtp.absent"}


@pytest.mark.parametrize("family", HEAD_FAMILIES)
def test_every_published_head_tensor_is_found_and_named_once(bundles, family):
    view = mtpkit.open_bundle(bundles(family, True))
    published = head_weights(family)
    assert sorted(view.mtp.source_names.values()) == sorted(published)
    assert view.family.name != "generic" and view.kind == "hf"
    canon = list(view.mtp.tensors)
    assert len(set(canon)) == len(published) and all(c.startswith("mtp.") for c in canon)
    # canonical names read back as themselves: a converted sidecar is found the same way
    assert all(canonical_mtp_name(c, view.family, view.config.text) == c for c in canon)
    assert codes(bundles(family, True)) == baseline(family)


@pytest.mark.parametrize("family", HEAD_FAMILIES)
def test_convert_keeps_the_head_in_its_sidecar(bundles, family):
    out = bundles(family)
    view = mtpkit.open_bundle(out)
    sidecar = read_header(out / "mtp.safetensors").tensors
    assert view.mtp.location == "sidecar" and set(sidecar) == set(view.mtp.source_names.values())
    assert not [n for n in view.weights.trunk if canonical_mtp_name(n, view.family,
                                                                    view.config.text)]
    source = mtpkit.open_bundle(bundles(family, True))
    weights = {c for c in source.mtp.tensors if c.endswith(".weight")}
    kept = {n for n in sidecar if n.endswith(".weight")}
    experts = {c for c in weights if ".experts." in c}
    # every non-expert module, quantized or not; MLA's kv_b_proj as mlx-lm's sanitize splits it
    split = {c for c in weights if c.endswith(".kv_b_proj.weight")
             and view.family.sanitize_mtp_layer}
    assert weights - experts - split <= kept
    assert all(c.replace("kv_b_proj", part) in kept for c in split
               for part in ("embed_q", "unembed_out"))
    assert bool(experts) == any(".switch_mlp." in n for n in kept) == (family in MOE_HEADS)
    quantized = view.config.mtp_quantization["quantized_modules"]
    assert quantized and all(m.startswith("mtp.layers.") for m in quantized)
    assert codes(out) == baseline(family)


@pytest.mark.parametrize("family", HEAD_FAMILIES)
def test_a_converted_bundle_converts_again_to_the_same_sidecar(bundles, family, tmp_path):
    first = bundles(family)
    again = convert(str(first), tmp_path / "again", ConvertOptions(
        sidecar=SidecarOptions(group_size=32))).out
    assert (read_header(again / "mtp.safetensors").tensors.keys()
            == read_header(first / "mtp.safetensors").tensors.keys())


# The sidecar codes every family's bundle is diagnosed with (fixtures/breaker.py's damage).
DAMAGE = {"mtp.missing": breaker.mtp_missing, "mtp.incomplete": breaker.mtp_incomplete,
          "mtp.in_trunk": breaker.mtp_in_trunk, "mtp.unknown_policy": breaker.mtp_unknown_policy,
          "mtp.group_mismatch": breaker.mtp_group_mismatch,
          "mtp.stray_sidecar": breaker.mtp_stray_sidecar,
          "mtp.experts_unstacked": breaker.mtp_experts_unstacked,
          "mtp.norm_encoding": breaker.mtp_norm_encoding}
KNOCK_ON = {"mtp.missing": {"mtp.group_mismatch"}}
ONLY = {"mtp.experts_unstacked": MOE_HEADS, "mtp.norm_encoding": ("step3p5",)}  # zero-centred
CASES = [(f, c) for f in HEAD_FAMILIES for c in DAMAGE if f in ONLY.get(c, (f,))]


@pytest.mark.parametrize(("family", "code"), CASES)
def test_doctor_names_the_damage_and_fix_repairs_it(bundles, family, code, tmp_path):
    path = tmp_path / "bundle"
    shutil.copytree(bundles(family), path)
    (path / "mtpkit.json").unlink()  # the damage would make it stale too (manifest.stale)
    DAMAGE[code](path)
    found = codes(path)
    expected = baseline(family) - ({"mtp.unsupported"} if code == "mtp.missing" else set())
    assert code in found and found - {code} <= expected | KNOCK_ON.get(code, set()), found
    if finding_codes()[code]["fixable"]:
        repair(path, tmp_path / "fixed")
        assert codes(tmp_path / "fixed") == baseline(family)


def test_an_empty_head_is_found_by_the_deep_scan(bundles, tmp_path):
    path = tmp_path / "bundle"
    shutil.copytree(bundles("nemotron_h"), path)
    breaker.mtp_empty(path)
    assert "mtp.empty" in codes(path, deep=True)


def test_zero_centred_step_heads_are_shifted_once_per_block(bundles):
    """Step-3.5's head norms are stored zero-centred (mlx-lm's sanitize adds +1 to a vanilla
    checkpoint's): converted, every block's gains sit at 1 +- 0.05 like the trunk's."""
    import mlx.core as mx

    arrays = mx.load(str(bundles("step3p5") / "mtp.safetensors"))
    norms = {k: float(v.astype(mx.float32).mean()) for k, v in arrays.items()
             if k.endswith("norm.weight")}
    assert {"mtp.heads.1.norm.weight", "mtp.heads.2.norm.weight", "mtp.norm.weight"} <= set(norms)
    assert all(0.9 < m < 1.1 for m in norms.values()), norms


def _unsupported_finding(path: Path) -> None:
    fam = family_for(mtpkit.open_bundle(path).config.model_type)
    [hit] = [f for f in report(path)["findings"] if f["code"] == "mtp.unsupported"]
    assert hit["location"] == "mtp.safetensors" and fam.unsupported in hit["message"]


@pytest.fixture
def unrunnable(monkeypatch: pytest.MonkeyPatch) -> str:
    """Nemotron-H's table entry marked unsupported (every family in the table runs its head,
    so the refusal path is shown on one marked so by the test)."""
    fam = family_for("nemotron_h")
    marked = replace(fam, unsupported="marked unsupported by the test")
    monkeypatch.setattr(families_module, "FAMILIES",
                        tuple(marked if f is fam else f for f in families_module.FAMILIES))
    return "nemotron_h"


def test_every_fixture_family_runs_its_head():
    assert set(RUNNABLE) == set(HEAD_FAMILIES)
    assert all(not family_for(f).unsupported for f in HEAD_FAMILIES)


def test_a_head_the_decoder_cannot_run_is_kept_and_its_trunk_runs(bundles, unrunnable):
    """The head stays on disk and doctor says why; asked to draft, the decoder refuses with
    mtp.unsupported (one line, the Python API and the CLI); the trunk decodes plainly as stock
    mlx-lm does, and with context drafts exactly (Nemotron-H's Mamba layers rolled back too)."""
    path = bundles(unrunnable)
    _unsupported_finding(path)
    runner = mtpkit.load(path, dtype="float32")
    fam = family_for(mtpkit.open_bundle(path).config.model_type)
    assert runner.head is None and fam.unsupported in (runner.unsupported or "")
    with pytest.raises(OptionError) as err:
        runner.generate(PROMPT, 4, depth=1, draft="head")
    assert err.value.code == "mtp.unsupported" and "\n" not in str(err.value)
    reference, _ = stock_greedy(path, PROMPT, 24)
    assert runner.generate(PROMPT, 24, depth=0).tokens == reference
    assert runner.generate(PROMPT, 24, depth=3, draft="lookup").tokens == reference
    result = CliRunner().invoke(main, ["generate", str(path), "hi", "--raw", "-m", "4",
                                       "--depth", "1", "--draft", "head"])
    assert result.exit_code == 2 and "error [mtp.unsupported]" in result.output, result.output


def test_a_config_whose_layer_lists_stop_at_the_trunk_is_refused(bundles, tmp_path):
    """Step-3.5's depths are built as layers N + i from the config's per-layer lists; a list
    that covers the trunk only (here rope_theta: as vLLM, mlx-lm cannot build those layers) is
    one finding, the head's, not a traceback, and load refuses the bundle with it."""
    path = tmp_path / "bundle"
    shutil.copytree(bundles("step3p5"), path)
    (path / "mtpkit.json").unlink()
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = config["rope_theta"][:config["num_hidden_layers"]]
    (path / "config.json").write_text(json.dumps(config))
    [hit] = [f for f in report(path)["findings"] if f["severity"] == "error"]
    assert hit["code"] == "weights.shape_mismatch" and "as layer 2" in hit["message"], hit
    with pytest.raises(UserError) as err:
        mtpkit.load(path, dtype="float32")
    assert err.value.code == "weights.shape_mismatch"


def test_longcat_block_computes_the_layer_vllm_builds(bundles):
    """vLLM builds LongCat-Flash's MTP block as a DeepseekV2DecoderLayer without experts, the
    MLA's q / kv LoRA scaling folded into the a-layernorm gains at load: mlx-lm's deepseek_v3
    DecoderLayer (a dense layer) loaded so computes what the head's block (LongCat's own MLA
    and MLP classes, composed by decoder/model/head.py) computes, a multi-row pass and single rows
    after it (mlx-lm's two MLA paths)."""
    from mlx_lm.models import deepseek_v3

    runner = mtpkit.load(bundles("longcat_flash"), dtype="float32")
    assert runner.head is not None
    block, c = runner.head.layers[0], config_for("longcat_flash")
    args = deepseek_v3.ModelArgs.from_dict({**c, "model_type": "deepseek_v3",
                                            "intermediate_size": c["ffn_hidden_size"],
                                            "num_hidden_layers": 1, "first_k_dense_replace": 1})
    ref = deepseek_v3.DeepseekV3DecoderLayer(args, 0)
    h = c["hidden_size"]
    scale = {"self_attn.q_a_layernorm.weight": (h / c["q_lora_rank"]) ** 0.5,
             "self_attn.kv_a_layernorm.weight": (h / c["kv_lora_rank"]) ** 0.5}
    weights = {k.replace("self_attn.0.", "self_attn."): v
               for k, v in tree_flatten(block.parameters())}
    ref.load_weights([(k, v * scale.get(k, 1.0)) for k, v in weights.items()], strict=True)
    for norm in (ref.self_attn.q_a_layernorm, ref.self_attn.kv_a_layernorm):
        norm.eps = 1e-5  # LongCat's MLA norms (mlx-lm's default; vLLM's RMSNorm's)
    x = mx.random.normal((1, 12, h), key=mx.random.key(3))
    ours, theirs = KVCache(), KVCache()
    for a, b in ((0, 10), (10, 11), (11, 12)):
        mask = create_causal_mask(b - a, a) if b - a > 1 else None
        assert_close(block(x[:, a:b], mask, ours), ref(x[:, a:b], mask, theirs),
                     f"LongCat MTP block, positions {a}..{b - 1}")


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("rollback", ["record", "replay"])
def test_a_sliding_window_trunk_rolls_back_past_its_window(bundles, rollback, bounded,
                                                            monkeypatch):
    """MiMo-V2-Flash's sliding layers keep mlx-lm's RotatingKVCache (a 128-token window here):
    once it wraps it overwrites its oldest keys, so a rejected draft cannot be trimmed away; the
    round restores the cache's state and replays the kept tokens. Past the window, with
    rejections, context drafts at depths 1 and 3 and auto give stock mlx-lm's tokens; with a
    GPU's bounded shapes too (a prefill padded to 256 positions wraps a 128-token window)."""
    monkeypatch.setattr(session_module, "bounded_by_default", lambda: bounded)
    path = bundles("mimo_v2_flash")
    prompt = [(7 * i + 3) % 97 + 2 for i in range(40)] * 4  # 160 tokens that lookup can copy
    reference, _ = stock_greedy(path, prompt, 96)
    runner = mtpkit.load(path, dtype="float32", rollback=rollback)
    results = {d: runner.generate(prompt, 96, depth=d, draft="lookup") for d in (1, 3, "auto")}
    assert all(r.tokens == reference for r in results.values())
    assert 0 < results[3].stats.acceptance_by_depth[2] < 1, "rounds kept and rejected drafts"


@pytest.mark.parametrize("family", RUNNABLE)
def test_greedy_tokens_equal_stock_mlx_lm(bundles, family):
    path = bundles(family)
    reference, reason = stock_greedy(path, PROMPT, 64)
    runner = mtpkit.load(path, dtype="float32")
    assert runner.head is not None
    assert runner.head.blocks == mtpkit.open_bundle(path).mtp.declared_layers
    for depth in (0, 1, 3):
        result = runner.generate(PROMPT, 64, depth=depth)
        assert result.tokens == reference and result.finish_reason == reason, (family, depth)
        if depth:  # the head drafted every round (its blocks chained), and was verified
            assert result.stats.proposed[0] == result.stats.verify_calls > 0


@pytest.mark.parametrize("family", RUNNABLE)
def test_forced_rejections_keep_greedy_equal_to_stock(bundles, family):
    """A drafter wrong at a random 30% of positions over the family's trunk: every rejection
    point and full acceptance happen, and the tokens still equal stock mlx-lm's."""
    path = bundles(family)
    reference, _ = stock_greedy(path, LONG_PROMPT, 96)
    runner = mtpkit.load(path, dtype="float32")
    seq = LONG_PROMPT + reference
    vocab = runner.trunk.args.vocab_size
    wrong = np.random.default_rng(1).random(len(seq)) < 0.3
    script = {i: (t + 1) % vocab if wrong[i] else t for i, t in enumerate(seq)}
    oracle = Runner(runner.trunk, OracleHead(vocab, script, len(LONG_PROMPT)),  # type: ignore[arg-type]
                    None)
    for depth in (2, 3):
        tokens, outcomes = rounds_of(oracle, LONG_PROMPT, len(reference), depth)
        assert tokens == reference, (family, depth)
        assert_every_outcome(outcomes, (depth,))


def _window(runner: Runner) -> int:
    """The window of the head's first sliding-window block (decoder/model/head.py's WindowKVCache)."""
    assert runner.head is not None
    return next(c.window for c in runner.head.make_cache() if isinstance(c, WindowKVCache))


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("family", WINDOWED)
def test_a_windowed_head_drafts_exactly_past_its_window(bundles, family, bounded, monkeypatch):
    """A head block of a sliding-window kind keeps every position in a WindowKVCache, the
    window applied by its mask (mlx-lm's RotatingKVCache could not trim a round's chained
    drafts once wrapped): past the window, its drafts verify into stock mlx-lm's tokens at
    depths 1 and 3; with a GPU's bounded shapes too (the head fed in bounded pieces, its
    full-attention blocks padded)."""
    monkeypatch.setattr(session_module, "bounded_by_default", lambda: bounded)
    path = bundles(family)
    runner = mtpkit.load(path, dtype="float32")
    assert len(WINDOW_PROMPT) > _window(runner)
    reference, reason = stock_greedy(path, WINDOW_PROMPT, 48)
    for depth in (1, 3):
        result = runner.generate(WINDOW_PROMPT, 48, depth=depth, draft="head")
        assert result.tokens == reference and result.finish_reason == reason, depth
        assert result.stats.proposed[0] == result.stats.verify_calls > 0


def _stock_cache(runner: Runner, layer: Any) -> KVCache | RotatingKVCache:
    """The cache stock mlx-lm's model makes for a layer of this kind (mimo_v2_flash.py's and
    step3p5.py's make_cache: a RotatingKVCache of the config's window for a sliding layer)."""
    args = runner.trunk.args
    sliding = getattr(layer, "is_sliding", getattr(layer, "is_sliding_window", False))
    window = getattr(args, "sliding_window_size", None) or args.sliding_window
    return RotatingKVCache(max_size=window) if sliding else KVCache()


@pytest.mark.parametrize("family", WINDOWED)
def test_every_head_block_attends_as_stock_mlx_lm_past_the_window(bundles, family):
    """Each head block's logits past the window equal those of the same block over the cache
    stock mlx-lm makes for a trunk layer of its kind (a sliding block: a RotatingKVCache,
    windowed by mlx-lm's own bookkeeping; a full one: a KVCache), fed the same pairs: a prefix
    in one pass, one pair at a time as the window wraps, then a multi-row pass after it."""
    runner = mtpkit.load(bundles(family), dtype="float32")
    head = runner.head
    assert head is not None
    seq = WINDOW_PROMPT
    hidden, _ = runner.trunk(mx.array([seq]), runner.trunk.make_cache(), logits_for=0)
    tokens = mx.array([seq[1:]])
    window = _window(runner)
    cuts = [0, window - 20, *range(window - 19, len(seq) - 9), len(seq) - 1]
    for k in range(head.blocks):
        ours, theirs = head.make_cache(), [_stock_cache(runner, x) for x in head.layers]
        assert isinstance(ours[k], WindowKVCache) == isinstance(theirs[k], RotatingKVCache)
        for a, b in zip(cuts, cuts[1:], strict=False):
            got, _ = head(hidden[:, a:b], tokens[:, a:b], ours, k)
            want, _ = head(hidden[:, a:b], tokens[:, a:b], theirs, k)
            assert_close(got, want, f"{family} block {k} logits of positions {a}..{b - 1}")
    assert any(isinstance(c, WindowKVCache) for c in head.make_cache())


def _positions(cache: KVCache | CacheList) -> list[tuple[str, mx.array]]:
    """A head block's cached positions by name: a DSA block's CacheList holds its KV cache and
    its indexer's keys (mlx-lm's deepseek_v32)."""
    parts = cache.caches if isinstance(cache, CacheList) else (cache,)
    return [(f"{i}.{name}", getattr(c, name)[..., :c.offset, :]) for i, c in enumerate(parts)
            for name in ("keys", "values") if c.offset]


@pytest.mark.parametrize("family", RUNNABLE)
def test_the_head_cache_holds_exactly_the_committed_pairs(bundles, family):
    """After rounds of the family's own head drafting 3 deep, every cache of its first block
    (a DSA block's indexer cache too) equals a fresh head pass over the (trunk hidden, next
    token) pairs of the committed text, and later blocks keep none: chained draft entries
    never survive a round (past the window for a sliding-window head)."""
    runner = mtpkit.load(bundles(family), dtype="float32")
    assert runner.head is not None
    session = Session(runner.trunk, runner.head, SamplingParams(), 3)
    prompt = WINDOW_PROMPT if family in WINDOWED else PROMPT
    seq = [*prompt, session.start(prompt)]
    for _ in range(12):
        seq += session.round(session.head_draft(3)).committed
    assert session.stats.verify_calls == 12 and session.stats.corrections > 0
    first, *later = session.mtp_cache
    n = _positions(first)[0][1].shape[-2]
    assert session.owed is not None and n + session.owed[1].shape[1] == len(seq) - 1
    assert all(not _positions(c) for c in later)
    hidden, _ = runner.trunk(mx.array([seq[:n]]), runner.trunk.make_cache(), logits_for=0)
    fresh = runner.head.make_cache()
    runner.head(hidden, mx.array([seq[1:n + 1]]), fresh, 0)
    got, want = _positions(first), _positions(fresh[0])
    assert [name for name, _ in got] == [name for name, _ in want]
    assert len(got) == (4 if family in INDEXED else 2)
    for (name, x), (_, y) in zip(got, want, strict=True):
        assert_close(x, y, f"{family} head cache {name}")


def test_nemotron_step_is_the_pattern_vllm_builds(bundles):
    """vLLM runs Nemotron-H's draft step as one decoder layer per mtp_hybrid_override_pattern
    character (attention, then MoE), fusion before the first, final_layernorm after the last:
    stock mlx-lm's NemotronH model built with that pattern, its embedding rows the head's
    fused inputs and its final norm the head's, gives the head's output (a multi-row pass,
    then one row over its cache)."""
    from mlx_lm.models import nemotron_h

    runner = mtpkit.load(bundles("nemotron_h"), dtype="float32")
    head = runner.head
    assert head is not None and head.blocks == 1 and len(head.layers) == 2
    c, seq = config_for("nemotron_h"), WINDOW_PROMPT[:25]
    hidden, _ = runner.trunk(mx.array([seq[:-1]]), runner.trunk.make_cache(), logits_for=0)
    tokens = mx.array([seq[1:]])
    x = head.layer_input(hidden, tokens)[0]
    ref = nemotron_h.Model(nemotron_h.ModelArgs.from_dict(
        {**c, "hybrid_override_pattern": c["mtp_hybrid_override_pattern"],
         "vocab_size": x.shape[0]}))
    weights = {f"backbone.layers.{j}.{k}": v for j, layer in enumerate(head.layers)
               for k, v in tree_flatten(layer.parameters())}
    ref.load_weights([*weights.items(), ("backbone.embeddings.weight", x),
                      ("backbone.norm_f.weight", head.roles[0].norm.weight),
                      ("lm_head.weight", mx.zeros((x.shape[0], x.shape[1])))], strict=True)
    # (mlx-lm reads a Mamba cache's mask even where the pattern has no Mamba layer: None)
    ids, ours, theirs = mx.arange(x.shape[0])[None], head.make_cache(), [*ref.make_cache(), None]
    for a, b in ((0, x.shape[0] - 1), (x.shape[0] - 1, x.shape[0])):
        _, got = head(hidden[:, a:b], tokens[:, a:b], ours, 0)
        assert_close(got, ref.backbone(ids[:, a:b], cache=theirs),
                     f"Nemotron-H draft step, positions {a}..{b - 1}")


def _vl_reference(family: str, rows: int) -> Any:
    """Stock mlx-lm's model of the family with one text layer of the draft layer's kind, as
    its config builds it (not through the table's mtp_config): Kimi-K3's an MLA MoE layer
    without block-residual mixing, MiniMax-M3's sparse attention and MoE; `rows` tokens."""
    from mlx_lm.utils import _get_classes

    config = config_for(family)
    text = {**config["text_config"], "num_hidden_layers": 1, "vocab_size": rows}
    if family == "kimi_k3":
        text |= {"attn_res_block_size": None, "first_k_dense_replace": 0,
                 "linear_attn_config": {**text["linear_attn_config"], "kda_layers": [],
                                        "full_attn_layers": [1]}}
    else:
        text |= {"moe_layer_freq": [1], "sparse_attention_config": {
            **text["sparse_attention_config"], "sparse_attention_freq": [1]}}
    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict({**config, "text_config": text}))


@pytest.mark.parametrize("family", ["kimi_k3", "minimax_m3_vl"])
def test_a_vl_head_step_is_the_layer_vllm_builds(bundles, family):
    """vLLM's draft step of Kimi-K3 and MiniMax-M3: the embedding zeroed at position 0, fc
    over [enorm(e), hnorm(h)] (MiniMax's norms Gemma-style, 1 + w), the draft layer, the final
    norm into the LM head (Kimi: each depth's shared_head), the pre-norm sum chained. The
    fusion is recomputed from the head's weights; stock mlx-lm's model built with one layer of
    the draft layer's kind, its embedding rows the fused inputs and its final norm the head's,
    gives the head's logits and chained hidden (a multi-row pass, then rows over the caches;
    MiniMax's sparse path selects blocks of 4 past 8 keys)."""
    runner = mtpkit.load(bundles(family), dtype="float32")
    head = runner.head
    assert head is not None and head.blocks == 1
    roles, text = head.roles[0], config_for(family)["text_config"]
    seq = WINDOW_PROMPT[:25]
    hidden, _ = runner.trunk(mx.array([seq[:-1]]), runner.trunk.make_cache(), logits_for=0)
    tokens = mx.array([seq[1:]])
    gain = (lambda w: 1.0 + w) if family == "minimax_m3_vl" else (lambda w: w)
    embed = roles.embed_tokens(tokens) if "embed_tokens" in roles else runner.trunk.embed(tokens)
    embed = mx.where((mx.arange(tokens.shape[1]) == 0)[None, :, None], 0.0, embed)
    parts = [mx.fast.rms_norm(embed, gain(roles.pre_fc_norm_embedding.weight),
                              text["rms_norm_eps"]),
             mx.fast.rms_norm(hidden, gain(roles.pre_fc_norm_hidden.weight),
                              text["rms_norm_eps"])]
    x = head.layer_input(hidden, tokens)
    assert_close(x, roles.fc(mx.concatenate(parts, axis=-1)), f"{family} fused input")
    rows = x.shape[1]
    ref = _vl_reference(family, rows)
    inner = "language_model.model."
    ref.load_weights([*((f"{inner}layers.0.{k}", v)
                        for k, v in tree_flatten(head.layers[0].parameters())),
                      (f"{inner}embed_tokens.weight", x[0]), (f"{inner}norm.weight",
                                                              roles.norm.weight),
                      ("language_model.lm_head.weight", mx.zeros((rows, x.shape[-1])))],
                     strict=True)
    unembed = roles.shared_head if "shared_head" in roles else runner.trunk.logits
    ids, ours, theirs = mx.arange(rows)[None], head.make_cache(), ref.make_cache()
    for a, b in ((0, rows - 2), (rows - 2, rows - 1), (rows - 1, rows)):
        logits, chained = head(hidden[:, a:b], tokens[:, a:b], ours, 0)
        want = ref.language_model.model(ids[:, a:b], cache=theirs)
        assert_close(logits, unembed(want), f"{family} draft logits, positions {a}..{b - 1}")
        assert_close(roles.norm(chained), want, f"{family} chained hidden, {a}..{b - 1}")


# Published name variants (without the `language_model.` prefix the fixtures use, a second
# depth), as docs/families.md cites them, against the table.
NAMED = {
    ("kimi_k3", "language_model.model.layers.4.eh_proj.weight"): "mtp.fc.weight",
    ("kimi_k3", "model.layers.5.shared_head.head.weight"): "mtp.heads.1.shared_head.weight",
    ("kimi_k3", "model.layers.4.self_attn.kv_b_proj.weight"):
        "mtp.layers.0.self_attn.kv_b_proj.weight",
    ("kimi_k3", "model.layers.3.self_attn.o_proj.weight"): None,  # a trunk layer
    ("minimax_m3_vl", "language_model.model.mtp.layers.0.enorm.weight"):
        "mtp.pre_fc_norm_embedding.weight",
    ("minimax_m3_vl", "model.mtp.layers.1.final_layernorm.weight"): "mtp.heads.1.norm.weight",
    ("minimax_m3_vl", "model.mtp.layers.0.transformer_layer.self_attn.q_proj.weight"):
        "mtp.layers.0.self_attn.q_proj.weight",
    ("kimi_k3", "model.layers.4.block_sparse_moe.gate.e_score_correction_bias"):
        "mtp.layers.0.mlp.e_score_correction_bias",
    ("nemotron_h", "language_model.mtp.layers.1.final_layernorm.weight"): "mtp.norm.weight",
}


@pytest.mark.parametrize(("key", "canonical"), NAMED.items())
def test_published_names_of_families_without_a_fixture(key, canonical):
    model_type, name = key
    fam = family_for(model_type)
    assert not fam.unsupported
    assert canonical_mtp_name(name, fam, {"num_hidden_layers": 4}) == canonical


def test_minimax_counts_its_modules():
    """MiniMax-M3 names its count num_mtp_modules (inside text_config): a head it declares is
    not reported as undeclared."""
    from mtpkit.loaders.config import ModelConfig

    assert ModelConfig(text={"num_mtp_modules": 2}).num_mtp_layers == 2
    assert ModelConfig(text={"num_nextn_predict_layers": 1, "num_mtp_modules": 2}
                       ).num_mtp_layers == 1


def test_a_trunk_whose_lm_head_is_none_is_tied():
    """mlx-lm's Kimi-K3 keeps `lm_head = None` when its embeddings are tied: the trunk's logits
    are then the embedding's (read where the family table says it is), not a call of None."""
    import mlx.nn as nn

    from mtpkit.decoder.model.trunk import Trunk

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(8, 4)
            self.layers: list[nn.Module] = []
            self.norm = nn.RMSNorm(4)

    class Text(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.lm_head = Inner(), None
            self.args = type("Args", (), {"model_type": "kimi_k3"})()

    trunk = Trunk(Text())
    post = mx.ones((1, 2, 4))
    assert trunk.tied
    assert_close(trunk.logits(post), post @ trunk.inner.embed_tokens.weight.T, "tied logits")


# Heads inside a batch: a sliding-window head of several blocks (Step-3.5: sliding, full,
# sliding depths, each block its own cache) and heads over recurrent trunks (Nemotron-H's Mamba
# mixers, Kimi-K3's KDA layers, Ling 2.5's lightning attention, whose call takes the rope
# offset), rows joining as others leave, at different depths and sources, the last row parted
# back to a lone session.
@pytest.mark.parametrize("family", ["step3p5", "nemotron_h", "kimi_k3", "bailing_hybrid"])
def test_every_row_of_a_batch_of_head_drafts_decodes_as_alone(bundles, family):
    """Each row's tokens and round counts in a batch equal its lone decoding: the head's
    drafts for two rows (3 deep: every block chained, past Step-3.5's 32-token window; and 2
    deep), one plain row and one of context drafts; the fourth row joins when one leaves, and
    the head's later blocks, which keep no positions, part with the last row. Killed by a
    recurrent mixer left unrecorded (families.RECURRENT_ATTRIBUTES: the batch kept each row's
    rejected drafts in its state) and by a block of no real positions parted as a float index
    (batch_cache.single)."""
    from test_batch import _same, _streamed

    loaded = mtpkit.load(bundles(family), dtype="float32")
    runner = Runner(loaded.trunk, loaded.head, None)
    assert runner.batchable
    prompts = [WINDOW_PROMPT[:90], PROMPT, WINDOW_PROMPT[7:60], LONG_PROMPT]
    each = [{"depth": 3, "draft": "head", "max_tokens": 40}, {"depth": 0, "max_tokens": 12},
            {"depth": 2, "draft": "head", "max_tokens": 30},
            {"depth": 1, "draft": "lookup", "max_tokens": 24}]
    alone = [runner.generate(p, **e) for p, e in zip(prompts, each, strict=True)]
    order, batched = _streamed(runner, prompts, each, max_batch=3)
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)
    assert order.index(3) > order.index(1), "the fourth joined after a row left"
    assert all(r.stats.proposed[0] for r, e in zip(batched, each, strict=True)
               if e.get("draft") == "head")
    assert sum(r.stats.corrections for r in batched) > 0, "rows rejected drafts"


# A family whose rows would not decode as alone in a batch: MiniMax-M3's sparse attention
# picks key blocks by cache slot, so a row's left padding changes its keys (the family table's
# `unbatchable`).
@pytest.mark.parametrize(("family", "why"), [("minimax_m3_vl", "cache slot")])
def test_a_batch_that_would_not_decode_as_alone_is_refused(bundles, family, why):
    """Every batch entry refuses max_batch above 1 in one line with options.invalid and the
    reason; one at a time, each prompt decodes as alone."""
    from mtpkit.serve.service import Service

    runner = mtpkit.load(bundles(family), dtype="float32")
    assert not runner.batchable and why in runner.unbatchable
    entries = {"generate_batch": lambda: runner.generate_batch([PROMPT, PROMPT], 8, max_batch=2),
               "stream_batch": lambda: next(runner.stream_batch([PROMPT, PROMPT], 8,
                                                                max_batch=4)),
               "batch_costs": lambda: runner.batch_costs(2),
               "serve": lambda: Service(runner, family, 3, 16, max_batch=2)}
    for name, entry in entries.items():
        with pytest.raises(UserError) as err:
            entry()
        assert err.value.code == "options.invalid" and why in str(err.value), name
        assert "\n" not in str(err.value), name
    prompts = [PROMPT, LONG_PROMPT]
    alone = [runner.generate(p, 12, depth=2, draft="head") for p in prompts]
    together = runner.generate_batch(prompts, 12, max_batch=1, depth=2, draft="head")
    assert [r.tokens for r in together] == [r.tokens for r in alone]


def test_ling_traced_recording_passes_compute_what_stock_passes_compute(bundles):
    """Ling 2.5's lightning attention takes the rope offset as a keyword: a traced recording
    pass hands it out with the layer's input, and each commit replays from it the states the
    stock pass leaves (replayed at offset 0, the logits move by about 10)."""
    from test_traced import _traced, recorded_passes

    runner = mtpkit.load(bundles("bailing_hybrid"), dtype="float32")
    assert [r.exported for r in runner.trunk.recorders] == [()]
    want = recorded_passes(runner.trunk)
    calls = _traced(runner.trunk)
    got = recorded_passes(runner.trunk)
    assert calls == [(1, width) for w in (3, 5, 2, 4, 4) for width in (w, 1)]
    assert [r.exported for r in runner.trunk.recorders] == [("offset",)]
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
