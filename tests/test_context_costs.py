"""Issue 49: the cost curve by context. A round's cost grows with the context, on a GPU far faster
for several verify rows than for one (an H200, 8B 4-bit: c(1) / c(2) 8.5 / 13.2 ms at 1K,
13.1 / 56.4 ms at 64K), so `tune` measures the curve at longer contexts too, the curve is priced
linearly in the context between them (extrapolated beyond, never falling), and `--depth auto`
asks it at the session's context: plain at 64K, speculation at 1K, before paying any round.

Measured times are injected through measure()'s `timer` (it learns the context from the prefill
calls), so the growth of a GPU's passes is reproduced on a CPU in seconds."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import mtpkit
from fixtures.decoder_models import tiny_runner
from mtpkit.decoder.options import Source
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.tuning import costs
from mtpkit.decoder.tuning.curve import CONTEXT, GRAIN, CostCurve, Point
from mtpkit.decoder.tuning.policy import CostTable, DepthPolicy
from mtpkit.schemas import validate
from mtpkit.verify.tune import render_text, report

MS = 1e-3
KEY = {"weights": "w", "load": {}, "backend": "cpu:", "versions": {}, "format": costs.VERSION}


def _verify(c1: float, c2: float, per_row: float) -> list[float]:
    return [c1, *(c2 + per_row * (t - 2) for t in range(2, 17))]


def h200() -> CostCurve:
    """The issue's H200 figures (ms): c(1 / 2 / 4) 8.5 / 13.2 / 15.0 at 1K, 11.5 / 24.7 / 27.4 at
    16K, 13.1 / 56.4 / 60.2 at 64K; a plain step a little under c(1)."""
    return CostCurve(_verify(8.5 * MS, 13.2 * MS, 0.9 * MS), 8.0 * MS, 0.3 * MS, context=1024,
                     longer=[Point(16384, _verify(11.5 * MS, 24.7 * MS, 1.35 * MS), 11.0 * MS),
                             Point(65536, _verify(13.1 * MS, 56.4 * MS, 1.9 * MS), 12.5 * MS)])


def test_pipelining_saves_a_verify_pass_what_it_saves_at_the_first_context() -> None:
    """Pipelining hides a pass's host part, which the context does not grow: a pipelined
    verify pass is saved the share a plain step saves at the curve's first context. At 64K
    (the H200's auto curve: c(1) 27.8 ms, c(4) 55 ms, a plain step 15 ms) a one-row verify
    pass costs twice a plain step for its attention; saved that ratio, depth 3 was priced at
    30 ms where its rounds paid 52-74. Plain steps keep their own context's price."""
    first = [8.67, 8.32, 9.34, 11.38] + [11.38 + 0.6 * t for t in range(1, 13)]
    long = [27.8, 51.1, 51.6, 55.0] + [55.0 + 0.6 * t for t in range(1, 13)]
    curve = CostCurve([v * MS for v in first], 6.65 * MS, 0.0, context=1024,
                      longer=[Point(65536, [v * MS for v in long], 15.0 * MS)])
    table = CostTable(curve)
    assert table.prior((1, 4, True), 65536) == pytest.approx(55.0 * MS * 6.65 / 8.67)
    assert table.prior((1, 4, False), 65536) == pytest.approx(55.0 * MS)
    assert table.prior((1, 1, True), 65536) == pytest.approx(15.0 * MS)
    assert table.prior((1, 4, True), 1024) == pytest.approx(11.38 * MS * 6.65 / 8.67)


def test_the_curve_is_linear_between_measured_contexts_and_extrapolated_beyond() -> None:
    curve = h200()
    assert curve.at(1024).verify == curve.verify and curve.at(1024).plain == curve.plain
    assert curve.at(16384).verify == curve.longer[0].verify and curve.at(65536).plain == 12.5 * MS
    half = curve.at(8704)  # halfway from 1K to 16K
    assert half.verify[1] == pytest.approx((13.2 + 24.7) / 2 * MS)
    assert half.plain == pytest.approx((8.0 + 11.0) / 2 * MS) and half.context == 8704
    beyond = curve.at(131072)  # the last segment's slope, on: 16K -> 64K, 64K more
    assert beyond.verify[1] == pytest.approx((56.4 + (56.4 - 24.7) * 65536 / 49152) * MS)
    assert curve.at(100).verify == curve.verify, "below the shortest: its costs"
    assert curve.at(8600) is curve.at(8704), f"priced per {GRAIN} tokens, rounded up"
    falling = CostCurve([2.0] * 16, 1.0, 0.0, context=512, longer=[Point(4096, [1.5] * 16, 0.9)])
    assert falling.at(65536).verify == [1.5] * 16, "extrapolated, never falling (noise)"
    flat = CostCurve([1.0] * 16, 1.0, 0.0)
    assert flat.at(65536) is flat, "measured at one context: priced alike at every context"


def test_auto_plays_plain_at_64k_and_speculates_at_1k_before_paying_any_round() -> None:
    policy = DepthPolicy(h200(), 8, prior=0.73)  # the oracle's first acceptance
    policy.context = 1000
    source, depth = policy.choose()
    assert source == Source.HEAD and depth >= 3, "at 1K depth 3 pays"
    policy.context = 65536
    assert policy.choose() == (None, 0), "at 64K rounds cost 4x a step: plain"
    assert policy.costs.ratios == {}, "decided from the curve alone, before any round"
    flat = DepthPolicy(CostCurve(h200().verify, 8.0 * MS, 0.3 * MS, context=1024), 8,
                       prior=0.73, context=65536)
    assert flat.choose()[1] >= 3, "a curve of one context (as before) would speculate at 64K"


def test_what_rounds_pay_corrects_the_prediction_at_their_context() -> None:
    """The cost table corrects on top: rounds at 64K that paid what the curve says there leave
    the correction at 1 (against the 1K price they would read as 4x dear)."""
    policy = DepthPolicy(replace(h200(), estimate=True), 8, context=65536)  # (as measured)
    at_64k = h200().at(65536)
    for _ in range(3):
        policy.observe_round(at_64k.round_cost(1), 1)
        policy.observe_plain(10 * at_64k.plain, 10)
    assert policy.costs.correction((1, 2, False)) == pytest.approx(1.0)
    assert policy.costs.correction((1, 1, True)) == pytest.approx(1.0)
    assert policy.cost(1) == pytest.approx(at_64k.round_cost(1))
    for _ in range(20):  # dearer than the curve at 64K: corrected
        policy.observe_round(2 * at_64k.round_cost(1), 1)
    assert policy.cost(1) == pytest.approx(2 * at_64k.round_cost(1), rel=0.15)


def _steep(per_token: float = 1e-4, calls: list[tuple[str, int]] | None = None
           ) -> costs.Timer:
    """A timer like the H200's passes, in seconds: c(1) = 10 ms + 1 ms per 1K tokens of context,
    c(T >= 2) = 9 ms + 1 ms per row + 4 ms per 1K, a plain step 9 ms + 1 ms per 1K; prefill
    `per_token`. The context is what the prefill calls have added up to."""
    state = {"context": 0}

    def timer(kind: str, size: int, run: Callable[[], object]) -> float:
        run()
        if calls is not None:
            calls.append((kind, size))
        if kind == "prefill":
            state["context"] += size
            return per_token * size
        k = state["context"] / 1000
        if kind in ("verify", "warm-up"):
            return 0.010 + 0.001 * k if size == 1 else 0.009 + 0.001 * size + 0.004 * k
        return size * (0.009 + 0.001 * k) if kind == "plain" else 0.001

    return timer


def _expected(k: float) -> list[float]:
    return [0.010 + 0.001 * k, *(0.009 + 0.001 * t + 0.004 * k for t in range(2, 17))]


@pytest.fixture
def runner(built: Callable[..., Path], tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Runner:
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    return mtpkit.load(built("qwen3_5"))  # its config: a 4,096-token context


def test_the_measurement_times_a_longer_context_and_the_curve_follows(runner: Runner) -> None:
    assert costs.contexts_for(runner, CONTEXT) == [4096 - GRAIN], "the model's, less the room"
    curve = costs.measure(runner, budget_s=60.0, timer=_steep())
    assert curve.contexts() == [CONTEXT, 3840]
    assert curve.verify == pytest.approx(_expected(0.512))
    assert curve.at(3840).verify == pytest.approx(_expected(3.84))
    assert curve.at(2048).verify == pytest.approx(_expected(2.048)), "linear in between"
    assert curve.at(2048).plain == pytest.approx(0.009 + 0.001 * 2.048)
    assert curve.longer[0].timed == list(costs.SPARSE_ROWS) and curve.longer[0].seconds > 0
    assert curve.seconds <= 60.0


def test_a_plain_step_is_priced_in_its_stretchs_stride_not_its_start(runner: Runner) -> None:
    """Each timed run of plain steps is a stretch of its own: the device idles while its first
    step is built and its first steps read slower (here 50 ms a run). A run of 8 steps at a
    longer context priced a step at 9 + 1/K ms plus 6 ms of that; a run less one of half as
    many leaves it out, at every context."""
    steep = _steep()

    def starting(kind: str, size: int, run: Callable[[], object]) -> float:
        return steep(kind, size, run) + (0.05 if kind == "plain" else 0.0)

    curve = costs.measure(runner, budget_s=60.0, timer=starting)
    assert curve.contexts() == [CONTEXT, 3840]
    assert curve.plain == pytest.approx(0.009 + 0.001 * 0.512)
    assert curve.at(3840).plain == pytest.approx(0.009 + 0.001 * 3.84)


def test_a_tight_budget_measures_a_shorter_context_or_none(runner: Runner) -> None:
    """Prefill at 4 ms a token (3840 tokens: 15 s): the cache is prefilled on while the next
    chunk and the passes after it fit, and the context reached is measured; with less, none."""
    calls: list[tuple[str, int]] = []
    curve = costs.measure(runner, budget_s=12.0, timer=_steep(4e-3, calls))
    (point,) = curve.longer
    assert costs.FARTHER * CONTEXT <= point.context < 3840 and point.context % costs.CHUNK == 0
    assert curve.at(point.context).verify == pytest.approx(_expected(point.context / 1000))
    assert curve.seconds <= 12.0 * (1 + costs.RETRY_SHARE)
    assert max(size for kind, size in calls if kind == "prefill") <= costs.CHUNK
    assert costs.measure(runner, budget_s=3.0, timer=_steep(4e-3)).longer == []


def test_a_first_prefill_that_compiles_does_not_price_the_context_down(runner: Runner) -> None:
    """A cold GPU process compiles every kernel in its first pass (seconds), and again for each
    new shape: taken for the prefill rate, the 64-token probe would measure the curve at 64
    tokens and none longer, so `--depth auto` would price 16K and 64K rounds as at 64 (one more
    warm piece alone reaches 448 here). Each piece says what the next costs."""
    steep, compiles = _steep(), [5.0, 0.6]  # the first two prefill pieces' set-up, in seconds

    def cold(kind: str, size: int, run: Callable[[], object]) -> float:
        took = steep(kind, size, run)
        return took + compiles.pop(0) if kind == "prefill" and compiles else took

    curve = costs.measure(runner, budget_s=20.0, timer=cold)
    assert curve.contexts() == [CONTEXT, 3840]
    assert curve.verify == pytest.approx(_expected(0.512))


def test_each_new_prefill_shape_compiling_does_not_price_the_context_down(
        runner: Runner) -> None:
    """On a GPU every new piece size compiles its kernels (seconds) the first time, the first
    pass of a process everything: a piece timed cold priced the curve at 128 tokens on the H200
    and none longer. A pair's second piece of each size is timed warm and prices the next."""
    steep, seen = _steep(), set()

    def compiling(kind: str, size: int, run: Callable[[], object]) -> float:
        took = steep(kind, size, run)
        if kind != "prefill":
            return took
        fresh = not seen or size not in seen
        seen.add(size if seen else -1)  # (the first pass's shape is its own)
        return took + 3.0 * fresh

    curve = costs.measure(runner, budget_s=40.0, timer=compiling)
    assert curve.context == CONTEXT and curve.contexts()[0] == CONTEXT, curve.contexts()
    assert curve.verify == pytest.approx(_expected(0.512))


def test_the_store_keeps_the_contexts_and_refuses_a_tampered_curve(
        cache: Path, capfd: pytest.CaptureFixture[str]) -> None:
    curve = replace(h200(), key=KEY, estimate=True, timed=[1, 16])
    path = costs.store(curve)
    back = costs.cached(KEY)
    assert back is not None and back.longer == curve.longer and back.contexts() == [1024, 16384,
                                                                                  65536]
    assert back.at(40000).verify == curve.at(40000).verify
    good = json.loads(path.read_text())
    bad: list[dict[str, Any]] = [
        {**good, "longer": [{**good["longer"][0], "verify": [0.01] * 15}]},  # a row short
        {**good, "longer": [{**good["longer"][0], "plain": 0}]},  # divided by zero
        {**good, "longer": good["longer"][::-1]},  # contexts out of order
        {k: v for k, v in good.items() if k != "longer"}]  # as format 3 wrote it
    for doc in bad:
        path.write_text(json.dumps(doc))
        assert costs.cached(KEY) is None
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0] and "measuring again" in err[0], err


def test_a_tampered_stored_curve_is_measured_again(runner: Runner,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner.root is not None
    key = costs.cache_key(runner.root, runner.load_options)
    stored = costs.store(replace(h200(), key=key, timed=[1, 16]))
    doc = json.loads(stored.read_text())
    doc["longer"][1]["context"] = 1.5  # not a context
    stored.write_text(json.dumps(doc))
    measured: list[int] = []
    monkeypatch.setattr(costs, "measure", lambda *a, **k: measured.append(1) or h200())
    assert runner.costs().contexts() == [1024, 16384, 65536] and measured == [1]
    assert json.loads(stored.read_text())["longer"][1]["context"] == 65536, "and replaced"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _steep_tiny() -> CostCurve:
    """Cheap rounds at the first 256 tokens; at 2,048 every multi-row pass costs 6 steps."""
    return CostCurve([1.0 + 0.03 * t for t in range(16)], 1.0, 0.02, context=256,
                     longer=[Point(2048, [1.2] + [6.0 + 0.03 * t for t in range(1, 16)], 1.2)])


def test_a_session_is_priced_at_its_own_context() -> None:
    """The controller asks the curve at the session's cache length: a 3,000-token prompt
    decodes plainly from its first token, an 8-token one speculates; a policy that ignored the
    context would speculate on both."""
    runner = tiny_runner()
    runner._costs = _steep_tiny()  # given by hand: taken as it is, no calibration
    short = runner.generate([1, 2, 3, 4, 5, 1, 2, 3], 12, depth="auto")
    long = runner.generate([(7 * i) % 6 for i in range(3000)], 12, depth="auto")
    assert any(d > 0 for d in short.stats.depths), short.stats.depths
    assert set(long.stats.depths) == {0}, long.stats.depths


def test_tune_shows_the_cost_by_context(runner: Runner) -> None:
    assert runner.root is not None
    runner._costs = CostCurve(_verify(0.010, 0.011, 0.001), 0.009, 0.001,
                              costs.cache_key(runner.root, runner.load_options),
                              longer=[Point(2048, _verify(0.012, 0.030, 0.002), 0.010)])
    doc = report(runner, "b")
    validate(doc, "tune")
    assert [(r["context"], r["measured"]) for r in doc["by_context"]] == [
        (CONTEXT, True), (2048, True), (4096, False)], "and the model's longest, extrapolated"
    at_long = doc["by_context"][-1]
    assert at_long["verify"][1] == pytest.approx(0.030 + (0.030 - 0.011) * 2048 / 1536)
    assert at_long["picks"][-1]["depth"] < doc["by_context"][0]["picks"][-1]["depth"]
    text = render_text(doc)
    assert "by context, as --depth auto prices a round there" in text
    assert "      4096*" in text and "       512 " in text


def test_rounds_are_compared_with_their_context_s_price() -> None:
    """The rounds of a 3,000-token prompt are predicted at 3,000 tokens: their paid ratio is
    near 1 (a tiny model's round on a loaded CPU may take a few times the 15 ms priced), not
    the ratio to a round at the curve's first context (10,000x here)."""
    runner = tiny_runner()
    runner._costs = CostCurve([1e-6] * 16, 1e-6, 1e-7, context=256, estimate=True,
                              longer=[Point(2048, [1e-2] * 16, 1e-2)])
    runner.generate([(7 * i) % 6 for i in range(3000)], 40, depth="auto")
    assert runner.paid is not None and runner.paid.ratios
    assert all(max(r) < 1000 for r in runner.paid.ratios.values()), runner.paid.ratios


def test_the_longer_contexts_first_piece_compiling_does_not_price_them_out(
        runner: Runner) -> None:
    """The way on to a longer context prefills in CHUNK-token pieces, a size the first context
    never used: on a GPU its first piece compiles (seconds). Taken for the prefill rate, it
    priced the rest of the way past the budget, and a cold process measured no longer context
    (the H200's 4K and 16K). That piece prices nothing; the next, warm, does."""
    steep, seen = _steep(), set()

    def compiling(kind: str, size: int, run: Callable[[], object]) -> float:
        took = steep(kind, size, run)
        if kind != "prefill" or size in seen:
            return took
        seen.add(size)
        return took + 3.0

    curve = costs.measure(runner, budget_s=20.0, timer=compiling)
    assert curve.contexts() == [CONTEXT, 3840]
    assert curve.at(3840).verify == pytest.approx(_expected(3.84))
