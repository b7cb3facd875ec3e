"""Bundles generate cannot run, which doctor called OK (issue 48 items 8 and 9): every tensor is
checked against mlx-lm's model class and the decoder's head (loaders/model_check.py), without
a weight read; doctor, `mtpkit.load` (generate, serve) and convert refuse them with the same
code. Non-UTF-8 file names are a finding, never a crash; an empty chat template is refused."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from fixtures import breaker
from fixtures.configs import FAMILIES
from fixtures.factory import Sidecar
from mtpkit.cli import main
from mtpkit.decoder.runner import load
from mtpkit.loaders.bundle import open_bundle
from mtpkit.loaders.findings import UserError
from mtpkit.loaders.model_check import check_model

BASE = ("qwen3_5", Sidecar(policy="layers"))
# (breaker, the code doctor and every loader name for it, where)
BROKEN = {
    "norm_shape": (breaker.weights_shape_mismatch, "weights.shape_mismatch",
                   "model.safetensors:language_model.model.layers.1.self_attn.q_norm.weight"),
    "int32_scales": (breaker.weights_dtype_mismatch, "weights.dtype_mismatch",
                     "model.safetensors:language_model.lm_head.scales"),
    "stray_shard": (breaker.weights_unexpected, "weights.unexpected", "model-extra.safetensors"),
    "missing_norm": (breaker.weights_missing, "weights.missing",
                     "language_model.model.layers.1.post_attention_layernorm.weight"),
    "sidecar_fc": (breaker.sidecar_shape_mismatch, "weights.shape_mismatch",
                   "mtp.safetensors:mtp.fc.weight"),
}


def _doctor(path: Path, *args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["doctor", str(path), "--json", *args])
    assert "Traceback" not in result.output
    return result.exit_code, json.loads(result.stdout)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_doctor_and_load_refuse_with_the_same_code(bundle_copy, case):
    damage, code, where = BROKEN[case]
    path = bundle_copy(*BASE)
    damage(path)
    status, doc = _doctor(path)
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    assert status == 1 and [(f["code"], f["location"]) for f in errors] == [(code, where)], errors
    with pytest.raises(UserError) as refused:  # before any weight is read
        load(path)
    assert refused.value.code == code and where in str(refused.value)
    status, output = _cli("generate", str(path), "Hi", "--max-tokens", "2")
    assert status == 2 and f"error [{code}]" in output and "Traceback" not in output


def test_int32_scales_pass_neither_deep_nor_plain_doctor(bundle_copy):
    path = bundle_copy(*BASE)
    breaker.weights_dtype_mismatch(path)
    status, doc = _doctor(path, "--deep")
    assert status == 1 and "weights.dtype_mismatch" in {f["code"] for f in doc["findings"]}


def test_convert_refuses_a_source_mlx_lm_would_refuse(bundle_copy, tmp_path):
    path = bundle_copy(*BASE)
    breaker.weights_unexpected(path)
    out = tmp_path / "out"
    status, output = _cli("convert", str(path), str(out))
    assert status == 2 and "error [weights.unexpected]" in output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_empty_template_is_refused_by_doctor_generate_and_fixed(bundle_copy, tmp_path):
    """serve answered 500 "empty prompt" to every chat request; doctor said OK."""
    path = bundle_copy(*BASE)
    breaker.template_empty(path)
    status, doc = _doctor(path)
    assert status == 1 and [f["code"] for f in doc["findings"]] == ["template.empty"]
    assert open_bundle(path).template.renders is False  # so no entry renders it
    status, output = _cli("generate", str(path), "Hi", "--max-tokens", "2")
    assert status == 2 and "error [template.empty]" in output  # the same code as doctor's
    status, _ = _cli("generate", str(path), "Hi", "--max-tokens", "2", "--raw")
    assert status == 0
    status, doc = _doctor(path, "--fix", "--out", str(tmp_path / "fixed"))
    assert status == 0 and doc["repair"]["applied"][0]["code"] == "template.empty"


def test_whitespace_template_is_empty_too(bundle_copy):
    path = bundle_copy(*BASE)
    (path / "chat_template.jinja").write_text("{% for m in messages %}\n{% endfor %}\n")
    assert [f.code for f in open_bundle(path).findings] == ["template.empty"]


@pytest.mark.skipif(sys.platform == "darwin", reason="APFS refuses names that are not UTF-8")
def test_non_utf8_shard_name_is_a_finding_never_a_crash(bundle_copy, tmp_path):
    """doctor --fix died with std::bad_cast (MLX given the name), convert with
    UnicodeEncodeError."""
    path = bundle_copy(*BASE)
    breaker.bad_name(path)
    status, doc = _doctor(path)
    [hit] = [f for f in doc["findings"] if f["severity"] == "error"]
    assert status == 1 and hit["code"] == "files.bad_name" and "\\udcff" in hit["location"]
    for args in (["doctor", str(path), "--fix", "--out", str(tmp_path / "fixed")],
                 ["convert", str(path), str(tmp_path / "converted")],
                 ["generate", str(path), "Hi", "--max-tokens", "2"]):
        status, output = _cli(*args)
        assert status == 2 and "error [files.bad_name]" in output, output
    assert not (tmp_path / "fixed").exists() and not (tmp_path / "converted").exists()


@pytest.mark.skipif(sys.platform == "darwin", reason="APFS refuses names that are not UTF-8")
def test_non_utf8_name_in_the_index_is_a_finding(bundle_copy):
    path = bundle_copy(*BASE)
    name = os.fsdecode(b"model-\xfe.safetensors")
    shutil.move(path / "model.safetensors", path / name)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict.fromkeys(index["weight_map"], name)
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    codes = {f["code"] for f in _doctor(path)[1]["findings"]}
    assert "files.bad_name" in codes


def test_convert_refuses_a_broken_source_tokenizer_before_writing(built, tmp_path):
    """convert exited 0 and published a bundle its own report marked tokenizer.invalid."""
    src = tmp_path / "src"
    shutil.copytree(built("qwen3_5", hf=True), src)
    (src / "tokenizer.json").write_text("")
    out = tmp_path / "out"
    status, output = _cli("convert", str(src), str(out))
    assert status == 2 and "error [tokenizer.invalid]" in output and "hint:" in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_convert_says_what_it_does_before_the_first_byte(built, tmp_path):
    from mtpkit.convert.convert import ConvertOptions, convert

    said: list[str] = []
    planned: list[int] = []

    def on_plan(total: int) -> None:
        planned.append(len(said))

    convert(str(built("qwen3_5", hf=True)), tmp_path / "out", ConvertOptions(),
            on_plan=on_plan, status=said.append)
    assert said[0].startswith("reading") and planned and planned[0] >= 3, said
    assert any("mlx-lm" in s for s in said)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_checkpoints_match_their_model_class(built, family):
    """convert checks its sources this way: no healthy checkpoint may be refused."""
    assert check_model(open_bundle(built(family, hf=True))) == []


def test_the_check_leaves_mlx_random_state_alone(built):
    view = open_bundle(built(*BASE))
    mx.random.seed(7)
    expected = mx.random.uniform(shape=(4,))
    mx.random.seed(7)
    assert check_model(view) == []
    assert mx.array_equal(mx.random.uniform(shape=(4,)), expected)
