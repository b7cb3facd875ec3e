"""Gemma 4's assistant drafter: the pair read and diagnosed, converted into one bundle, and its
forward checked against transformers' own Gemma4AssistantForCausalLM over a tiny gemma4_text
trunk's mlx-lm caches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from fixtures.gemma4 import (
    READS,
    assistant_config,
    attach,
    build_assistant,
    build_target,
    target_config,
)
from mtpkit.schemas import validate
from mtpkit.verify.doctor import report


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """variant -> (target checkpoint, assistant checkpoint), built once, read-only."""
    root = tmp_path_factory.mktemp("gemma4")
    return {v: (build_target(v, root / v), build_assistant(v, root / f"{v}-assistant"))
            for v in ("e2b", "31b")}


@pytest.fixture
def paired(pairs: dict[str, tuple[Path, Path]], tmp_path: Path):
    """A writable target with its assistant attached in `assistant/`."""
    def get(variant: str) -> Path:
        target, assistant = pairs[variant]
        out = shutil.copytree(target, tmp_path / variant)
        attach(out, assistant)
        return out
    return get


def _codes(doc: dict) -> set[str]:
    return {f["code"] for f in doc["findings"]} - {"mtp.absent"}


@pytest.mark.parametrize("variant", ["e2b", "31b"])
def test_a_healthy_pair_is_recognised(paired, variant):
    doc = report(paired(variant))
    validate(doc, "doctor_report")
    assert doc["summary"]["ok"] and not _codes(doc), doc["findings"]
    drafter = doc["bundle"]["drafter"]
    assert drafter["reads"] == READS[variant]  # resolved through the target's K/V sharing
    assert drafter["lm_head"] == ("centroids" if variant == "e2b" else "tied")


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(edit(tensors), str(folder / "model.safetensors"))


def _only(doc: dict, code: str) -> dict:
    assert _codes(doc) == {code}, doc["findings"]
    [hit] = [f for f in doc["findings"] if f["code"] == code]
    assert hit["hint"] and hit["location"] and doc["summary"]["exit_code"] == 1
    return hit


def test_hidden_size_of_another_target(paired):
    b = paired("e2b")
    _edit_config(b, lambda c: c.update(hidden_size=80))  # the target, not the assistant
    _edit_tensors(b, lambda t: t)
    doc = report(b)
    hits = [f for f in doc["findings"] if f["code"] == "drafter.mismatch"]
    assert any("backbone_hidden_size 64" in f["message"] and "80" in f["message"] for f in hits)


def test_a_target_without_the_kind_it_reads(paired):
    """A target with full-attention layers only: the assistant's sliding layers have nothing
    to read (mlx-lm builds and runs such a target; the pair cannot)."""
    b = paired("31b")
    _edit_config(b, lambda c: c.update(layer_types=["full_attention"] * 6))
    doc = report(b)
    hits = [f for f in doc["findings"] if f["code"] == "drafter.mismatch"]
    assert any("sliding_attention" in f["message"] and "keeps no K/V" in f["message"]
               for f in hits), doc["findings"]


def test_head_size_that_does_not_fit(paired):
    b = paired("31b")
    _edit_config(b, lambda c: c.update(global_head_dim=64))
    doc = report(b)
    hits = [f for f in doc["findings"] if f["code"] == "drafter.mismatch"]
    assert hits and "queries are 32 wide, the target's keys 64" in hits[0]["message"]


def test_vocabulary_of_another_tokenizer(paired):
    b = paired("31b")
    _edit_config(b / "assistant", lambda c: c["text_config"].update(vocab_size=1024))
    _edit_tensors(b / "assistant", lambda t: {**t, "model.embed_tokens.weight": __import__(
        "numpy").zeros((1024, 32), "float32")})
    hit = _only(report(b), "tokenizer.vocab_mismatch")
    assert "1024" in hit["message"] and "512" in hit["message"]


def test_own_tokenizer_mapping_differently(paired):
    b = paired("31b")
    tok = json.loads((b / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, z = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[z] = vocab[z], vocab[a]
    (b / "assistant" / "tokenizer.json").write_text(json.dumps(tok))
    _only(report(b), "tokenizer.vocab_mismatch")


@pytest.mark.parametrize(("damage", "code", "where"), [
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.3.self_attn.q_norm.weight"},
     "weights.missing", "assistant:model.layers.3.self_attn.q_norm.weight"),
    (lambda t: {**t, "pre_projection.weight": t["pre_projection.weight"][:, :48]},
     "weights.shape_mismatch", "assistant:pre_projection.weight"),
    (lambda t: {**t, "model.layers.0.self_attn.k_proj.weight": t["post_projection.weight"]},
     "weights.unexpected", "assistant:model.layers.0.self_attn.k_proj.weight"),
    (lambda t: {**t, "masked_embedding.token_ordering":
                t["masked_embedding.token_ordering"].astype("float32")},
     "weights.dtype_mismatch", "assistant:masked_embedding.token_ordering"),
])
def test_assistant_tensors_named_and_shaped(paired, damage, code, where):
    b = paired("e2b")
    _edit_tensors(b / "assistant", damage)
    assert _only(report(b), code)["location"] == where


@pytest.mark.parametrize(("edit", "words"), [
    (lambda c: c.update(model_type="gemma4_text"), "not 'gemma4_assistant'"),
    (lambda c: c["text_config"].update(num_kv_shared_layers=2), "num_kv_shared_layers is 2"),
    (lambda c: c["text_config"].update(enable_moe_block=True), "enable_moe_block"),
    (lambda c: c.update(num_centroids=15), "divisible by num_centroids"),
])
def test_not_an_assistant(paired, edit, words):
    b = paired("e2b")
    _edit_config(b / "assistant", edit)
    assert words in _only(report(b), "drafter.invalid")["message"]


def test_manifest_naming_a_missing_drafter(paired):
    b = paired("31b")
    shutil.move(b / "assistant", b / "elsewhere")
    from mtpkit.loaders.assistant import read_drafter
    rep = read_drafter(b, target_config("31b"), {"drafter": {"path": "gone"}})
    assert [f.code for f in rep.findings] == ["drafter.invalid"]
    assert read_drafter(b, target_config("31b"), {"drafter": {"path": "elsewhere"}}).spec


def test_no_assistant_no_drafter(pairs):
    doc = report(pairs["31b"][0])
    assert doc["bundle"]["drafter"] is None and doc["summary"]["ok"]


def test_assistant_config_keys_are_transformers(pairs):
    """The fixture's config is one transformers' own Gemma4AssistantConfig accepts as valid."""
    from transformers import Gemma4AssistantConfig

    for variant in ("e2b", "31b"):
        config = Gemma4AssistantConfig(**assistant_config(variant))
        config.validate_architecture()
        assert config.text_config.num_kv_shared_layers == 4


@pytest.mark.parametrize("variant", ["e2b", "31b"])
def test_convert_with_drafter(pairs, tmp_path, variant):
    """convert TARGET --drafter ASSISTANT: one bundle; the trunk converted at its root (stock
    mlx-lm loads it), the assistant copied into assistant/ byte for byte, the manifest naming
    it with the layers it reads; doctor finds the pair healthy."""
    from mlx_lm.utils import load_model

    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.trunk import QuantOptions

    target, assistant = pairs[variant]
    out = tmp_path / "out"
    result = convert(str(target), out, ConvertOptions(quant=QuantOptions(quantize=False),
                                                      drafter=str(assistant)))
    manifest = json.loads((out / "mtpkit.json").read_text())
    validate(manifest, "manifest")
    assert manifest["drafter"]["path"] == "assistant"
    assert manifest["drafter"]["reads"] == READS[variant]
    assert manifest["drafter"]["weights"] == "as_given"
    roles = {f["path"]: f["role"] for f in manifest["files"]}
    assert roles["assistant/model.safetensors"] == roles["assistant/config.json"] == "drafter"
    for name in ("config.json", "model.safetensors"):
        assert (out / "assistant" / name).read_bytes() == (assistant / name).read_bytes()
    assert report(out)["summary"]["ok"] and not [f for f in result.findings
                                                 if f.severity == "error"]
    load_model(out)  # the trunk alone, as stock mlx-lm reads the bundle's root
    again = tmp_path / "again"  # an existing bundle converted again keeps its drafter
    convert(str(out), again, ConvertOptions(quant=QuantOptions(quantize=False)))
    assert json.loads((again / "mtpkit.json").read_text())["drafter"] == manifest["drafter"]


@pytest.mark.parametrize(("edit", "code"), [
    (lambda c: c.update(backbone_hidden_size=96), "drafter.mismatch"),
    (lambda c: c.update(model_type="llama"), "drafter.invalid"),
])
def test_convert_refuses_a_drafter_that_does_not_fit(pairs, tmp_path, edit, code):
    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.errors import ConvertError
    from mtpkit.convert.trunk import QuantOptions

    target, _ = pairs["31b"]
    config = assistant_config("31b")
    edit(config)  # an assistant trained for another target: config and tensors agree
    bad = build_assistant("31b", tmp_path / "bad", config=config)
    with pytest.raises(ConvertError) as err:
        convert(str(target), tmp_path / "out", ConvertOptions(
            quant=QuantOptions(quantize=False), drafter=str(bad)))
    assert err.value.code == code and not (tmp_path / "out").exists()
    with pytest.raises(ConvertError) as err:
        convert(str(target), tmp_path / "out", ConvertOptions(
            quant=QuantOptions(quantize=False), drafter=str(tmp_path / "nowhere")))
    assert err.value.code == "drafter.invalid"
