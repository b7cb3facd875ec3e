"""mtpkit convert: the trunk equals stock mlx-lm's conversion bit for bit, the MTP head is kept
for every family in the canonical sidecar, metadata is true, and output is atomic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from fixtures.configs import FAMILIES
from fixtures.factory import Sidecar, mlx_weights, tree_hash
from mtpkit import open_bundle
from mtpkit.cli import main
from mtpkit.convert.convert import ConvertError, ConvertOptions, convert
from mtpkit.convert.sidecar import SidecarOptions
from mtpkit.convert.trunk import QuantOptions
from mtpkit.convert.writer import OutputExists
from mtpkit.schemas import validate

Q4 = ConvertOptions(quant=QuantOptions(quantize=True))


def _load(path, name="model.safetensors"):
    return mx.load(str(path / name))


@pytest.mark.parametrize("family", FAMILIES)
def test_trunk_is_bit_identical_to_stock_mlx_lm(built, tmp_path, family):
    src = built(family, hf=True)
    before = tree_hash(src)
    result = convert(str(src), tmp_path / "out", Q4)
    assert tree_hash(src) == before, "the source must not change"
    ours, stock = _load(result.out), _load(built(family, None))
    assert sorted(ours) == sorted(stock)
    for name in stock:
        assert ours[name].dtype == stock[name].dtype, name
        assert mx.array_equal(ours[name], stock[name]).item(), name
    ours_cfg = json.loads((result.out / "config.json").read_text())
    stock_cfg = json.loads((built(family, None) / "config.json").read_text())
    assert ours_cfg["quantization"] == stock_cfg["quantization"]


@pytest.mark.parametrize("family", FAMILIES)
def test_bundle_is_clean_loadable_and_keeps_its_head(built, tmp_path, family):
    import mlx_lm

    result = convert(str(built(family, hf=True)), tmp_path / "out", Q4)
    assert [f.code for f in result.findings if f.severity != "info"] == []
    validate(result.manifest, "manifest")
    mlx_lm.load(str(result.out))  # strict
    view = open_bundle(result.out)
    expected = mlx_weights(family)[1]
    if not expected:
        assert view.weights.sidecar_file is None and not result.manifest["mtp"]["present"]
        return
    assert view.weights.sidecar_file == "mtp.safetensors"
    assert all(n.startswith("mtp.") for n in view.weights.sidecar)
    assert not any("mtp" in n for n in view.weights.trunk)
    record = json.loads((result.out / "config.json").read_text())["mtplx_mtp_quantization"]
    assert record["policy"] == "layers" and record["norm_encoding"] == "absolute"
    assert result.manifest["mtp"]["source_family"] == view.family.name


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "mimo"])
def test_sidecar_values_survive_conversion(built, tmp_path, family):
    """Full-precision sidecar vs the factory's ground truth (absolute norms, stacked experts)."""
    opts = ConvertOptions(sidecar=SidecarOptions(policy="keep"))
    result = convert(str(built(family, hf=True)), tmp_path / "out", opts)
    side = _load(result.out, "mtp.safetensors")
    truth = mlx_weights(family)[1]
    assert sorted(side) == sorted(truth)
    for name, want in truth.items():
        got = np.array(side[name].astype(mx.float32))
        # bf16 storage; zero-centred norms went through (x - 1) and + 1 in bf16
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 if want.ndim == 1 else 4e-3,
                                   err_msg=name)


def test_deepseek_head_gets_mla_split_and_stacked_experts(built, tmp_path):
    result = convert(str(built("deepseek_v3", hf=True)), tmp_path / "out", Q4)
    side = set(_load(result.out, "mtp.safetensors"))
    assert "mtp.layers.0.self_attn.embed_q.weight" in side
    assert not any("kv_b_proj" in n or ".experts." in n for n in side)
    assert "mtp.layers.0.mlp.switch_mlp.up_proj.scales" in side
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.shared_head.weight"} <= side


