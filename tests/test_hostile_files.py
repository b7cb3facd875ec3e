"""Hostile bundle files (issue 31, items 4 and 6): whatever a loader would open is vetted by
stat first, so a FIFO, a link to /dev/zero or a link outside the bundle is reported and never
opened, and a config the tensors contradict is refused before anything is built from it.

A FIFO opened by mistake would hang the suite, so every FIFO here is watched: a thread that
notices a reader opening it records the open and lets the reader go (it then reads EOF).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from fixtures.factory import Sidecar
from mtpkit.cli import main
from mtpkit.loaders.bundle import open_bundle
from mtpkit.verify.doctor import report

BASE = ("qwen3_5", Sidecar(policy="layers"))


@contextmanager
def watched(fifo: Path) -> Iterator[list[str]]:
    """Yield a list that gets an entry whenever something opens `fifo` for reading while the
    block runs; the opener is released (a writer opens and closes at once) instead of hanging."""
    opened: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: nobody is reading it
                done.wait(0.02)
                continue
            opened.append(fifo.name)
            os.close(fd)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield opened
    finally:
        done.set()
        thread.join()


def _generate(path: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["generate", str(path), "Hi", "--max-tokens", "2"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def _assert_refused(path: Path, code: str) -> None:
    """generate (and so serve, which loads the same way) ends with the one-line error."""
    status, output = _generate(path)
    assert status == 2 and f"error [{code}]" in output, output
    assert "Traceback" not in output


def _codes(path: Path) -> set[str]:
    return {f.code for f in open_bundle(path).findings}


@pytest.mark.parametrize("name", ["model-00009.safetensors", "generation_config.json",
                                  "tokenizer.json", "chat_template.jinja", "mtp.safetensors",
                                  "model.safetensors.index.json"])
def test_fifo_is_reported_never_opened_and_refused(bundle_copy, name):
    """mlx-lm's glob opens every model*.safetensors and load_config opens
    generation_config.json: a FIFO there blocked generate forever while doctor said OK."""
    path = bundle_copy(*BASE)
    fifo = path / name
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    with watched(fifo) as opened:
        start = time.monotonic()
        doc = report(path)
        assert time.monotonic() - start < 30
        hits = [f for f in doc["findings"] if f["code"] == "files.not_regular"]
        assert [f["location"] for f in hits] == [name] and "FIFO" in hits[0]["message"]
        assert doc["summary"]["exit_code"] == 1
        _assert_refused(path, "files.not_regular")
    assert opened == []


def test_link_to_dev_zero_is_reported_and_refused(bundle_copy):
    """model-zero.safetensors -> /dev/zero: doctor said OK and generate tracebacked."""
    path = bundle_copy(*BASE)
    (path / "model-zero.safetensors").symlink_to("/dev/zero")
    view = open_bundle(path)
    [hit] = [f for f in view.findings if f.location == "model-zero.safetensors"]
    assert hit.code == "index.path_escape" and "/dev/zero" in hit.message
    assert "model-zero.safetensors" not in view.weights.headers
    _assert_refused(path, "index.path_escape")


def test_dangling_link_in_the_glob_is_not_regular(bundle_copy):
    path = bundle_copy(*BASE)
    (path / "model-00002.safetensors").symlink_to("gone.safetensors")
    assert "files.not_regular" in _codes(path)


def test_index_linked_outside_is_not_read(bundle_copy, tmp_path):
    """The index was opened without the check every other file gets."""
    path = bundle_copy(*BASE)
    outside = tmp_path / "elsewhere.json"
    shutil.move(path / "model.safetensors.index.json", outside)
    index = json.loads(outside.read_text())
    index["weight_map"]["model.layers.99.ghost.weight"] = "model.safetensors"
    outside.write_text(json.dumps(index))
    (path / "model.safetensors.index.json").symlink_to(outside)
    view = open_bundle(path)
    assert view.weights.index is None  # its weight_map (and the ghost) never read
    [hit] = [f for f in view.findings if f.code == "index.path_escape"]
    assert hit.location == "model.safetensors.index.json" and str(outside) in hit.message
    assert {f.code for f in view.findings} == {"index.path_escape"}


def test_index_linked_to_an_outside_fifo_is_never_opened(bundle_copy, tmp_path):
    path = bundle_copy(*BASE)
    outside = tmp_path / "pipe.json"
    os.mkfifo(outside)
    (path / "model.safetensors.index.json").unlink()
    (path / "model.safetensors.index.json").symlink_to(outside)
    with watched(outside) as opened:
        assert "index.path_escape" in _codes(path)
        _assert_refused(path, "index.path_escape")
    assert opened == []


def test_sidecar_linked_outside_is_reported(bundle_copy, tmp_path):
    """A symlinked mtp.safetensors leading outside was skipped with no finding."""
    path = bundle_copy(*BASE)
    outside = tmp_path / "head.safetensors"
    shutil.move(path / "mtp.safetensors", outside)
    (path / "mtp.safetensors").symlink_to(outside)
    view = open_bundle(path)
    [hit] = [f for f in view.findings if f.code == "index.path_escape"]
    assert hit.location == "mtp.safetensors" and not view.weights.sidecar
    _assert_refused(path, "index.path_escape")


def test_sidecar_linked_inside_the_bundle_is_fine(bundle_copy):
    path = bundle_copy(*BASE)
    (path / "heads").mkdir()
    shutil.move(path / "mtp.safetensors", path / "heads" / "real.safetensors")
    (path / "mtp.safetensors").symlink_to(Path("heads") / "real.safetensors")
    view = open_bundle(path)
    assert view.findings == [] and view.weights.sidecar_file == "mtp.safetensors"
    assert view.mtp.tensors


def _set_text(path: Path, **values: int) -> None:
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(values)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("key", "claim", "truth"), [
    ("num_hidden_layers", 100000, "4 layer(s)"), ("num_hidden_layers", 6, "4 layer(s)"),
    ("num_hidden_layers", 3, "layer(s) 3 beyond it"), ("hidden_size", 4096, "holds 64"),
    ("vocab_size", 10**9, "holds 512"), ("intermediate_size", 8192, "holds 128"),
    ("num_key_value_heads", 8, "holds 32")])
def test_config_contradicted_by_the_tensors(bundle_copy, key, claim, truth):
    path = bundle_copy(*BASE)
    _set_text(path, **{key: claim})
    hits = [f for f in open_bundle(path).findings if f.code == "config.weights_mismatch"]
    assert hits and hits[0].severity == "error", hits
    [hit] = [f for f in hits if f.location == f"config.json:{key}"]
    assert f"{key} = {claim}" in hit.message and truth in hit.message, hit.message


@pytest.mark.parametrize("family", ["qwen3_5_moe", "deepseek_v3"])
def test_moe_and_trunk_numbered_heads_count_right(bundle_copy, built, family):
    """DeepSeek numbers its MTP layer after the trunk's (layers.N in the HF checkpoint): not a
    trunk layer. Expert counts come from the stacked experts and the router."""
    hf = open_bundle(built(family, hf=True))
    assert not [f for f in hf.findings if f.code == "config.weights_mismatch"]
    path = bundle_copy(family, Sidecar(policy="layers"))
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    key = "num_experts" if "num_experts" in text else "n_routed_experts"
    text[key] = 64
    (path / "config.json").write_text(json.dumps(config))
    [hit] = [f for f in open_bundle(path).findings if f.code == "config.weights_mismatch"]
    assert "= 64" in hit.message and "holds 4" in hit.message


def test_generate_refuses_100000_layers_fast_in_bounded_memory(bundle_copy):
    """generate allocated 12 GB and aborted (std::bad_alloc): now one line, exit 2, at once.
    The console script runs under a wrapper that reports its child's peak memory."""
    path = bundle_copy(*BASE)
    _set_text(path, num_hidden_layers=100000)
    exe = shutil.which("mtpkit", path=os.path.dirname(sys.executable))
    wrapper = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode)")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", wrapper, exe, "generate", str(path), "Hi"],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    peak_kib, status = map(int, proc.stdout.split()[-2:])
    assert status == 2 and "error [config.weights_mismatch]" in proc.stderr, proc.stderr
    assert "100000" in proc.stderr and "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error")]) == 1
    assert peak_kib < 1_500_000, f"peak {peak_kib} KiB"
    assert elapsed < 90


def test_serve_refuses_before_loading(bundle_copy):
    """serve loads the way generate does: the same one-line refusal, before it binds a port."""
    path = bundle_copy(*BASE)
    os.mkfifo(path / "model-00009.safetensors")
    with watched(path / "model-00009.safetensors") as opened:
        result = CliRunner().invoke(main, ["serve", str(path), "--port", "0"])
    assert result.exit_code == 2 and "error [files.not_regular]" in result.output, result.output
    assert opened == []
