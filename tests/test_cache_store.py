"""$MTPKIT_CACHE (decoder/tuning/store.py): every cached document is validated on read against its
schema (schemas/cache_*.schema.json), a bad one is measured again with one line on stderr
naming the file and why, and writes never follow a symlink planted at the temp or target name.
And the cost curve judged (decoder/tuning/costs.py's DRIFT): a noisy measurement says so, and a stored
curve whose plain step real decoding beats by far is marked stale and measured again.

Files read back are untrusted input: each hostile document below crashed a run, divided by
zero, or steered `--depth auto` silently before the store validated them."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import mtpkit
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.tuning import batch_costs, costs, dtypes, kernel_choice, store
from mtpkit.decoder.tuning.curve import CostCurve
from mtpkit.decoder.tuning.policy import Tracker


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MTPKIT_COST_BUDGET", "2")
    return tmp_path / "cache"


KEY = {"weights": "w", "load": {}, "backend": "cpu:", "versions": {}, "format": costs.VERSION}


def _curve_doc(**changes: Any) -> dict[str, Any]:
    curve = CostCurve([0.01 + 0.001 * t for t in range(16)], 0.009, 0.002, KEY,
                      timed=list(range(1, 17)), seconds=2.0, measured_at=1.0, load=0.5)
    return {**curve.stored(), **changes}


@pytest.mark.parametrize("bad, why", [
    ({"plain": 0}, "plain"),  # divided by zero in every policy
    ({"verify": [float("nan")] * 16}, "NaN"),  # sent auto to plain decoding
    ({"plain": float("inf")}, "Infinity"),
    ({"verify": [0.01] * 15}, "verify"),
    ({"context": "512"}, "context"),
])
def test_a_stored_curve_that_is_not_a_curve_is_measured_again(
        cache: Path, capfd: pytest.CaptureFixture[str], bad: dict[str, Any], why: str) -> None:
    path = store.cache_file(KEY)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_curve_doc(**bad)))  # (json writes NaN and Infinity unasked)
    assert costs.cached(KEY) is None
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and why in err[0]
    path.write_text(json.dumps(_curve_doc()))
    assert costs.cached(KEY) is not None and capfd.readouterr().err == ""


@pytest.mark.parametrize("text", ["[1.5]", '"fast"', "null", '{"key": "k"}',
                                  '{"key": "k", "ratio": Infinity}', '{"key": "k", "ratio": 0}'])
def test_a_dtype_probe_that_is_not_one_is_measured_again(
        cache: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        text: str) -> None:
    """Valid JSON that is not the probe's object crashed every `--dtype auto` run."""
    dtypes.cache_file().parent.mkdir(parents=True)
    dtypes.cache_file().write_text(text)
    times = iter([0.004, 0.001])
    monkeypatch.setattr(dtypes, "_time", lambda dtype: next(times))
    assert dtypes._float32_speedup() == pytest.approx(4.0)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(dtypes.cache_file()) in err[0]
    assert json.loads(dtypes.cache_file().read_text())["ratio"] == pytest.approx(4.0)