@pytest.mark.parametrize(("policy", "count"), [("keep", 15), ("layers", 29), ("all", 31)])
def test_dense_sidecar_policies_match_published_counts(built, tmp_path, policy, count):
    opts = ConvertOptions(quant=QuantOptions(quantize=True), sidecar=SidecarOptions(policy=policy))
    result = convert(str(built("qwen3_5", hf=True)), tmp_path / "out", opts)
    assert len(open_bundle(result.out).weights.sidecar) == count
    assert result.manifest["mtp"]["policy"] == policy
    artifacts = pytest.importorskip("mtplx.artifacts", reason="optional interop reader")
    gate = artifacts.inspect_mtp_tensors(result.out, open_bundle(result.out).config.raw)
    assert gate.passes_tensor_gate


def test_requantize_and_repair_an_mlx_bundle(built, tmp_path):
    """A 4-bit bundle with a numbered, delta-norm, g32 sidecar -> 8-bit, stacked, absolute."""
    src = built("qwen3_5_moe", Sidecar(policy="layers", group_size=32, experts="numbered",
                                       norms="delta"))
    opts = ConvertOptions(quant=QuantOptions(quantize=True, bits=8),
                          sidecar=SidecarOptions(policy="layers", bits=8, group_size=64))
    result = convert(str(src), tmp_path / "out", opts)
    view = open_bundle(result.out)
    assert view.findings == []
    assert view.mtp.expert_layout == "stacked" and view.mtp.norm_encoding == "absolute"
    assert {str(m.quant) for m in view.mtp_quantization.values()} == {"affine 8-bit g64"}
    assert "affine 8-bit g64" in {str(m.quant) for m in view.quantization.values()}
    # the norms really moved by +1 (delta -> absolute), not just their label
    truth = mlx_weights("qwen3_5_moe")[1]["mtp.norm.weight"]
    got = np.array(_load(result.out, "mtp.safetensors")["mtp.norm.weight"].astype(mx.float32))
    np.testing.assert_allclose(got, truth, atol=1e-2)


@pytest.mark.parametrize("quant", [
    QuantOptions(quantize=True, recipe="mixed_3_6"),
    QuantOptions(quantize=True, mode="mxfp4"),
    QuantOptions(quantize=True, bits=6, group_size=32, overrides=[("*.lm_head", False)]),
    QuantOptions(dtype="float16"),
], ids=["mixed_3_6", "mxfp4", "6bit-g32-override", "float16"])
def test_quantization_options_are_written_truthfully(built, tmp_path, quant):
    result = convert(str(built("qwen3_5", hf=True)), tmp_path / "out", ConvertOptions(quant=quant))
    view = open_bundle(result.out)
    assert view.errors == [] and [f.code for f in view.findings] == []
    measured = {str(m.quant) for m in view.quantization.values()}
    if quant.recipe:
        assert measured == {"affine 3-bit g64", "affine 6-bit g64"}
    elif quant.mode == "mxfp4":
        assert "mxfp4 4-bit g32" in measured
    elif quant.overrides:
        assert "language_model.lm_head" not in view.quantization
        assert "affine 6-bit g32" in measured
    else:
        assert not measured
        assert {i.dtype for i in view.weights.trunk.values()} >= {"F16"}


def test_output_is_atomic_and_never_overwritten(built, tmp_path, monkeypatch):
    src = built("qwen3_5", hf=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExists):
        convert(str(src), out, Q4)
    assert (out / "keep.txt").read_text() == "mine"

    from mtpkit.convert import convert as convert_mod

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert_mod, "write_safetensors", boom)
    with pytest.raises(RuntimeError):
        convert(str(src), out, ConvertOptions(quant=QuantOptions(quantize=True), force=True))
    assert (out / "keep.txt").read_text() == "mine"  # the old output survives a failed --force
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left behind
    monkeypatch.undo()
    convert(str(src), out, ConvertOptions(quant=QuantOptions(quantize=True), force=True))
    assert not (out / "keep.txt").exists() and (out / "mtpkit.json").exists()


def test_broken_source_is_refused_with_its_code(bundle_copy, tmp_path):
    path = bundle_copy("qwen3_5", None)
    with open(path / "model.safetensors", "r+b") as fh:
        fh.truncate(os.path.getsize(path / "model.safetensors") - 100)
    with pytest.raises(ConvertError) as err:
        convert(str(path), tmp_path / "out", Q4)
    assert err.value.code == "safetensors.truncated" and not (tmp_path / "out").exists()


