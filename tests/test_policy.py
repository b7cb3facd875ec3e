"""--depth auto (decoder/tuning/policy.py, decoder/tuning/costs.py): the depth that the cost table
(the curve's prior, corrected by what passes paid) and online acceptance favour, plain decoding when nothing
beats it, padding to a cheaper width, untried costs explored by optimism, and exact decoding
whatever it chooses."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mtpkit
from fixtures.decoder_models import OracleHead
from fixtures.drive import generate_ids
from mtpkit.decoder.rounds.controller import Controller
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import SamplingParams
from mtpkit.decoder.tuning import costs
from mtpkit.decoder.tuning.curve import MAX_ROWS, CostCurve
from mtpkit.decoder.tuning.policy import (
    OPTIMISM,
    CostTable,
    DepthPolicy,
    Offer,
    Tracker,
    decide,
    memory,
)

PROMPT = [5, 17, 42, 99, 7, 3]


def gpu_like() -> CostCurve:
    """A verify of T rows costs about one step (what a good GPU kernel gives)."""
    return CostCurve([1.0 + 0.03 * t for t in range(16)], plain=1.0, draft=0.02)


def cpu_like() -> CostCurve:
    """Each extra row costs most of a step (what a CPU gives)."""
    return CostCurve([1.0 + 0.8 * t for t in range(16)], plain=1.0, draft=0.1)


def trained(curve: CostCurve, rates: list[float], rounds: int = 200, depth: int = 4,
            max_depth: int = 8) -> DepthPolicy:
    """A policy that has seen `rounds` rounds at `depth` with exactly `rates` (chance that the
    first i drafts are kept)."""
    policy = DepthPolicy(curve, max_depth)
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        u = rng.random()  # one uniform: draft i is kept iff u < a_i (the a_i decrease)
        policy.record(depth, sum(1 for a in rates[:depth] if u < a))
    return policy


def test_high_acceptance_on_cheap_verify_goes_deep() -> None:
    policy = trained(gpu_like(), [0.9, 0.8, 0.7, 0.6])
    assert policy.best() >= 3
    assert policy.predicted_speedup() > 2.0


def test_low_acceptance_or_costly_verify_decodes_plainly() -> None:
    assert trained(gpu_like(), [0.0, 0.0, 0.0, 0.0]).best() == 0
    assert trained(cpu_like(), [0.3, 0.1, 0.0, 0.0]).best() == 0
    # and costly verify with a near-perfect head still speculates where it pays: 1.99 tokens
    # for 1.9 steps at depth 1
    assert trained(cpu_like(), [1.0, 1.0, 1.0, 1.0]).best() >= 1


def test_depth_follows_acceptance_as_it_changes() -> None:
    policy = trained(gpu_like(), [0.9, 0.8, 0.7, 0.6])
    deep = policy.best()
    for _ in range(200):  # the text changes: nothing is accepted any more
        policy.record(deep, 0)
    assert policy.best() == 0


def test_acceptance_estimates_are_non_increasing_and_extrapolate() -> None:
    policy = trained(gpu_like(), [0.8, 0.6], depth=2)
    a = policy.acceptance()
    assert all(x >= y for x, y in zip(a, a[1:], strict=False))
    # about the last 30 rounds weigh in: estimates within sampling noise of the truth
    assert abs(a[0] - 0.8) < 0.1 and abs(a[1] - 0.6) < 0.1
    assert a[2] == pytest.approx(a[1] * a[1] / a[0], rel=0.05)  # never tried: the last
    # conditional rate carried on


def test_a_few_rounds_that_kept_everything_do_not_promise_the_deepest_drafts() -> None:
    """Past the positions tried, the last conditional rate carries on shrunk toward PRIOR by
    the rounds behind it: three rounds that kept all three drafts promise little of an eighth,
    where two hundred promise nearly as much of a fourth as of a third."""
    few, many = Tracker(8), Tracker(8)
    for _ in range(3):
        few.record(3, 3)
    for _ in range(200):
        many.record(3, 3)
    a, b = few.estimates(), many.estimates()
    assert a[3] < 0.85 * a[2] and a[7] < 0.5 * a[2]
    assert b[3] > 0.95 * b[2]


def test_a_request_starts_from_what_its_runners_drafts_kept() -> None:
    """A runner's memory of what drafts kept is the next request's prior (two rounds' worth):
    where the last requests kept nearly every draft the next one starts deep, not at depth 1
    from PRIOR; its own rounds then outweigh it, and plain steps let the memory fade."""
    memory: dict[str, Tracker] = {}
    fresh = DepthPolicy(gpu_like(), 8, memory=memory).best()
    earlier = DepthPolicy(gpu_like(), 8, memory=memory)
    for _ in range(60):
        earlier.record(4, 4)
    later = DepthPolicy(gpu_like(), 8, memory=memory)
    assert later.acceptance() == pytest.approx(memory["head"].estimates())
    assert later.best() >= 4 > fresh
    for _ in range(30):  # this request's text is another: nothing is kept
        later.record(later.best() or 1, 0)
    assert later.acceptance()[0] < 0.1 and later.best() <= 1
    DepthPolicy(gpu_like(), 8, memory=memory).plain(400)
    assert DepthPolicy(gpu_like(), 8, memory=memory).acceptance()[0] < 0.55


def test_verify_pads_to_a_cheaper_width() -> None:
    verify = [1.0, 1.2, 1.4, 2.2, 2.6, 3.0, 3.4, 1.7] + [1.8] * 8  # 8 rows cheaper than 4-7
    curve = CostCurve(verify, plain=1.0, draft=0.0)
    assert [curve.width(t) for t in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 3, 8, 8, 8, 9]
    assert curve.round_cost(4) == pytest.approx(1.7)  # 5 rows run as 8


def test_a_written_off_head_is_tried_again_once_its_prior_would_pay() -> None:
    """Plain steps age what the rounds showed: a head that kept nothing is drafted from again
    once its faded evidence, back near the prior, would pay (a cheap verify), and never where
    even the prior would not (a dear one): no probe rule, only the estimate."""
    cheap = trained(gpu_like(), [0.0] * 4, rounds=60)
    assert cheap.best() == 0
    steps = 0
    while cheap.best() == 0 and steps < 500:
        cheap.plain()
        steps += 1
    assert 10 < steps < 200, steps
    dear = trained(cpu_like(), [0.0] * 4, rounds=60)
    for _ in range(2000):
        dear.plain()
    assert dear.best() == 0 and dear.acceptance()[0] == pytest.approx(0.5, abs=0.01)


def test_first_round_of_a_shape_is_not_counted() -> None:
    """The first round of each shape a runner runs may have compiled (a GPU traces each new
    verify width and key buffer once): the trunk says it is the first (Trunk.first_pass), and
    it is left out of the cost table; the next of that shape counts."""
    from fixtures.decoder_models import tiny_runner

    trunk = tiny_runner().trunk
    timed = replace(gpu_like(), estimate=True)
    policy = DepthPolicy(timed, 4)
    for shape in [("head", 2, 1, 256, 256), ("head", 3, 2, 256, 256), ("head", 2, 1, 512, 256)]:
        policy.observe_round(50 * policy.cost(1), 1, fresh=trunk.first_pass(shape))
    assert policy.costs.ratios == {}
    policy.observe_round(2 * policy.cost(1), 1, fresh=trunk.first_pass(("head", 2, 1, 256, 256)))
    assert list(policy.costs.ratios[(1, 2, False)]) == [pytest.approx(2.0)]


def test_rounds_dearer_than_measured_turn_the_policy_plain() -> None:
    """A measured curve says depth `deep` pays; rounds that really cost three times what it
    predicts make the shallower depths (never run, borrowing the nearest timed shape's
    correction) and then plain decoding the choice, and rounds paid as predicted bring the
    speculation back. Odd one-off rounds (a trace, a stalled host) do not move the median. A
    curve given by hand is a what-if: observations leave its prices alone."""
    timed = replace(gpu_like(), estimate=True)
    policy = trained(timed, [0.7, 0.5, 0.35, 0.25])
    deep = policy.best()
    assert deep >= 2
    predicted = policy.cost(deep)
    for _ in range(memory()):
        policy.observe_round(3 * predicted, deep)
        policy.observe_plain(1.0 * 16, 16)
    assert policy.cost(deep) == pytest.approx(3 * predicted, rel=0.1)
    assert policy.cost(1) > 2.5 * timed.round_cost(1), "the nearest timed shape's correction"
    assert policy.best() == 0
    for _ in range(memory() // 2 + 1):
        policy.observe_round(predicted, deep)
    policy.observe_round(100 * policy.cost(deep), deep)  # one outlier
    assert policy.costs.correction((1, timed.width(deep + 1), False)) == pytest.approx(1.0)
    assert policy.best() >= 2
    given = trained(gpu_like(), [0.7, 0.5, 0.35, 0.25])
    for _ in range(memory()):
        given.observe_round(3 * given.cost(deep), deep)
    assert given.costs.ratios == {} and given.best() == deep


def test_an_untimed_shape_takes_the_nearest_timed_shapes_correction() -> None:
    """What the curve misses grows with a pass's width (attention over more scores): an
    untimed depth is corrected as the nearest timed width, so a context round at depth 8 that
    paid 1.4x the curve does not price depth 2 when depth 1 paid as the curve said."""
    timed = replace(cpu_like(), verify=[1.0 + 0.1 * t for t in range(16)], estimate=True)
    policy = DepthPolicy(timed, 8, sources=("head", "lookup"))
    deep, shallow = policy.cost(8, "lookup"), policy.cost(1, "lookup")
    for _ in range(40):
        policy.observe_round(1.4 * deep, 8, "lookup")
        policy.observe_round(shallow, 1, "lookup")
    table = policy.costs
    assert table.correction((1, 9, False)) == pytest.approx(1.4, rel=0.05)
    assert table.correction((1, 3, False)) == pytest.approx(1.0)  # nearer depth 1 than 8
    assert table.correction((1, 7, False)) == pytest.approx(1.4, rel=0.05)
    assert table.correction((1, 1, True)) == pytest.approx(1.0), "plain: nothing timed piped"
    assert set(table.summary()) == {"1x2", "1x9"}


def _paid(table: CostTable, shape: tuple[int, int, bool], ratio: float, context: int = 0,
          times: int = 1) -> None:
    """`times` passes of `shape` at `context`, each paid `ratio` x the table's prior there."""
    for _ in range(times):
        table.tick(1)
        table.observe(shape, ratio * table.prior(shape, context), context)


def _long_curve() -> CostTable:
    """A table whose curve, measured at one context, prices every context alike."""
    return CostTable(CostCurve([0.010, 0.010, 0.0105, 0.011], plain=0.007, draft=0.0,
                               estimate=True))


def test_rounds_paid_at_one_context_do_not_price_another() -> None:
    """A curve measured at one context prices every context alike, so the table's corrections
    carry what a longer context costs: depth-3 rounds that paid 1.5x the curve over a long
    stretch at 16K (where they beat plain steps) must not price 64K's rounds, which pay 5x: two
    of those turn the policy plain there, while 16K keeps speculating (one median per shape
    mixed them and kept 64K speculating)."""
    table = _long_curve()
    offer = Offer(head=[0.67, 0.40, 0.27])
    d3, plain = (1, 4, False), (1, 1, True)
    for _ in range(30):
        _paid(table, d3, 1.5, 16384)
        _paid(table, plain, 1.2, 16384)
    assert decide([offer], table, 3, 16384).depth > 0
    assert decide([offer], table, 3, 65536).depth > 0, "64K untimed: 16K's price, nearest band"
    _paid(table, d3, 5, 65536, times=2)
    assert decide([offer], table, 3, 65536).depth == 0
    assert decide([offer], table, 3, 16384).depth > 0
    assert table.correction(d3, 16384) == pytest.approx(1.5, rel=0.05)
    assert table.correction(d3, 65536) > 2
    assert table.correction(plain, 65536) == pytest.approx(1.2), "plain: its nearest band"
    assert table.summary()["1x4"] == pytest.approx(table.correction(d3, 65536))


def test_plain_steps_and_verify_passes_never_price_each_other() -> None:
    """At a long context a GPU's verify passes pay about twice the curve's price (several
    query rows miss the split-key attention kernel) while plain steps pay what it says. A
    plain step never timed here is priced by the curve, not by what verify passes paid:
    priced by them, a lone auto request at 64K never took a plain step and ran at 0.31x of
    plain decoding (H200). An untimed verify pass still learns from the verify passes."""
    table = _long_curve()
    offer = Offer(head=[0.6, 0.3, 0.15])
    d3, plain = (1, 4, True), (1, 1, True)
    _paid(table, d3, 2.2, 65536, times=20)
    assert table.correction(plain, 65536) == 1.0
    assert table.correction((1, 3, True), 65536) == pytest.approx(2.2)
    assert decide([offer], table, 3, 65536, pipelined=True).depth == 0
    _paid(table, plain, 0.5, 65536)
    assert table.correction((1, 3, True), 65536) == pytest.approx(2.2)


def test_a_running_stretch_goes_on_unless_another_pays_for_its_restart() -> None:
    """Starting a pipelined stretch costs a pass built while the device idles (`restart`),
    once a stretch. A shape other than the running one pays it over the horizon (the rounds
    a settled stretch runs between two checks): of two depths timed alike, one that would
    keep 3% more is not worth a restart of two rounds over 16 (12.5% a round), where nothing
    runs it is taken, and one that keeps 19% more is worth it. (Unpriced, a lone auto
    request on the H200 left its depth every two or three rounds for another: a third of its
    time at 1K went to restarts.)"""
    table = CostTable(CostCurve([0.010] * 6, plain=0.010, draft=0.0, estimate=True))
    close, better = Offer(head=[0.9, 0.8, 0.7, 0.1]), Offer(head=[0.9, 0.8, 0.7, 0.65])
    d3, d4 = (1, 4, True), (1, 5, True)
    for _ in range(20):
        for shape in (d3, d4):
            _paid(table, shape, 1.0)
    table.observe_restart(1, 0.02)
    assert table.restart(1) == 0.02 and table.restart(2) == 0.0
    assert decide([close], table, 4, pipelined=True).depth == 4
    assert decide([close], table, 4, pipelined=True, running=d3, horizon=16).depth == 3
    assert decide([better], table, 4, pipelined=True, running=d3, horizon=16).depth == 4
    hand = CostTable(CostCurve([0.010] * 6, plain=0.010, draft=0.0))  # a what-if: as it is
    hand.observe_restart(1, 0.02)
    assert hand.restart(1) == 0.0


def test_an_untried_depth_is_explored_by_optimism_and_a_dear_price_taken_again() -> None:
    """Every shape is priced up to OPTIMISM cheaper while few timings back it: a depth that
    the curve prices near the best is tried without any exploration rule, and a depth whose
    one timing came out dear (a stalled host) is taken again once the rounds since have faded
    that timing's weight, then kept where it now pays."""
    timed = replace(gpu_like(), estimate=True)
    policy = trained(timed, [0.8, 0.6, 0.45, 0.3])
    table = policy.costs
    first = policy.choose()[1]
    assert first >= 2
    tried = []
    for _ in range(60):  # every depth costs what the curve says: the best runs most
        depth = policy.choose()[1]
        tried.append(depth)
        policy.observe_round(timed.round_cost(depth), depth)
    assert len(set(tried)) > 2, "untimed depths get their turn"
    best = max(policy.rate(d) for d in range(1, 9))
    assert sum(policy.rate(d) for d in tried) / len(tried) > 0.97 * best, "at little cost"
    never = next(d for d in range(1, 9) if d not in tried)
    untried = (1, timed.width(never + 1), False)
    assert table.pricer(untried, 0, True)(0.0) < table.seconds(untried) / (1 + 0.5 * OPTIMISM)
    # a depth that wins, timed once at 3x (a stalled host): plain steps run while that
    # timing fades, then the depth is taken again, and kept
    steep = replace(timed, verify=[1.0 + 0.3 * t for t in range(16)])
    shallow = trained(steep, [0.6, 0.1, 0.05, 0.0], depth=1)
    assert shallow.choose()[1] == 1
    shallow.observe_round(3 * shallow.cost(1), 1)
    tried = []
    for _ in range(300):
        depth = shallow.choose()[1]
        tried.append(depth)
        if depth:
            shallow.observe_round(steep.round_cost(depth), depth)
        else:
            shallow.plain()
            shallow.costs.tick(1)
            shallow.observe_plain(steep.plain, 1)
    assert tried[0] == 0 and 1 in tried, "the dear price is taken again"
    assert tried[-50:].count(1) > 25 and shallow.costs.correction((1, 2, False)) < 1.1


def test_one_policy_decides_a_lone_row_and_a_batch() -> None:
    """`decide` prices a lone row as a batch of one (its choose is that), a batch's rounds
    by the pass of its rows x positions, plain as pipelined steps of every row; each row
    drafts from its best source at the batch's depth."""
    curve = CostCurve([0.01 + 0.001 * t for t in range(16)], 0.009, 0.0005)
    policy = trained(curve, [0.8, 0.6, 0.45, 0.3])
    alone = decide([policy.offer()], policy.costs, 8)
    assert (alone.sources[0], alone.depth) == policy.choose()
    copying = Offer(context=[0.95] * 6)
    rows = [policy.offer(), policy.offer(), copying]
    plan = decide(rows, policy.costs, 8)
    assert plan.depth >= 2 and plan.sources == ("head", "head", "lookup")
    table = policy.costs
    assert table.prior((3, 4, False)) == pytest.approx(curve.verify[11])  # 12 tokens
    assert table.prior((3, 1, True)) == pytest.approx(curve.verify[2] * 0.009 / 0.01)
    assert table.prior((8, 4, False)) > curve.verify[-1], "beyond the curve: extended"
    useless = trained(curve, [0.0] * 4)
    assert decide([useless.offer()] * 3, table, 8).depth == 0


def test_context_rounds_are_timed_after_a_stretch_and_whatever_pairs_they_leave_owed() -> None:
    """A context round feeds the head nothing: the first one after a plain stretch pays no
    switch, and the pairs it leaves owed (more after every context round) do not make each a
    new shape. So context rounds are timed as they run; before, a request that drafted from
    its context after every plain stretch never corrected its context's prices."""
    from types import SimpleNamespace

    from fixtures.decoder_models import tiny_runner
    from mtpkit.decoder.options import Source
    from mtpkit.decoder.rounds.session import RoundOutcome
    from mtpkit.decoder.stats import Stats

    policy = DepthPolicy(replace(cpu_like(), estimate=True), 8, sources=("head", "lookup"))
    session = SimpleNamespace(cache=[], mtp_cache=[], stats=Stats(), trunk=tiny_runner().trunk)
    controller = Controller(session, policy)  # type: ignore[arg-type]
    cost = policy.cost(4, "lookup")
    for owed in (3, 8, 13, 18):  # each round right after a plain stretch
        controller.switched = True
        controller.update(RoundOutcome([1] * 5, 4, 4, Source.LOOKUP, 0, 6, 2 * cost, 5, owed))
    assert list(policy.costs.ratios[(1, 5, False)]) == [pytest.approx(2.0)] * 3  # 1st: shape
    controller.switched = True
    controller.update(RoundOutcome([1, 2], 1, 1, Source.HEAD, 1, 0, 9.0, 2, 30))
    assert (1, 2, False) not in policy.costs.ratios  # a head round after a stretch: the switch


def test_auto_reports_what_rounds_and_plain_stretches_paid(qwen: Runner) -> None:
    """With a measured curve each verified round and each plain stretch is timed into the
    runner's cost table (the first round after the prefill or a stretch also pays the switch
    and is left out), and the generation's statistics report the corrections in use. Here
    the curve claims rounds are nearly free: once rounds have shown what they really cost,
    the policy turns plain."""
    oracle, plain = _oracle(qwen, 3, 120)
    oracle._costs = CostCurve([1e-6] * 16, plain=1e-3, draft=0.0, estimate=True)
    # rounds really dear, whatever else runs on the machine: plain must win on what is paid
    session = Session(DearPasses(oracle.trunk), oracle.head, SamplingParams(), 8)
    policy = oracle.policy("auto", "head")[1]
    assert policy is not None and policy.costs is oracle.paid
    tokens = [t for b in generate_ids(session, PROMPT, 120, set(), Controller(session, policy))
              for t in b]
    assert tokens == plain
    table, chosen = policy.costs, policy.chosen
    rounds = [shape for shape in table.ratios if shape != (1, 1, True)]
    assert rounds and all(min(table.ratios[s]) > 100 for s in rounds)  # ms, not the curve's us
    assert (1, 1, True) in table.ratios and chosen[0] > 60
    assert sum(n for d, n in chosen.items() if d > 0) < 30
    assert set(session.stats.cost_scale) == set(table.summary())


def test_the_runner_keeps_its_cost_table_across_generations(qwen: Runner) -> None:
    """What passes paid is the machine's, not the text's: the runner's table carries from one
    generation to the next, and a new curve starts a new table. What drafts kept carries as the
    next request's prior only (its own evidence starts empty)."""
    oracle, plain = _oracle(qwen, 9, 120)
    oracle._costs = replace(gpu_like(), estimate=True)
    first = oracle.generate(PROMPT, 120, depth="auto", draft="head")
    assert first.tokens == plain
    table = oracle.paid
    assert table is not None and table.ratios
    passes = sum(table.clock.values())  # (times keeps the last memory() of each shape)
    policy = oracle.policy("auto", "head")[1]
    assert policy is not None and policy.costs is table
    remembered = oracle.kept["head"].estimates()
    assert remembered[0] > 0.6  # this oracle's drafts are mostly kept (PRIOR: 0.5)
    assert policy.acceptance() == pytest.approx(remembered)
    assert not any(policy.trackers["head"].seen)
    assert oracle.generate(PROMPT, 120, depth="auto", draft="head").tokens == plain
    assert sum(table.clock.values()) > passes
    oracle._costs = gpu_like()
    assert oracle.policy("auto", "head")[1].costs is not table  # type: ignore[union-attr]


class DearPasses:
    """A trunk whose passes over more than one token take 40 ms more (a verify pass that
    costs more per token than plain steps on any machine, however loaded)."""

    def __init__(self, trunk: Any) -> None:
        self.trunk = trunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trunk, name)

    def __call__(self, tokens: Any, cache: Any, **kwargs: Any) -> Any:
        if tokens.shape[1] > 1:
            time.sleep(0.04)
        return self.trunk(tokens, cache, **kwargs)


