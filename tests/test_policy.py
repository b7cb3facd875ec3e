"""--depth auto (decoder/policy.py, decoder/costs.py): the depth that measured costs and online
acceptance favour, plain decoding when nothing beats it, padding to a cheaper width, and exact
decoding whatever it chooses."""

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
from mtpkit.decoder import costs
from mtpkit.decoder.controller import Controller
from mtpkit.decoder.curve import MAX_ROWS, CostCurve
from mtpkit.decoder.policy import (
    CALIBRATE,
    MAX_STRETCH,
    MIN_OBSERVED,
    MIN_STRETCH,
    PROBE_SHARE,
    WINDOW,
    DepthPolicy,
)
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import SamplingParams
from mtpkit.decoder.session import Session, generate_ids

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


def test_verify_pads_to_a_cheaper_width() -> None:
    verify = [1.0, 1.2, 1.4, 2.2, 2.6, 3.0, 3.4, 1.7] + [1.8] * 8  # 8 rows cheaper than 4-7
    curve = CostCurve(verify, plain=1.0, draft=0.0)
    assert [curve.width(t) for t in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 3, 8, 8, 8, 9]
    assert curve.round_cost(4) == pytest.approx(1.7)  # 5 rows run as 8


def test_plain_stretches_double_up_to_the_cap() -> None:
    policy = DepthPolicy(cpu_like(), 4)
    stretches = [policy.plain_stretch() for _ in range(8)]
    assert stretches[0] == MIN_STRETCH and stretches[-1] == MAX_STRETCH
    assert all(b == min(2 * a, MAX_STRETCH) for a, b in zip(stretches, stretches[1:], strict=False))
    policy.reset_stretch()
    assert policy.plain_stretch() == MIN_STRETCH


def test_dear_probes_stretch_the_plain_stretches() -> None:
    """A probe costing three plain steps beyond its one token makes every stretch long enough
    for that to be PROBE_SHARE of it (capped at MAX_STRETCH); cheap probes leave the doubling
    from MIN_STRETCH alone; one outlier among them does not move it; a hand-given curve keeps
    its stretches."""
    timed = replace(cpu_like(), estimate=True)
    cheap = DepthPolicy(timed, 4)
    for _ in range(2):
        cheap.observe_probe(1.05 * timed.plain, 1)
    cheap.observe_probe(1e6 * timed.plain, 1)  # one outlier
    assert cheap.plain_stretch() == MIN_STRETCH
    dear = DepthPolicy(timed, 4)
    dear.observe_probe(4.0 * timed.plain, 1)
    want = round(3.0 / PROBE_SHARE)
    assert MIN_STRETCH < want < MAX_STRETCH
    # 16, 32, ..., 256 are raised to `want`; the doubling goes on above it
    assert [dear.plain_stretch() for _ in range(6)] == [want] * 5 + [MAX_STRETCH]
    dear.observe_probe(100.0 * timed.plain, 1)
    dear.observe_probe(100.0 * timed.plain, 1)
    dear.reset_stretch()
    assert dear.plain_stretch() == MAX_STRETCH
    given = DepthPolicy(cpu_like(), 4)
    given.observe_probe(100.0, 1)
    assert given.plain_stretch() == MIN_STRETCH


def test_first_round_of_a_shape_is_not_counted() -> None:
    """The first round of each shape a runner runs may have compiled (a GPU traces each new
    verify width and key buffer once): it is left out of the paid costs; the next is counted."""
    timed = replace(gpu_like(), estimate=True)
    policy = DepthPolicy(timed, 4)
    for shape in [("head", 2, 1, 256, 256), ("head", 3, 2, 256, 256), ("head", 2, 1, 512, 256)]:
        policy.observe_round(50 * policy.cost(1), 1, shape=shape)
    assert "head" not in policy.paid.ratios
    policy.observe_round(2 * policy.cost(1), 1, shape=("head", 2, 1, 256, 256))
    assert list(policy.paid.ratios["head"]) == [pytest.approx(2.0)]


