"""Healthy fixtures of every family and every published sidecar layout give no error: a false
positive is a bug. They also load in stock mlx-lm and pass MTPLX's independent sidecar gate."""

from __future__ import annotations

import pytest

from fixtures.configs import FAMILIES, MOE_FAMILIES
from fixtures.factory import Sidecar
from mtpkit import open_bundle
from mtpkit.verify.doctor import report

SIDECARS = [Sidecar(), Sidecar(policy="layers"), Sidecar(policy="all"),
            Sidecar(policy="layers", bits=8, group_size=32),
            Sidecar(policy="all", bits=6, group_size=128)]


def _errors(path):
    return [f for f in open_bundle(path).findings if f.severity != "info"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_checkpoints_are_clean(built, family):
    view = open_bundle(built(family, hf=True))
    assert view.kind == "hf"
    assert _errors(view.root) == []
    assert view.mtp.location == (None if family == "llama" else "trunk")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sidecar", SIDECARS, ids=lambda s: f"{s.policy}-{s.bits}b-g{s.group_size}")
def test_mlx_bundles_are_clean(built, family, sidecar):
    path = built(family, sidecar)
    assert _errors(path) == []
    doc = report(path, deep=True)
    assert doc["summary"]["ok"], doc["findings"]


def test_dense_sidecar_tensor_counts_match_published_layouts(built):
    """Published dense Qwen sidecars: 15 (float), 29 (layers quantized), 31 (fc quantized too)."""
    counts = {p: len(open_bundle(built("qwen3_5", Sidecar(policy=p))).weights.sidecar)
              for p in ("keep", "layers", "all")}
    assert counts == {"keep": 15, "layers": 29, "all": 31}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_sidecar_measures_expert_layout_and_sidecar_quant(built, family):
    view = open_bundle(built(family, Sidecar(policy="layers", bits=8, group_size=32)))
    assert view.mtp.expert_layout == "stacked"
    assert view.mtp.num_experts == 4
    quants = {str(mq.quant) for mq in view.mtp_quantization.values()}
    assert quants == {"affine 8-bit g32"}
    # trunk stays 4-bit g64 (routers 8-bit) while the sidecar is 8-bit g32: legitimate
    assert "affine 4-bit g64" in {str(mq.quant) for mq in view.quantization.values()}


def test_zero_centred_sidecar_declared_delta_is_fine(built):
    view = open_bundle(built("qwen3_5", Sidecar(norms="delta")))
    assert view.mtp.norm_encoding == "delta"
    assert [f.code for f in view.findings if f.code == "mtp.norm_encoding"] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_mlx_lm_loads_the_trunk_strictly(built, family):
    import mlx_lm
    from mlx.utils import tree_flatten

    model, tokenizer = mlx_lm.load(str(built(family, Sidecar(policy="layers"))))
    assert not [k for k, _ in tree_flatten(model.parameters()) if "mtp" in k]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                        add_generation_prompt=True)
    assert tokenizer.decode(ids).startswith("<|im_start|>user\nhi<|im_end|>\n"
                                            "<|im_start|>assistant\n")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("policy", ["keep", "layers", "all"])
def test_mtplx_accepts_our_sidecars(built, family, policy):
    artifacts = pytest.importorskip("mtplx.artifacts", reason="optional interop reader")
    path = built(family, Sidecar(policy=policy))
    result = artifacts.inspect_mtp_tensors(path, open_bundle(path).config.raw)
    assert result.passes_tensor_gate, (result.missing_expected_keys, result.extra_keys)


def test_mtplx_and_doctor_agree_numbered_moe_sidecar_is_not_loadable(built, tmp_path):
    import shutil

    from fixtures.breaker import mtp_experts_unstacked

    artifacts = pytest.importorskip("mtplx.artifacts", reason="optional interop reader")
    path = shutil.copytree(built("qwen3_5_moe", Sidecar(policy="layers")), tmp_path / "b")
    mtp_experts_unstacked(path)
    result = artifacts.inspect_mtp_tensors(path, open_bundle(path).config.raw)
    assert not result.passes_tensor_gate
    assert "mtp.experts_unstacked" in {f.code for f in open_bundle(path).findings}