def _oracle(runner: Runner, wrong_every: int, n: int) -> tuple[Runner, list[int]]:
    """An oracle head over the runner's trunk, wrong at every `wrong_every`-th position (1:
    always wrong), and the plain greedy tokens it is measured against."""
    plain = Runner(runner.trunk, runner.head, None).generate(PROMPT, n, depth=0).tokens
    vocab = runner.trunk.args.vocab_size
    script = {i: (t + 1) % vocab if i % wrong_every == 0 else t
              for i, t in enumerate(PROMPT + plain)}
    return Runner(runner.trunk, OracleHead(vocab, script, len(PROMPT)), None), plain  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def qwen(built: Callable[..., Path]) -> Runner:
    return mtpkit.load(built("qwen3_5"), dtype="float32")


def test_auto_with_a_useless_head_decodes_almost_only_plainly(qwen: Runner) -> None:
    oracle, plain = _oracle(qwen, 1, 200)
    oracle._costs = cpu_like()
    result = oracle.generate(PROMPT, 200, depth="auto")
    assert result.tokens == plain
    depths = result.stats.depths
    assert depths.get(0, 0) >= 180  # plain steps: a round would not pay even at the prior
    assert sum(n for d, n in depths.items() if d > 0) <= 8
    assert all(a == 0.0 for a in result.stats.acceptance_by_depth)