def test_rounds_dearer_than_measured_turn_the_policy_plain() -> None:
    """A measured curve says depth 3 pays (1.5x at 70%); rounds that really cost three times
    what it predicts (at every depth, once tried) make plain decoding the choice, and rounds
    paid as predicted bring the speculation back. Odd one-off rounds (a trace, a stalled
    host) do not move the median. A curve given by hand is a what-if: observations leave it
    alone."""
    timed = replace(gpu_like(), estimate=True)
    policy = trained(timed, [0.7, 0.5, 0.35, 0.25])
    deep = policy.best()
    assert deep >= 2
    policy.observe_round(3 * policy.cost(deep), deep)
    assert policy.paid.scale("head") == 1.0  # one round is not enough to go on
    for _ in range(WINDOW):
        policy.observe_round(3 * policy.cost(deep), deep)
        policy.observe_plain(1.0 * 16, 16)
    assert policy.paid.scale("head") == pytest.approx(3.0)
    # a shallower depth, not run yet, is priced between plain steps' ratio and depth `deep`'s:
    # tried, it pays as dear, and plain decoding is the choice
    assert 0 < policy.best() < deep
    for _ in range(WINDOW):
        for depth in range(1, deep):
            policy.observe_round(3 * policy.cost(depth), depth)
    assert policy.best() == 0
    for _ in range(WINDOW // 2 + 1):
        policy.observe_round(policy.cost(deep), deep)
    policy.observe_round(100 * policy.cost(deep), deep)  # one outlier
    assert policy.paid.scale("head") == pytest.approx(1.0) and policy.best() == deep
    assert policy.paid.scale("lookup") == policy.paid.scale("head")  # unseen: all rounds'
    for _ in range(WINDOW):  # plain steps dearer than measured favour speculation further
        policy.observe_plain(2.0 * 16, 16)
    assert policy.rate(0) == pytest.approx(0.5)
    given = trained(gpu_like(), [0.7, 0.5, 0.35, 0.25])
    for _ in range(WINDOW):
        given.observe_round(3 * given.cost(deep), deep)
    assert given.paid.scale("head") == 1.0 and given.best() == deep


def test_deep_rounds_paying_more_than_the_curve_do_not_price_the_shallow_ones() -> None:
    """Each depth is scaled by what rounds of that depth paid: context rounds at depth 8 paying
    1.4x the curve (attention over a longer context than the curve's) leave a depth-2 context
    round, never run yet, priced between plain steps' ratio and theirs, so a long match that
    pays at depth 2 is taken; once depth-2 rounds have paid, their own ratio prices them. One
    scale per source priced depth 2 at 1.4x too and decoded plain (the one-at-a-time
    requests of 2026-11-27, d46e577:, plain for 181 of 190 rounds)."""
    timed = replace(cpu_like(), verify=[1.0 + 0.1 * t for t in range(16)], estimate=True)
    policy = DepthPolicy(timed, 8, sources=("head", "lookup"))
    for _ in range(WINDOW):
        policy.observe_round(1.4 * policy.cost(8, "lookup"), 8, "lookup")
        policy.observe_plain(0.8 * 16, 16)
    assert policy.paid.scale("lookup", 8) == pytest.approx(1.4)
    assert policy.paid.scale("lookup", 2) == pytest.approx(0.8 + 0.6 * 2 / 8)
    assert policy.paid.scale("lookup", 12) == pytest.approx(1.4)  # beyond: the deepest's
    assert policy.paid.scale("lookup") == pytest.approx(1.4)  # the source's, for reports
    # a new generation: its long-match tracker starts from the prior (0.5); at 1.4x depth 2
    # loses to plain steps, at its interpolated scale it wins
    fresh = DepthPolicy(timed, 8, sources=("head", "lookup"), paid=policy.paid)
    a = fresh.acceptance("lookup", 6)
    for depth in (1, 2):
        pooled = (1 + sum(a[:depth])) / (fresh.cost(depth, "lookup") * 1.4)
        assert pooled < fresh.rate(0) < fresh.rate(depth, a, "lookup")
    assert fresh.choose(lookup_width=2, match=6)[0] == "lookup"
    for _ in range(MIN_OBSERVED):
        policy.observe_round(1.6 * policy.cost(2, "lookup"), 2, "lookup")
    assert policy.paid.scale("lookup", 2) == pytest.approx(1.6)
    assert policy.paid.scale("lookup", 5) == pytest.approx(1.5)  # between two timed depths
    assert policy.paid.scale("head", 1) == policy.paid.scale("head")  # no head depth timed


def test_context_rounds_are_timed_after_a_stretch_and_whatever_pairs_they_leave_owed() -> None:
    """A context round feeds the head nothing: the first one after a plain stretch pays no
    switch, and the pairs it leaves owed (more after every context round) do not make each a
    new shape. So context rounds are timed as they run; before, a request that drafted from
    its context after every plain stretch never corrected its context scale."""
    from types import SimpleNamespace

    from mtpkit.decoder.options import Source
    from mtpkit.decoder.session import RoundOutcome
    from mtpkit.decoder.stats import Stats

    policy = DepthPolicy(replace(cpu_like(), estimate=True), 8, sources=("head", "lookup"))
    session = SimpleNamespace(cache=[], mtp_cache=[], stats=Stats())
    controller = Controller(session, policy)  # type: ignore[arg-type]
    cost = policy.cost(4, "lookup")
    for owed in (3, 8, 13, 18):  # each round right after a plain stretch
        controller.switched = True
        controller.update(RoundOutcome([1] * 5, 4, 4, Source.LOOKUP, 0, 6, 2 * cost, 5, owed))
    assert list(policy.paid.by_depth[("lookup", 4)]) == [pytest.approx(2.0)] * 3  # 1st: shape
    controller.switched = True
    controller.update(RoundOutcome([1, 2], 1, 1, Source.HEAD, 1, 0, 9.0, 2, 30))
    assert "head" not in policy.paid.ratios  # a head round after a stretch paid the switch


def test_auto_reports_what_rounds_and_plain_stretches_paid(qwen: Runner) -> None:
    """With a measured curve each verified round and each plain stretch is timed into the
    policy (the window keeps the last WINDOW; the first round after the prefill or a stretch
    also pays the switch and is left out), and the generation's statistics report the scales
    in use. Here the curve claims rounds are nearly free: once three rounds have shown what
    they really cost, the policy turns plain."""
    oracle, plain = _oracle(qwen, 3, 120)
    oracle._costs = CostCurve([1e-6] * 16, plain=1e-3, draft=0.0, estimate=True)
    # rounds really dear, whatever else runs on the machine: plain must win on what is paid
    session = Session(DearPasses(oracle.trunk), oracle.head, SamplingParams(), 8)
    policy = oracle.policy("auto", "head")[1]
    assert policy is not None
    tokens = [t for b in generate_ids(session, PROMPT, 120, set(), Controller(session, policy))
              for t in b]
    assert tokens == plain
    paid, chosen = policy.paid.ratios, policy.chosen
    rounds = sum(n for d, n in chosen.items() if d > 0)
    shapes = policy.paid.shapes  # the first round of each is left out too
    assert shapes and MIN_OBSERVED <= len(paid["head"]) <= min(rounds - 1 - len(shapes), WINDOW)
    assert min(paid["head"]) > 100  # real rounds take milliseconds, not the curve's 1 us
    assert "plain" in paid and chosen[0] > 60  # calibrated, then mostly plain
    assert set(session.stats.cost_scale) == set(paid)


def test_probes_are_timed_and_kept_per_runner(qwen: Runner) -> None:
    """With a head that drafts nothing useful, each probe after a plain stretch is timed into
    the runner's paid costs, and the next generation's first stretch is as long as they ask."""
    oracle, plain = _oracle(qwen, 1, MAX_STRETCH + 48)
    oracle._costs = replace(cpu_like(), estimate=True)
    first = oracle.generate(PROMPT, 200, depth="auto")
    assert first.tokens == plain[:200]
    probes = len(oracle.paid.probes)
    assert 1 <= probes <= sum(n for d, n in first.stats.depths.items() if d > 0)
    policy = oracle.policy("auto", "head")[1]
    stretch = policy.plain_stretch()
    assert stretch == max(MIN_STRETCH, min(oracle.paid.probe_stretch(), MAX_STRETCH))
    # long enough to pass the first stretch whatever it is here (a GPU's plain steps are far
    # cheaper than the curve claims, so its probes ask for hundreds of tokens)
    second = oracle.generate(PROMPT, stretch + 40, depth="auto")
    assert second.tokens == plain[:stretch + 40]
    assert len(oracle.paid.probes) > probes


def test_plain_decoding_is_timed_once_per_runner(qwen: Runner) -> None:
    """On a measured curve the runner's first auto generation starts with CALIBRATE plain
    steps (plain decoding timed as paid); the runner keeps what it paid, so the next
    generation's policy starts from it and does not calibrate again. A hand-given curve never
    calibrates."""
    oracle, plain = _oracle(qwen, 9, 40)
    oracle._costs = replace(gpu_like(), estimate=True)
    pieces = list(oracle.stream(PROMPT, 40, depth="auto", draft="head"))
    result = pieces[-1].result
    assert result is not None and result.tokens == plain
    assert [len(p.tokens) for p in pieces[1:1 + CALIBRATE]] == [1] * CALIBRATE
    assert result.stats.depths.get(0, 0) >= CALIBRATE and "plain" in result.stats.cost_scale
    assert oracle.paid.timed("plain")
    assert oracle.policy("auto", "head")[1].calibration() == 0
    assert oracle.generate(PROMPT, 40, depth="auto", draft="head").tokens == plain
    given = Runner(oracle.trunk, oracle.head, None)
    given._costs = gpu_like()
    assert given.policy("auto", "head")[1].calibration() == 0


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
    assert depths.get(0, 0) >= 180  # plain steps; probes are rare and back off
    assert sum(n for d, n in depths.items() if d > 0) <= 8
    assert result.stats.acceptance_by_depth[0] == 0.0


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
