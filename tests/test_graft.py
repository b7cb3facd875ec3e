"""mtpkit graft: a head trained on a frozen trunk, written as a normal bundle."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

import mtpkit
from fixtures.factory import tree_hash
from mtpkit.cli import main
from mtpkit.convert.convert import ConvertError
from mtpkit.convert.corpus import Document, prose, read_documents, stdlib_root
from mtpkit.convert.graft import GraftOptions, graft
from mtpkit.loaders.digest import sha256_file
from mtpkit.schemas import validate

CORPUS = stdlib_root() / "json"


def _options(**kw: object) -> GraftOptions:
    base = {"corpus": [CORPUS], "steps": 12, "batch": 4, "seq_len": 32, "eval_prompts": 3,
            "eval_tokens": 12}
    return GraftOptions(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def grafted(built: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("graft") / "llama-mtp"
    source = built("llama")
    before = tree_hash(source)
    losses: list[float] = []
    phases: list[str] = []

    def report(p) -> None:
        phases.append(p.phase)
        if p.phase == "head":
            losses.append(p.loss)

    result = graft(str(source), out, _options(), progress=report)
    assert phases[0] == "trunk" and phases[-1] == "head" and phases == sorted(phases, reverse=True)
    return source, before, result, losses


def test_graft_writes_a_healthy_bundle_with_provenance(grafted) -> None:
    source, before, result, losses = grafted
    assert tree_hash(source) == before, "the source bundle was modified"
    view = mtpkit.open_bundle(result.out)
    assert view.errors == [] and view.mtp.location == "sidecar" and view.mtp.blocks == 1
    manifest = json.loads((result.out / "mtpkit.json").read_text())
    validate(manifest, "manifest")
    record = manifest["graft"]
    assert record["steps"] == 12 and len(losses) == 12
    # 12 steps x 4 windows over 4 passes: the trunk ran once over 12 distinct windows
    assert record["distinct_tokens"] == 12 * 32 and record["tokens"] == 12 * 4 * 32
    assert record["corpus"] == [str(CORPUS)] and record["documents"]["held_out"] >= 1
    assert 0.0 <= record["held_out_acceptance"]["depth1"] <= 1.0
    assert record["held_out_acceptance"]["rounds"] > 0
    assert min(losses[-3:]) < losses[0], "training did not reduce the loss"
    for name in view.weights.trunk_files:  # the trunk is the source's, byte for byte
        assert sha256_file(result.out / name) == sha256_file(source / name)


def test_grafted_head_decodes_exactly(grafted) -> None:
    _, _, result, _ = grafted
    runner = mtpkit.load(result.out, dtype="float32")
    plain = runner.generate("import json", 24, depth=0)
    spec = runner.generate("import json", 24, depth=3)
    assert spec.tokens == plain.tokens and spec.stats.verify_calls > 0


def test_graft_is_deterministic(built: Callable[..., Path], tmp_path: Path, grafted) -> None:
    _, _, first, _ = grafted
    again = graft(str(built("llama")), tmp_path / "again", _options())
    assert sha256_file(again.out / "mtp.safetensors") == sha256_file(first.out / "mtp.safetensors")


def test_graft_refuses_bad_input(built: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(ConvertError) as hf:
        graft(str(built("llama", hf=True)), tmp_path / "a", _options())
    assert hf.value.code == "load.not_converted"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "one.txt").write_text("only one document")
    with pytest.raises(ConvertError) as corpus:
        graft(str(built("llama")), tmp_path / "b", _options(corpus=[empty]))
    assert corpus.value.code == "graft.corpus"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_corpus_holds_out_by_document_and_finds_prose() -> None:
    docs = read_documents([stdlib_root() / "email"])
    held = [d for d in docs if d.held_out]
    assert held and len(held) < len(docs)
    assert Document("x/a.py", "").held_out == Document("x/a.py", "other").held_out
    text = prose(Document("m.py", 'def f():\n    """' + "Words people wrote. " * 20 + '"""\n'))
    assert len(text) == 1 and text[0].startswith("Words")


def test_graft_cli_reports_progress(built: Callable[..., Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["graft", str(built("llama")), "--out",
                                       str(tmp_path / "g"), "--corpus", str(CORPUS),
                                       "--steps", "3", "--batch", "2", "--seq-len", "16"])
    assert result.exit_code == 0, result.output
    assert "graft step 3" in result.stderr and "held-out depth-1 acceptance" in result.stdout


def test_draft_vocabulary_is_written_and_decodes_exactly(built: Callable[..., Path],
                                                         tmp_path: Path) -> None:
    result = graft(str(built("llama")), tmp_path / "dv", _options(draft_vocab=64, steps=4))
    view = mtpkit.open_bundle(result.out)
    assert view.errors == [] and "mtp.draft_vocab" in view.weights.sidecar
    assert result.graft["draft_vocab"] == 64
    runner = mtpkit.load(result.out, dtype="float32")
    assert runner.head is not None and runner.head.draft_vocab.shape == (64,)
    plain = runner.generate("import json", 24, depth=0)
    spec = runner.generate("import json", 24, depth=2)
    assert spec.tokens == plain.tokens