def test_auto_with_a_good_head_speculates_and_stays_exact(qwen: Runner) -> None:
    oracle, plain = _oracle(qwen, 9, 200)
    oracle._costs = gpu_like()
    result = oracle.generate(PROMPT, 200, depth="auto")
    assert result.tokens == plain
    depths = result.stats.depths
    assert sum(n for d, n in depths.items() if d >= 3) >= 10
    assert depths.get(0, 0) == 0
    assert result.stats.predicted_speedup is not None and result.stats.predicted_speedup > 2.0


def test_auto_with_sampling_stays_seeded_and_in_range(qwen: Runner) -> None:
    """Sampling goes through the same acceptance rule at whatever depth the policy picks (its
    law is tested in test_exactness); here: reproducible, and plain stretches sample too."""
    qwen._costs = cpu_like()
    runs = [qwen.generate(PROMPT, 60, depth="auto", temperature=0.8, seed=7).tokens
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


def test_cost_curve_is_cached_per_bundle_and_remeasured_when_weights_change(
        built: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    bundle = tmp_path / "b"
    shutil.copytree(built("qwen3_5"), bundle)
    first = mtpkit.load(bundle, dtype="float32").costs()
    assert len(first.verify) == MAX_ROWS and all(c > 0 for c in first.verify)
    assert first.plain > 0 and first.draft > 0
    stored = list((tmp_path / "cache" / "costs").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["verify"] == first.verify

    def refuse(*a: object, **k: object) -> CostCurve:
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(costs, "measure", refuse)
    assert mtpkit.load(bundle, dtype="float32").costs().verify == first.verify
    with pytest.raises(AssertionError, match="measured again"):  # another dtype: another key
        mtpkit.load(bundle, dtype=None).costs()
    weights = sorted(bundle.glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes())  # rewritten: a new mtime
    with pytest.raises(AssertionError, match="measured again"):
        mtpkit.load(bundle, dtype="float32").costs()
