"""doctor --fix: every fixable finding, applied to a healthy bundle by its breaker, is repaired
in a copy that doctor passes and stock mlx-lm loads; the source is never touched; repaired
tensors equal the healthy originals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from click.testing import CliRunner

from fixtures.breaker import BREAKERS
from fixtures.factory import Sidecar, tree_hash
from mtpkit import open_bundle
from mtpkit.cli import main
from mtpkit.convert.convert import ConvertError
from mtpkit.convert.repair import repair
from mtpkit.schemas import finding_codes, validate

FIXABLE = sorted(c for c, e in finding_codes().items() if e["fixable"] and c in BREAKERS)


def _same_tensors(a, b):
    a, b = mx.load(str(a)), mx.load(str(b))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item(), k


def test_every_fixable_code_has_a_breaker():
    assert set(FIXABLE) == {c for c, e in finding_codes().items() if e["fixable"]} - {
        "config.invalid"}  # only its "MTP count missing" form is fixable: test below


@pytest.mark.parametrize("code", FIXABLE)
def test_fix_repairs_its_code(built, bundle_copy, tmp_path, code):
    import mlx_lm

    breaker, (family, sidecar), deep = BREAKERS[code]
    path = bundle_copy(family, sidecar)
    breaker(path)
    before = tree_hash(path)
    result = CliRunner().invoke(main, ["doctor", str(path), "--fix", "--out",
                                       str(tmp_path / "fixed"), "--json"]
                                + (["--deep"] if deep else []))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    validate(doc, "doctor_report")
    assert code in {a["code"] for a in doc["repair"]["applied"]}
    assert [f for f in doc["findings"] if f["severity"] != "info"] == []
    assert tree_hash(path) == before, "the source must never change"
    mlx_lm.load(str(tmp_path / "fixed"))  # strict


@pytest.mark.parametrize("code", ["mtp.in_trunk", "mtp.experts_unstacked", "mtp.norm_encoding",
                                  "index.tensor_mismatch"])
def test_repaired_tensors_equal_the_healthy_bundle(built, bundle_copy, tmp_path, code):
    breaker, (family, sidecar), _ = BREAKERS[code]
    path = bundle_copy(family, sidecar)
    breaker(path)
    repair(path, tmp_path / "fixed")
    healthy = built(family, sidecar)
    _same_tensors(tmp_path / "fixed" / "model.safetensors", healthy / "model.safetensors")
    fixed_side, healthy_side = (mx.load(str(p / "mtp.safetensors"))
                                for p in (tmp_path / "fixed", healthy))
    assert sorted(fixed_side) == sorted(healthy_side)
    for k in healthy_side:
        tol = 1e-2 if code == "mtp.norm_encoding" and healthy_side[k].ndim == 1 else 0
        assert mx.allclose(fixed_side[k].astype(mx.float32), healthy_side[k].astype(mx.float32),
                           atol=tol).item(), k


def test_mixed_norm_encodings_are_repaired_per_vector(built, bundle_copy, tmp_path):
    from fixtures.breaker import mtp_norm_encoding

    path = bundle_copy("qwen3_5", Sidecar(policy="layers"))
    mtp_norm_encoding(path, only=("layernorm.weight", "mtp.norm.weight"))  # pre_fc left absolute
    assert "mtp.norm_encoding" in {f.code for f in open_bundle(path).findings}
    repair(path, tmp_path / "fixed")
    fixed = mx.load(str(tmp_path / "fixed" / "mtp.safetensors"))
    healthy = mx.load(str(built("qwen3_5", Sidecar(policy="layers")) / "mtp.safetensors"))
    for k in healthy:
        assert mx.allclose(fixed[k].astype(mx.float32), healthy[k].astype(mx.float32),
                           atol=1e-2).item(), k


def test_config_quantization_rewritten_exactly(built, bundle_copy, tmp_path):
    breaker, (family, sidecar), _ = BREAKERS["quant.config_mismatch"]
    path = bundle_copy(family, sidecar)
    breaker(path)
    repair(path, tmp_path / "fixed")
    fixed = json.loads((tmp_path / "fixed" / "config.json").read_text())
    healthy = json.loads((built(family, sidecar) / "config.json").read_text())
    assert fixed["quantization"] == healthy["quantization"] == fixed["quantization_config"]


def test_missing_mtp_count_is_declared(bundle_copy, tmp_path):
    path = bundle_copy("qwen3_5", Sidecar())
    config = json.loads((path / "config.json").read_text())
    del config["text_config"]["mtp_num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(config))
    assert "config.invalid" in {f.code for f in open_bundle(path).findings}
    result = repair(path, tmp_path / "fixed")
    assert "config.invalid" in {a["code"] for a in result.applied}
    assert open_bundle(tmp_path / "fixed").findings == []


def _broken_template_bundle(bundle_copy):
    path = bundle_copy("qwen3_5", Sidecar())
    BREAKERS["template.missing"][0](path)
    return path


def test_template_from_wins(bundle_copy, tmp_path):
    path = _broken_template_bundle(bundle_copy)
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    result = repair(path, tmp_path / "fixed", template_from=jinja)
    assert result.template_provenance == f"--template-from {jinja}"
    assert (tmp_path / "fixed" / "chat_template.jinja").read_text() == jinja.read_text()


def test_template_from_gguf_metadata(bundle_copy, tmp_path):
    import gguf

    path = _broken_template_bundle(bundle_copy)
    writer = gguf.GGUFWriter(str(path / "model.gguf"), "llama")
    writer.add_chat_template("{{ messages[0]['content'] }} from gguf")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    result = repair(path, tmp_path / "fixed")
    assert result.template_provenance == "GGUF metadata of model.gguf"
    assert not (tmp_path / "fixed" / "model.gguf").exists()


def test_template_from_known_format_only_when_unambiguous(bundle_copy, tmp_path):
    path = _broken_template_bundle(bundle_copy)
    result = repair(path, tmp_path / "fixed")
    assert result.template_provenance.startswith("plain chatml template")
    assert open_bundle(tmp_path / "fixed").template.renders
    # add Gemma's turn tokens as well: two formats match, so nothing is guessed
    tok = json.loads((path / "tokenizer.json").read_text())
    for i, t in enumerate(["<start_of_turn>", "<end_of_turn>"]):
        tok["added_tokens"].append({"id": 500 + i, "content": t, "special": True,
                                    "single_word": False, "lstrip": False, "rstrip": False,
                                    "normalized": False})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    result = repair(path, tmp_path / "fixed2")
    assert result.template_provenance is None
    assert "template.missing" in {f.code for f in open_bundle(tmp_path / "fixed2").findings}


def test_template_from_original_model_in_hf_cache(bundle_copy, tmp_path):
    """The card names base_model; the original is in the local cache: its template is used."""
    path = _broken_template_bundle(bundle_copy)
    (path / "README.md").write_text("---\nbase_model: acme/Original\nlibrary_name: mlx\n---\n")
    rev = "f" * 40
    snap = tmp_path / "hub" / "models--acme--Original" / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "chat_template.jinja").write_text("{{ messages[-1]['content'] }} (original)")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(rev)
    exe = os.path.join(os.path.dirname(sys.executable), "mtpkit")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([exe, "doctor", str(path), "--fix", "--out", str(tmp_path / "f"),
                           "--json"], capture_output=True, text=True, env=env)
    doc = json.loads(proc.stdout)
    assert doc["repair"]["template_provenance"].startswith("original model acme/Original")
    assert "(original)" in (tmp_path / "f" / "chat_template.jinja").read_text()


def test_fix_refuses_hf_checkpoints_and_missing_out(built, tmp_path):
    with pytest.raises(ConvertError):
        repair(built("qwen3_5", hf=True), tmp_path / "x")
    result = CliRunner().invoke(main, ["doctor", str(built("qwen3_5")), "--fix"])
    assert result.exit_code == 2
    out = tmp_path / "exists"
    out.mkdir()
    result = CliRunner().invoke(main, ["doctor", str(built("qwen3_5")), "--fix", "--out", str(out)])
    assert result.exit_code == 2 and not any(out.iterdir())
    shutil.rmtree(out)