def test_a_kernel_choice_missing_a_row_count_is_timed_again(
        cache: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A stored shape without one row count raised KeyError when the choice was made."""
    key = kernel_choice.key()
    rows = {str(r): 1.0 for r in kernel_choice.ALL_ROWS}
    shapes = {"64,128,4,64,float32": {"kernel_ms": rows, "stock_ms": {**rows}}}
    path = kernel_choice._path(key)
    store.write(path, {"key": key, "shapes": shapes}, "kernels")
    assert kernel_choice._read(path, key)
    del shapes["64,128,4,64,float32"]["stock_ms"]["9"]
    path.write_text(json.dumps({"key": key, "shapes": shapes}))
    assert kernel_choice._read(path, key) == {}
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "9" in err


def test_bad_batch_prices_are_not_read(cache: Path, capfd: pytest.CaptureFixture[str]) -> None:
    batch_costs.store(KEY, {(2, 1): [0.01, 0.012]}, {(2, 2): True})
    assert batch_costs.read(KEY)[0][(2, 1)]
    path = store.batch_file(KEY)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "paid": {"2,1": [0.0]}}))
    assert batch_costs.read(KEY) == ({}, {})
    assert str(path) in capfd.readouterr().err


@pytest.mark.parametrize("planted", ["target", "temp"])
def test_a_planted_symlink_redirects_no_write(cache: Path, tmp_path: Path, planted: str) -> None:
    """A symlink at the target name is replaced, not written through; at the temp name a
    writer would once have used (`<name>.<pid>.tmp`), it is never used."""
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    path = store.cache_file(KEY)
    path.parent.mkdir(parents=True)
    link = path if planted == "target" else path.with_suffix(f".{os.getpid()}.tmp")
    link.symlink_to(victim)
    costs.store(CostCurve(**{k: v for k, v in _curve_doc().items()
                             if k not in ("ratios", "widths")}))
    assert victim.read_text() == "untouched"
    assert not path.is_symlink() and json.loads(path.read_text())["plain"] == 0.009
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp") and p != link]


def test_a_symlink_or_a_fifo_is_not_read(cache: Path, tmp_path: Path,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    path = store.cache_file(KEY)
    path.parent.mkdir(parents=True)
    elsewhere = tmp_path / "doc.json"
    elsewhere.write_text(json.dumps(_curve_doc()))
    path.symlink_to(elsewhere)
    assert costs.cached(KEY) is None
    path.unlink()
    os.mkfifo(path)  # a reader that opened it would wait forever
    assert costs.cached(KEY) is None
    assert capfd.readouterr().err.count(str(path)) == 2


# -- the curve judged --------------------------------------------------------------------------

@pytest.fixture
def runner(built: Callable[..., Path], cache: Path) -> Runner:
    return mtpkit.load(built("qwen3_5"))


def test_a_noisy_measurement_says_so_and_records_what_judges_it(
        runner: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain-step timings half of which ran on a busy machine (3x: a run and its half-run,
    `_Bench.plain_step`'s pair): the curve's spread says so (the median over the least)."""
    seen = {"plain": 0}

    def timer(kind: str, size: int, run: Callable[[], object]) -> float:
        run()
        if kind == "plain" and size > costs.PLAN.plain_warmup:
            seen["plain"] += 1
            return size * 0.01 * (3 if (seen["plain"] - 1) // 2 % 2 == 0 else 1)
        return 0.01 + 0.001 * size if kind in ("verify", "warm-up") else 0.001

    quiet = costs.measure(runner, budget_s=100.0, timer=lambda k, s, run: (
        run(), 0.01 + 0.001 * s if k in ("verify", "warm-up") else s * 0.01)[1])
    assert quiet.spread <= costs.DRIFT and costs.noisy(quiet) == ""
    curve = costs.measure(runner, budget_s=100.0, timer=timer)
    assert seen["plain"] >= 4 and curve.spread == pytest.approx(2.0)
    assert "busy machine" in costs.noisy(curve) and "2.0x" in costs.noisy(curve)
    assert curve.measured_at > 0 and (curve.load is None or curve.load >= 0)
    from mtpkit.verify.tune import progress_bar

    lines: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    show = progress_bar(Out())
    show(costs.Tick("start", "verify costs", budget_s=1.0))
    show(costs.Tick("done", "verify costs", curve=curve))
    assert sum("busy machine" in line for line in lines) == 1


@pytest.mark.parametrize("entry", ["generate", "generate_batch"])
def test_a_stored_curve_real_steps_beat_by_far_is_measured_again(
        runner: Runner, cache: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str], entry: str) -> None:
    """A curve stored while the machine was busy (its plain step 20x what steps take now): the
    first `--depth auto` generation's plain steps give it away (a lone one's, or a batch's of
    one row, as a server's lone client), one line says so, the file is marked stale, and the
    next load measures again and decides from the fresh numbers. Drafts are never kept here, so
    after the first token the generation is one plain stretch, ending it: it counts too (CI's
    machine decoded so, and the check never ran)."""
    monkeypatch.setattr(Tracker, "estimates", lambda self: [0.0] * self.size)
    measured: list[CostCurve] = []
    real = costs.measure

    def counting(*args: Any, **kwargs: Any) -> CostCurve:
        measured.append(real(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(costs, "measure", counting)
    fresh = runner.costs()
    path = store.cache_file(fresh.key)
    doc = json.loads(path.read_text())
    doctored = {**doc, "plain": 20 * doc["plain"]}
    path.write_text(json.dumps(doctored))
    capfd.readouterr()

    busy = mtpkit.load(runner.root)
    assert busy.costs().plain == doctored["plain"] and len(measured) == 1  # believed, at first
    run = (busy.generate if entry == "generate"
           else lambda p, **kw: busy.generate_batch([p], **kw)[0])
    run([3, 1, 4, 1, 5], max_tokens=12, depth="auto")
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "busy machine" in err[0], err
    assert json.loads(path.read_text())["stale"]["plain_paid"] < doctored["plain"] / costs.DRIFT
    run([2, 7, 1, 8], max_tokens=24, depth="auto")
    assert capfd.readouterr().err == ""  # said once

    again = mtpkit.load(runner.root)
    policy = again.policy("auto")[1]
    assert policy is not None and len(measured) == 2
    assert policy.curve.plain == measured[-1].plain < doctored["plain"] / costs.DRIFT
    assert "stale" not in json.loads(path.read_text())
    assert "measuring again" in capfd.readouterr().err


def test_stored_batch_prices_real_steps_beat_by_far_are_set_aside(
        runner: Runner, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """Batch prices stored while the machine was busy (`tune --max-batch`; their plain step of
    2 rows 20x what such steps take now): a batch's plain steps give it away after
    MIN_REPEATS of them, one line says so, the file is marked stale, the process prices
    batches without it (and takes plain steps again), the next read finds no prices there
    and the next tune times batches again. Drafts are never kept here, so the
    batch decodes plainly on every machine."""
    monkeypatch.setattr(Tracker, "estimates", lambda self: [0.0] * self.size)
    runner.batch_costs(2)
    key = runner.costs().key
    path = store.batch_file(key)
    doc = json.loads(path.read_text())
    doc["paid"]["2,-1"] = [20 * t for t in doc["paid"]["2,-1"]]  # (2 rows, plain, pipelined)
    path.write_text(json.dumps(doc))
    capfd.readouterr()

    busy = mtpkit.load(runner.root)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]
    busy.generate_batch(prompts, max_tokens=16, depth="auto", max_batch=2)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "busy machine" in err[0], err
    marked = json.loads(path.read_text())
    assert marked["stale"]["rows"] == 2 and marked["paid"] == doc["paid"]
    assert batch_costs.read(key) == ({}, {}) and busy.table().seeded == {}
    again = busy.generate_batch(prompts, max_tokens=16, depth="auto", max_batch=2)
    assert capfd.readouterr().err == ""  # said once
    assert all(r.stats.verify_calls < 8 for r in again)  # mostly plain steps, this process

    again = mtpkit.load(runner.root)
    paid, timed = again.batch_costs(2)
    assert timed and "stale" not in json.loads(path.read_text())
    assert paid[(2, -1)] and max(paid[(2, -1)]) < min(doc["paid"]["2,-1"]) / costs.DRIFT


def test_batch_steps_dearer_than_stored_prices_prove_nothing(
        runner: Runner, capfd: pytest.CaptureFixture[str]) -> None:
    """Load now makes a batch's steps dearer than what tune stored, and too few steps prove
    nothing either way: the store is left as it is."""
    runner.batch_costs(2)
    path = store.batch_file(runner.costs().key)
    before = path.read_text()
    table = runner.table()
    shape = (2, 1, True)
    stored = table.seconds(shape)
    for _ in range(5):
        table.observe(shape, 3 * stored)
    assert not costs.check_batch(table, shape)
    table = costs.CostTable(runner.costs())
    batch_costs.seed(table, batch_costs.read(runner.costs().key)[0])
    for _ in range(2):  # fewer than MIN_REPEATS, however cheap
        table.observe(shape, stored / 100)
    assert not costs.check_batch(table, shape)
    assert path.read_text() == before and capfd.readouterr().err == ""


def test_real_steps_dearer_than_the_curve_prove_nothing(runner: Runner,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    """Load now or a longer context makes steps dearer than a true curve: nothing is marked."""
    curve = runner.costs()
    assert not costs.check_plain(curve, 10 * curve.plain)
    assert not costs.check_plain(curve, curve.plain / 1.2)
    assert "stale" not in json.loads(store.cache_file(curve.key).read_text())
    assert capfd.readouterr().err == ""