def test_cli_convert_and_upload_plan(built, tmp_path):
    src = built("qwen3_next", hf=True)
    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["convert", str(src), str(out), "-q", "--mtp-bits", "8",
                                       "--upload-repo", "me/Tiny-MTP", "--dry-run"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output[result.output.index("{"):])
    assert plan["repo_id"] == "me/Tiny-MTP"
    assert {f["path"] for f in plan["files"]} >= {"model.safetensors", "mtp.safetensors",
                                                  "config.json", "mtpkit.json", "README.md"}
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: mlx\n") and "- mtp" in card
    assert f"mtpkit convert {src} {out} --quantize --mtp-bits 8 --upload-repo me/Tiny-MTP" in card
    exe = os.path.join(os.path.dirname(sys.executable), "mtpkit")
    again = subprocess.run([exe, "convert", str(src), str(out), "-q"], capture_output=True,
                           text=True)
    assert again.returncode == 2 and "output.exists" in again.stderr
    assert "Traceback" not in again.stderr
    bad = subprocess.run([exe, "convert", str(src), str(tmp_path / "z"), "-q",
                          "--quant-override", "nonsense"], capture_output=True, text=True)
    assert bad.returncode == 2 and "PATTERN=BITS" in bad.stderr
    shutil.rmtree(out)


def test_convert_from_a_repo_id_in_the_local_hf_cache(built, tmp_path):
    src = built("qwen3_5", hf=True)
    rev = "0" * 40
    snap = tmp_path / "hub" / "models--acme--Tiny" / "snapshots" / rev
    shutil.copytree(src, snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(rev)
    exe = os.path.join(os.path.dirname(sys.executable), "mtpkit")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([exe, "convert", "acme/Tiny", str(tmp_path / "out"), "-q"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    steps = [line for line in proc.stderr.splitlines() if line.startswith("convert: ")]
    assert steps[0] == "convert: loading mlx-lm"  # said before the seconds its import takes
    assert any("headers" in line for line in steps) and any("manifest" in line for line in steps)
    manifest = json.loads((tmp_path / "out" / "mtpkit.json").read_text())
    assert manifest["source"]["kind"] == "hf_cache"
    assert (manifest["source"]["repo_id"], manifest["source"]["revision"]) == ("acme/Tiny", rev)
    assert "base_model: acme/Tiny" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize("mode,bits,group", [("affine", 4, 64), ("affine", 8, 32),
                                             ("mxfp4", 4, 32), ("mxfp8", 8, 32)])
def test_quantize_rows_gives_mlx_quantize_bytes(tmp_path, mode, bits, group):
    """Chunked quantization on several streams, written back to back, must be byte-for-byte the
    single mx.quantize call mlx-lm makes: a 2-D weight, a stacked-expert strided slice (the
    fused gate_up case), and a one-row weight that cannot be split."""
    from mtpkit.convert.quantize import quantize_rows
    from mtpkit.convert.writer import Rows, write_safetensors

    key = mx.random.key(3)
    fused = mx.random.normal((5, 96, 128), key=key).astype(mx.bfloat16)
    cases = {"dense": mx.random.normal((67, 256), key=key).astype(mx.bfloat16),
             "gate": fused[:, :48, :], "up": fused[:, 48:, :],
             "one_row": mx.random.normal((1, 256), key=key).astype(mx.bfloat16)}
    ours: dict = {}
    stock: dict = {}
    for name, w in cases.items():
        mine, ref = quantize_rows(w, group, bits, mode), mx.quantize(w, group, bits, mode=mode)
        assert len(mine) == len(ref)
        for suffix, a, b in zip(("weight", "scales", "biases"), mine, ref, strict=False):
            ours[f"{name}.{suffix}"], stock[f"{name}.{suffix}"] = a, b
    assert any(isinstance(t, Rows) for t in ours.values()), "nothing was split: test is void"
    write_safetensors(tmp_path / "ours.safetensors", ours, sorted(ours))
    mx.save_safetensors(str(tmp_path / "stock.safetensors"), stock)
    back = mx.load(str(tmp_path / "ours.safetensors"))
    assert sorted(back) == sorted(stock)
    for name, ref in stock.items():
        assert back[name].shape == ref.shape and back[name].dtype == ref.dtype, name
        assert mx.array_equal(back[name], ref).item(), name
