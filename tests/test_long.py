"""Long inputs and large outputs: prompts longer than one prefill chunk (hidden states joined
across chunks and handed to the MTP head) and trunks written as several shards."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mtpkit
from mtpkit.convert import writer
from mtpkit.convert.convert import ConvertOptions, convert
from mtpkit.convert.repair import repair
from mtpkit.convert.trunk import QuantOptions
from mtpkit.decoder.rounds import session as session_mod
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.sampling import SamplingParams
from mtpkit.loaders.digest import sha256_file
from mtpkit.verify.doctor import report as doctor_report

PROMPT_LEN = 2300  # > one 2,048-token prefill chunk: two chunks, the second a partial one
NEW = 16


def _prompt(vocab: int) -> list[int]:
    return np.random.default_rng(0).integers(3, vocab, PROMPT_LEN).tolist()


@pytest.mark.parametrize("family,feed", [("qwen3_5", None), ("qwen3_5", "pre_norm"),
                                         ("deepseek_v3", None)])
def test_prompt_longer_than_a_prefill_chunk(built, monkeypatch, family, feed) -> None:
    """Hybrid (GatedDeltaNet + attention) and full-attention (MLA) trunks, post- and pre-norm
    hidden feeds: chunked prefill hands the head every prompt position's hidden, in order, as
    one pass computes it, and MTP greedy == plain greedy == a prefill done in one piece."""
    runner = mtpkit.load(built(family), dtype="float32", hidden_feed=feed)
    ids = _prompt(runner.trunk.args.vocab_size)
    assert len(ids) > session_mod.PREFILL_STEP == 2048
    plain = runner.generate(ids, NEW, depth=0)
    assert plain.stats.prompt_tokens == len(ids) and len(plain.tokens) == NEW
    for depth in (1, 3):
        spec = runner.generate(ids, NEW, depth=depth)
        assert spec.tokens == plain.tokens, depth
        assert spec.stats.verify_calls > 0

    whole, logits = runner.trunk(mx.array([ids]), runner.trunk.make_cache(), logits_for=1)
    session = Session(runner.trunk, runner.head, SamplingParams(), 3)
    first = session.start(ids)
    assert session.owed is not None
    hidden, tokens = session.owed
    assert first == plain.tokens[0] == int(mx.argmax(logits[0, -1]).item())
    assert tokens[0].tolist() == [*ids[1:], first]
    assert hidden.shape == whole.shape
    np.testing.assert_allclose(np.array(hidden), np.array(whole), rtol=1e-4, atol=1e-4)
    # the head's first draft reads all 2,300 owed pairs
    committed = session.round(session.head_draft(3)).committed
    assert [first, *committed] == plain.tokens[:1 + len(committed)]

    monkeypatch.setattr(session_mod, "PREFILL_STEP", len(ids))  # the prompt in one piece
    assert runner.generate(ids, NEW, depth=0).tokens == plain.tokens


def _header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header


def _nbytes(info: dict) -> int:
    return info["data_offsets"][1] - info["data_offsets"][0]


def test_trunk_over_the_shard_limit_is_written_as_shards(built, tmp_path, monkeypatch) -> None:
    """With the 5 GiB limit lowered to a quarter of a tiny trunk, convert writes mlx-lm's shard
    names and index; stock mlx-lm loads it, doctor passes it (and a repaired copy), and it
    decodes as the single-file conversion does."""
    src = built("qwen3_5", hf=True)
    options = ConvertOptions(quant=QuantOptions(quantize=True))
    single = convert(str(src), tmp_path / "single", options).out
    limit = (single / "model.safetensors").stat().st_size // 4
    plan = writer.plan_shards
    monkeypatch.setattr(writer, "plan_shards", lambda tensors: plan(tensors, limit))
    out = convert(str(src), tmp_path / "sharded", options).out

    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    headers = {s: _header(out / s) for s in shards}
    for s, header in headers.items():
        assert sum(_nbytes(i) for i in header.values()) <= limit or len(header) == 1, s
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {t: s for s, h in sorted(headers.items()) for t in sorted(h)}
    assert index["metadata"]["total_size"] == sum(_nbytes(i) for h in headers.values()
                                                  for i in h.values())
    merged = {k: v for s in shards for k, v in mx.load(str(out / s)).items()}
    reference = mx.load(str(single / "model.safetensors"))
    assert sorted(merged) == sorted(reference)
    assert all(mx.array_equal(merged[k], reference[k]).item() for k in reference)

    files = {f["path"]: f for f in json.loads((out / "mtpkit.json").read_text())["files"]}
    for s in shards:
        assert files[s]["role"] == "trunk" and files[s]["sha256"] == sha256_file(out / s)
    assert doctor_report(out, deep=True)["summary"]["ok"]
    fixed = repair(out, tmp_path / "fixed").out
    assert sorted(p.name for p in fixed.glob("model*.safetensors")) == shards
    assert doctor_report(fixed, deep=True)["summary"]["ok"]

    ids = mx.array([[5, 17, 42, 99, 7, 3]])
    stock = [mlx_lm.load(str(p))[0] for p in (single, out)]
    # the bytes are compared above; the outputs on the CPU, since MLX's CUDA quantized matmul
    # gave two identical loads of this toy (K = 64, one group per row) different garbage
    with mx.stream(mx.cpu):
        assert mx.array_equal(stock[0](ids), stock[1](ids)).item()
    runner = mtpkit.load(out, dtype="float32")
    plain = mtpkit.load(single, dtype="float32").generate(ids[0].tolist(), NEW, depth=0).tokens
    assert runner.generate(ids[0].tolist(), NEW, depth=0).tokens == plain
    assert runner.generate(ids[0].tolist(), NEW, depth=3).tokens == plain
