"""The trained tiny Qwen3.5 fixtures (hybrid; MoE): real acceptance on held-out text, and the
decoder exact on them at every depth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mtpkit
from fixtures.trained import TRAINED, Recipe, corpus, train
from mtpkit.loaders.digest import sha256_file
from mtpkit.train.graft import held_out_prompts


def test_held_out_text_is_never_trained_on() -> None:
    train_docs, held = corpus()
    assert held and train_docs
    assert not {d.name for d in held} & {d.name for d in train_docs}


@pytest.mark.parametrize("family", TRAINED)
def test_trained_fixture_reaches_half_acceptance(trained, family: str) -> None:
    bundle, record = trained[family]
    assert mtpkit.open_bundle(bundle).errors == []
    acceptance = record["held_out_acceptance"]
    assert acceptance["rounds"] >= 100 and acceptance["depth1"] >= 0.5, acceptance


@pytest.mark.parametrize("family", TRAINED)
def test_trained_fixture_decodes_exactly_at_every_depth(trained, family: str) -> None:
    bundle, _ = trained[family]
    runner = mtpkit.load(bundle, dtype="float32")
    prompts = held_out_prompts(corpus()[1], 2, seed=1)
    proposed = accepted = 0
    for prompt in prompts:
        plain = runner.generate(prompt, 160, depth=0)
        assert len(plain.tokens) > 20
        for depth in (1, 2, 3, 4):
            spec = runner.generate(prompt, 160, depth=depth)
            assert spec.tokens == plain.tokens, (family, depth)
            proposed, accepted = proposed + spec.stats.proposed[0], accepted + spec.stats.accepted[0]
    assert 0 < accepted < proposed, "both acceptances and rejections must occur"


@pytest.mark.parametrize("family", TRAINED)
def test_trained_fixture_samples_reproducibly(trained, family: str) -> None:
    bundle, _ = trained[family]
    runner = mtpkit.load(bundle, dtype="float32")
    runs = [runner.generate("def parse(self, text):", 48, temperature=0.8, top_p=0.95, depth=2,
                            seed=7).tokens for _ in range(2)]
    assert runs[0] == runs[1]


def test_training_script_is_deterministic(tmp_path: Path) -> None:
    short = Recipe(steps=3, eval_prompts=1, eval_tokens=8)
    first = train("qwen3_5", tmp_path / "a", short)
    second = train("qwen3_5", tmp_path / "b", short)
    for name in ("model.safetensors", "mtp.safetensors", "tokenizer.json"):
        assert sha256_file(tmp_path / "a" / name) == sha256_file(tmp_path / "b" / name)
    assert first["final_loss"] == second["final_loss"]


def test_generate_compare_reports_speedup_and_identity(trained) -> None:
    from click.testing import CliRunner

    from mtpkit.cli import main
    from mtpkit.decoder.compare import compare
    from mtpkit.schemas import validate

    bundle, _ = trained["qwen3_5"]
    args = ["generate", str(bundle), "def parse(self, text):", "--raw", "--depth", "2",
            "--max-tokens", "64", "--dtype", "float32", "--compare"]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    validate(doc, "generation")
    assert doc["compare"]["tokens_identical"] is True
    assert doc["stats"]["decode_tps"] > 0 and doc["compare"]["plain_decode_tps"] > 0
    assert doc["compare"]["speedup"] == pytest.approx(doc["stats"]["decode_tps"]
                                                      / doc["compare"]["plain_decode_tps"])
    text = CliRunner().invoke(main, args)
    assert "speedup" in text.stderr and "tokens identical to plain: yes" in text.stderr
    runner = mtpkit.load(bundle, dtype="float32")
    sampled = compare(runner, "import os", 24, 2, temperature=0.7, seed=3)
    assert sampled.identical is None and sampled.mtp.stats.depth == 2
    assert sampled.plain.stats.depth == 0 and sampled.plain.stats.verify_calls == 0
    assert sampled.speedup == pytest.approx(sampled.mtp.stats.decode_tps
                                            / sampled.plain.stats.decode_tps)
