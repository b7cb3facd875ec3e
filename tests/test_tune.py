"""`mtpkit tune`: the measured cost curve (16 verify widths, plain step, head draft), the depths
--depth auto would start from, and the on-disk cache (reused; invalidated by new weights or
other load options)."""

from __future__ import annotations

import inspect
import json
import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fixtures.factory import Sidecar
from mtpkit.cli import main
from mtpkit.decoder.tuning import costs
from mtpkit.decoder.tuning.curve import CONTEXT, PAD_GAIN, CostCurve, breaks
from mtpkit.schemas import validate
from mtpkit.verify.tune import _batch_text

ROW = re.compile(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)$")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "costs"


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the real measurement (one entry per call)."""
    calls: list[int] = []
    real = costs.measure

    def counting(*args: Any, **kwargs: Any) -> CostCurve:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(costs, "measure", counting)
    return calls


def _tune(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["tune", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def _json(bundle: Path, *args: str) -> dict:
    code, out, err = _tune(str(bundle), "--json", *args)
    assert code == 0, out + err
    doc = json.loads(out)
    validate(doc, "tune")
    return doc


def test_tune_prints_sixteen_widths_and_the_picks(built: Callable[..., Path], cache: Path,
                                                  measured: list[int]) -> None:
    bundle = built("qwen3_5")
    code, out, _ = _tune(str(bundle))
    assert code == 0, out
    rows = [m.groups() for line in out.splitlines() if (m := ROW.match(line))]
    assert [int(r[0]) for r in rows] == list(range(1, 17))
    assert float(rows[0][2]) == 1.0 and all(int(w) >= int(t) for t, _, _, w in rows)
    assert "plain step" in out and "head draft step" in out and "measured now" in out
    assert re.search(r"^  measured in \d+\.\d s", out, re.M), "how it was measured: " + out
    assert len(re.findall(r"a_1 \d+%: (depth \d+|plain decoding), predicted \d+\.\d\dx", out)) == 8

    doc = _json(bundle)
    assert len(doc["verify"]) == len(doc["ratios"]) == len(doc["widths"]) == 16
    assert measured == [1] and doc["measured"] is False, "the second call reads the cache"
    assert doc["timed"][0] == 1 and doc["timed"][-1] == 16 and doc["seconds"] > 0
    assert doc["spread"] >= 1 and doc["measured_at"] > 0  # how far to trust it, printed too
    assert breaks(doc["verify"]) == [] and doc["context"] <= CONTEXT
    assert doc["ratios"][0] == 1.0 and doc["draft"] > 0 and doc["max_depth"] >= 1
    verify = doc["verify"]
    for t, w in enumerate(doc["widths"], 1):  # padded only to the cheapest width, and only
        cheapest = min(verify[t - 1:])        # where that is PAD_GAIN cheaper than t itself
        pays = cheapest < PAD_GAIN * verify[t - 1]
        if t in doc["smoothed"]:  # priced at a wider width's cost, so verified at that width
            assert w > t and verify[w - 1] == verify[t - 1]
        else:
            assert w == t if not pays else (w > t and verify[w - 1] == cheapest)
    picks = doc["picks"]
    assert [p["acceptance"] for p in picks] == [0.3, 0.5, 0.7, 0.9]
    lookups = doc["lookup_picks"]
    assert [p["acceptance"] for p in lookups] == [0.3, 0.5, 0.7, 0.9]
    for head, lookup in zip(picks, lookups, strict=True):  # free drafts: every depth is cheaper
        assert lookup["predicted_speedup"] >= head["predicted_speedup"] - 1e-9
    assert out.count("predicted") == 8 and "a context (lookup) match" in out
    assert [p["depth"] for p in picks] == sorted(p["depth"] for p in picks), "deeper when kept"
    for p in picks:
        assert p["predicted_speedup"] >= 1.0 if p["depth"] else p["predicted_speedup"] == 1.0
    stored = Path(doc["cache"])
    assert stored.parent == cache and stored.is_file()
    assert json.loads(stored.read_text())["verify"] == doc["verify"]


def test_the_cache_is_reused_and_invalidated(bundle_copy: Callable[..., Path], cache: Path,
                                             measured: list[int]) -> None:
    bundle = bundle_copy("qwen3_5")
    first = _json(bundle)
    assert first["measured"] and measured == [1]
    again = _json(bundle)
    assert not again["measured"] and measured == [1], "a cached curve is not measured again"
    assert again["verify"] == first["verify"] and again["cache"] == first["cache"]
    # every command that decodes with --depth auto reads the same cache
    result = CliRunner().invoke(main, ["generate", str(bundle), "Hi", "--raw", "--max-tokens",
                                       "4"])
    assert result.exit_code == 0 and measured == [1], result.output

    refreshed = _json(bundle, "--refresh")
    assert refreshed["measured"] and measured == [1, 1] and refreshed["cache"] == first["cache"]

    other = _json(bundle, "--dtype", "float16")  # other load options (auto is never float16)
    assert other["measured"] and measured == [1, 1, 1] and other["cache"] != first["cache"]

    weights = sorted(bundle.glob("*.safetensors"))[0]
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5 * 10**9))  # new weights
    changed = _json(bundle)
    assert changed["measured"] and measured == [1, 1, 1, 1], "changed weights are measured"
    assert changed["cache"] != first["cache"]
    assert changed["key"]["weights"] != first["key"]["weights"]
    assert _json(bundle)["measured"] is False and len(measured) == 4
    assert len(list(cache.glob("*.json"))) == 3 and not list(cache.glob("*.tmp"))


def test_a_corrupt_cache_file_is_measured_again(bundle_copy: Callable[..., Path], cache: Path,
                                                measured: list[int]) -> None:
    bundle = bundle_copy("qwen3_5")
    stored = Path(_json(bundle)["cache"])
    stored.write_text("{half a docu")
    again = _json(bundle)
    assert again["measured"] and measured == [1, 1]
    assert json.loads(stored.read_text())["verify"] == again["verify"]


def test_a_bundle_without_head_has_no_picks(built: Callable[..., Path], cache: Path) -> None:
    bundle = built("qwen3_5", sidecar=None)
    doc = _json(bundle)
    assert doc["picks"] == [] and doc["draft"] == 0 and doc["max_depth"] == 0
    assert len(doc["lookup_picks"]) == 4, "context drafts speculate without a head"
    code, out, _ = _tune(str(bundle))
    assert code == 0 and "no MTP head" in out and out.count("predicted") == 4


def test_bad_input_is_a_one_line_error(built: Callable[..., Path], tmp_path: Path,
                                       cache: Path) -> None:
    for target, error in ((tmp_path / "missing", "error [files.missing_config]"),
                          (built("qwen3_5", Sidecar(), hf=True), "error [load.not_converted]")):
        code, out, err = _tune(str(target))
        assert code == 2 and error in out + err and "Traceback" not in out + err
    code, out, err = _tune(str(tmp_path), "--dtype", "float8")
    assert code == 2 and "Invalid value for '--dtype'" in err
    help_ = CliRunner().invoke(main, ["tune", "--help"])
    assert help_.exit_code == 0 and "Examples:" in help_.output and "--refresh" in help_.output


def test_tune_times_batched_rounds_and_runners_start_from_them(built: Callable[..., Path],
                                                               cache: Path) -> None:
    """`tune --max-batch N` times every shape a batch decodes (plain steps, each depth up to
    DEEPEST) at 2..N rows through the real engine, says so as it goes, stores it beside the
    curve, and a later runner's cost table prices those shapes by them; the second call reads
    them."""
    from mtpkit.decoder.runner import load
    from mtpkit.decoder.tuning import batch_costs
    from mtpkit.verify.tune import batch_summary

    bundle = built("qwen3_5")
    code, out, err = _tune(str(bundle), "--max-batch", "3")
    assert code == 0, out + err
    assert "timing batched rounds" in err and "batch rounds: timed in" in err
    assert re.search(r"batch rounds: 3 rows, depth 1 \(\d+/\d+, \d+ s, about \d+ (?:s|min) "
                     r"left(?:, up to \d+ (?:s|min))?\)", err)  # a range where passes differ
    assert "batch rounds, ms (timed now" in out
    doc = _json(bundle, "--max-batch", "3")
    batch = doc["batch"]
    assert batch["measured"] is False and batch["max_batch"] == 3 and batch["head"] is True
    deepest = min(doc["max_depth"], batch_costs.DEEPEST)
    for rows in (2, 3):
        assert f"{rows},-1" in batch["round_ms"], batch["round_ms"]  # plain steps
        for depth in range(1, deepest + 1):  # a depth pipelined where it can be
            keys = {f"{rows},{depth}", f"{rows},{-1 - depth}"}
            assert keys & set(batch["round_ms"]), (rows, depth, batch["round_ms"])

    runner = load(bundle)
    curve = runner.costs()
    stored, _ = batch_costs.read(curve.key)
    assert len(stored[(3, -1)]) >= batch_costs.ROUNDS
    table = runner.table()
    assert set(table.seeded) == {batch_costs.shape_of(*k) for k in stored}
    assert table.ratios == {}, "nothing timed here yet"
    assert table.seconds((3, 1, True)) == pytest.approx(statistics.median(stored[(3, -1)]))
    assert re.search(r"round prices for 2, 3 rows, timed once", batch_summary(runner))
    headless = batch_summary(load(built("qwen3_5", sidecar=None)))
    assert "corrected as rounds run" in headless and "no MTP head" in headless

    code, out, err = _tune(str(bundle), "--max-batch", "0")
    assert code == 2 and "options.invalid" in out + err and "--max-batch" in out + err
    headless = built("qwen3_5", sidecar=None)
    code, out, err = _tune(str(headless), "--max-batch", "2")
    assert code == 0 and "no MTP head to time" in out


def test_an_interrupted_batch_timing_keeps_what_it_timed(built: Callable[..., Path], cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during `tune --max-batch` stores the shapes timed so far; the next tune, not
    finding the largest size, times again."""
    from collections import deque

    from mtpkit.decoder.runner import load
    from mtpkit.decoder.tuning import batch_costs

    def interrupted(runner: Any, most: int, told: Any, paid: dict, **_: Any) -> dict:
        paid[(2, -1)] = deque([0.01, 0.011, 0.012])
        raise KeyboardInterrupt

    runner = load(built("qwen3_5"))
    real = batch_costs.measure
    monkeypatch.setattr(batch_costs, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.batch_costs(4)
    key = runner.costs().key
    assert {k: list(v) for k, v in batch_costs.read(key)[0].items()} == {(2, -1): [0.01, 0.011,
                                                                                  0.012]}
    monkeypatch.setattr(batch_costs, "measure", real)
    paid, timed = runner.batch_costs(2)
    assert timed and {(2, 1), (2, -2)} & set(paid) and len(paid[(2, -1)]) > 3, \
        "timed again, not trusted"
    assert runner.batch_costs(2)[1] is False, "now complete: read back"


def test_choose_takes_the_stock_pass_only_where_it_is_clearly_faster(
        built: Callable[..., Path]) -> None:
    """Per (rows, width), plain steps and plain rounds together: the stock pass wins only
    under choose's default margin x the traced time; a traced trunk then passes that shape
    untraced, and an untimed size borrows the nearest timed size's choice (the larger on a
    tie)."""
    from collections import deque

    from mtpkit.decoder.runner import load
    from mtpkit.decoder.tuning import batch_costs

    PIPED = -1  # noqa: N806 (the stored keys: plain steps, K synchronous, -1 - K pipelined)

    def piped(depth: int) -> int:
        return -1 - depth

    assert [batch_costs.width(s) for s in (PIPED, 0, 1, 3, piped(1), piped(3))] == \
        [1, 1, 2, 4, 2, 4]
    ms = inspect.signature(batch_costs.choose).parameters["margin"].default

    def times(t: float) -> deque:
        return deque([t, t, 9.0 * t])  # a compile-slowed round: the median ignores it
    traced = {(8, PIPED): times(0.020), (8, 0): times(0.030), (8, 1): times(0.020),
              (8, piped(1)): times(0.018), (2, PIPED): times(0.010), (2, 2): times(0.010)}
    stock = {(8, PIPED): times(0.016), (8, 0): times(0.030), (8, 1): times(0.020),
             (8, piped(1)): times(0.018 * ms * 1.01), (2, PIPED): times(0.012),
             (2, 2): times(0.010 * ms * 0.99)}
    chosen = batch_costs.choose(traced, stock)
    assert chosen == {(8, 1): True, (8, 2): False, (2, 1): False, (2, 3): True}

    passes = load(built("llama")).trunk
    passes.use_traced()
    assert passes.passes is not None
    passes.passes.stock_rows = chosen
    want = {(8, 1): True, (6, 1): True, (5, 1): True, (4, 1): False, (2, 1): False,
            (16, 1): True, (8, 2): False, (3, 3): True, (8, 4): False}
    assert {k: passes.passes.prefers_stock(*k) for k in want} == want
    passes.passes.stock_everywhere = True
    assert passes.passes.prefers_stock(8, 4)


def test_a_traced_trunk_times_its_batch_passes_both_ways_and_keeps_the_faster(
        built: Callable[..., Path], cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tune --max-batch` on a traced trunk times every shape traced, then untraced; the
    stored prices of a shape whose width went stock are the untraced times, the choice is
    stored and read back by a later runner, and its batch then passes those shapes untraced
    (the traced function is never called for them) with the same tokens."""
    from mtpkit.decoder.runner import load
    from mtpkit.decoder.tuning import batch_costs

    bundle = built("mimo")
    runner = load(bundle)
    runner.trunk.use_traced()
    ways: list[dict] = []
    real_time, real_choose = batch_costs._time, batch_costs.choose

    def timing(runner: Any, sizes: list[int], paid: dict, *args: Any) -> None:
        ways.append(paid)
        real_time(runner, sizes, paid, *args)

    def chosen(traced: dict, stock: dict) -> dict:
        real = real_choose(traced, stock)
        assert (2, 1) in real and set(real) <= {(2, w) for w in range(1, 5)}, real
        return {**{k: False for k in real}, (2, 1): True}  # plain passes stock, the rest traced
    monkeypatch.setattr(batch_costs, "_time", timing)
    monkeypatch.setattr(batch_costs, "choose", chosen)
    lines: list[tuple[str, int, int]] = []
    paid, timed = runner.batch_costs(2, told=lambda *a: lines.append(a))
    assert timed and len(ways) == 2
    traced, untraced = ways
    assert paid is traced
    assert list(paid[(2, -1)]) == list(untraced[(2, -1)])  # plain steps: stock
    one = 1 if (2, 1) in paid else -2  # (a GPU times depths pipelined)
    assert list(paid[(2, one)]) != list(untraced[(2, one)])
    assert any(what.endswith("untraced") for what, _, _ in lines)
    assert lines[-1][1] == lines[-1][2] == 2 * len(batch_costs.shapes(batch_costs.deepest(runner)))
    key = runner.costs().key
    assert batch_costs.read(key)[1] == runner.trunk.passes.stock_rows
    assert runner.trunk.passes.stock_rows[(2, 1)] is True

    later = load(bundle)
    later.trunk.use_traced()
    later.costs()
    assert later.trunk.passes.stock_rows == runner.trunk.passes.stock_rows
    calls: list[tuple[int, ...]] = []
    real_rows = later.trunk.passes._rows

    def spy(tokens: Any, *args: Any) -> Any:
        calls.append(tuple(tokens.shape))
        return real_rows(tokens, *args)
    later.trunk.passes._rows = spy
    prompts = [[5, 6, 7, 8, 9], [3, 4, 5]]
    stocked = [r.tokens for _, r in _results(later.stream_batch(prompts, 6, depth=0))]
    assert calls == [], "plain passes of 2 rows went untraced"
    later.trunk.passes.stock_rows = {}
    traced_out = [r.tokens for _, r in _results(later.stream_batch(prompts, 6, depth=0))]
    assert (2, 1) in calls and traced_out == stocked

    doc = _json(bundle, "--max-batch", "2")  # (the CLI's runner is traced on a GPU only)
    doc["batch"]["untraced"] = ["2,1"]
    validate(doc, "tune")
    text = "\n".join(_batch_text(doc["batch"]))
    assert "passes faster untraced than traced here (run so): 2 rows x 1" in text


def _results(pieces: Any) -> list[tuple[int, Any]]:
    return sorted((i, p.result) for i, p in pieces if p.result is not None)
