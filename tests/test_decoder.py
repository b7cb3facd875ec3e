"""The reference decoder: greedy identity, exact distributions, exact rollback, API and stats."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler
from scipy.stats import chisquare

import mtpkit
from fixtures.breaker import BREAKERS
from fixtures.decoder_models import BatchOracleHead, OracleHead, tiny_runner
from fixtures.factory import Sidecar
from fixtures.laws import exact_joint, pvalue
from fixtures.numerics import RTOL, assert_close, break_products_over, difference, host
from mtpkit.decoder.drafters import misses
from mtpkit.decoder.model.rows import FEW_ROWS, FewRowsLinear, use_few_rows_linears
from mtpkit.decoder.rounds import acceptance
from mtpkit.decoder.rounds import batch as batch_engine
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import Candidates, SamplingParams, candidates, probabilities
from mtpkit.loaders.findings import UserError

MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "mimo")
PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def runners(built: Callable[..., Path]) -> Callable[[str], Runner]:
    """float32 runners over the 4-bit fixture bundles (see load's docstring for why float32)."""
    cache: dict[str, Runner] = {}

    def get(family: str) -> Runner:
        if family not in cache:
            cache[family] = mtpkit.load(built(family), dtype="float32")
        return cache[family]

    return get


def _no_eos(runner: Runner) -> Runner:
    """The runner without its tokenizer: token-id prompts, and no EOS to stop at. Where a
    backend's rounding takes greedy decoding of these random fixtures (which do emit their EOS id)
    is not what these tests are about; every run goes to its max_tokens."""
    return Runner(runner.trunk, runner.head, None)


# -- numerics --------------------------------------------------------------------------------

def test_float32_matmuls_run_in_float32() -> None:
    """The float32 comparisons below hold only if float32 products are float32 on the default
    device, for one row (plain steps) and for several (verify passes): fixtures/numerics.py turns
    off the TF32 tensor-core path MLX's GPU backends take by default. Bound: recursive float32
    summation of K=128 products errs by at most ~(K+1) * 2**-24 = 7.7e-6 of sum |a||b|; TF32's
    10-bit inputs err by ~1e-4 of it here (an order of magnitude above the bound, at least)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    w = rng.standard_normal((512, 128)).astype(np.float32)  # as nn.Linear stores it: x @ w.T
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    for rows in (1, 2, 5, 64):
        got = np.array(mx.array(x[:rows]) @ mx.array(w).T).astype(np.float64)
        err = float(np.max(np.abs(got - exact[:rows]) / bound[:rows]))
        assert err < 129 * 2.0**-24, (
            f"{rows}-row float32 matmul on {mx.default_device()} errs by {err:.2g} of sum |a||b|: "
            "it runs at reduced precision (TF32); MLX_ENABLE_TF32 must be 0 before MLX's first "
            f"matmul (it is {os.environ.get('MLX_ENABLE_TF32')!r})")


# -- greedy identity -------------------------------------------------------------------------

@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_greedy_identity_every_depth(runners: Callable[[str], Runner], family: str) -> None:
    runner = _no_eos(runners(family))
    plain = runner.generate(PROMPT, 64, depth=0)
    assert len(plain.tokens) == 64 and plain.finish_reason == "length"
    assert plain.stats.verify_calls == 0
    for depth in (1, 2, 3, 4):
        spec = runner.generate(PROMPT, 64, depth=depth)
        assert spec.tokens == plain.tokens, (family, depth)
        stats = spec.stats
        assert stats.verify_calls > 0 and len(stats.acceptance_by_depth) == depth
        assert stats.proposed[0] == stats.verify_calls
        assert stats.bonus + stats.corrections == stats.verify_calls


def _plain_greedy(runner: Runner, ids: list[int], n: int) -> list[int]:
    tokens = _no_eos(runner).generate(ids, n, depth=0).tokens
    assert len(tokens) == n
    return tokens


@pytest.mark.parametrize("family,ahead", [("qwen3_5", False), ("llama", False), ("llama", True)])
def test_long_generation_with_acceptance_is_identical(runners: Callable[[str], Runner],
                                                      built: Callable[..., Path], family: str,
                                                      ahead: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An oracle drafter that is right most of the time (wrong every 7th position): long runs
    with accepted drafts, bonus tokens and rejections at every depth still match plain greedy.
    `ahead`: rounds pipelined as on a GPU, where a lone fixed-depth request is a batch of one."""
    monkeypatch.setattr(batch_engine, "overlaps", lambda: ahead)
    runner = runners(family) if family != "llama" else mtpkit.load(built("llama"), dtype="float32")
    plain = _plain_greedy(runner, PROMPT, 300)
    seq = PROMPT + plain
    vocab = runner.trunk.args.vocab_size
    # keyed by (position, the token before it): a fixed depth may decode as a batch of one
    # (a GPU's pipelined rounds), whose head passes carry rows
    script = {(i, seq[i - 1]): (seq[i] + 1) % vocab if i % 7 == 0 else seq[i]
              for i in range(len(PROMPT) + 1, len(seq))}
    oracle = Runner(runner.trunk, BatchOracleHead(vocab, script), None)  # type: ignore[arg-type]
    for depth in (1, 3, 4):
        spec = oracle.generate(PROMPT, 300, depth=depth)
        assert spec.tokens == plain
        assert spec.stats.bonus > 0 and spec.stats.corrections > 0
        assert 0.5 < spec.stats.acceptance_by_depth[0] < 1.0


def test_a_long_prompts_head_pairs_are_fed_a_prefill_chunk_at_a_time() -> None:
    """The head is fed a prompt's (hidden, token) pairs PREFILL_STEP at a time, each chunk
    evaluated before the next, as the trunk's prefill is: one pass over every pair holds its
    intermediates for all of them at once. What feeding a prompt three chunks long holds
    beyond what it keeps stays near what one chunk's does."""
    from mtpkit.decoder.rounds.session import PREFILL_STEP

    runner = tiny_runner(vocab=6, hidden=64)

    def held(n: int) -> int:
        session = Session(runner.trunk, runner.head, SamplingParams(), 3)
        session.owed = (mx.random.normal((1, n, 64)), mx.zeros((1, n), mx.int32))
        mx.eval(session.owed)
        mx.reset_peak_memory()
        session.feed_head(n - 1)
        mx.eval([c.state for c in session.mtp_cache])
        return mx.get_peak_memory() - mx.get_active_memory()

    one, three = held(PREFILL_STEP), held(3 * PREFILL_STEP)
    assert three < 1.5 * one, (one, three)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_finished_generation_frees_its_caches_without_the_cycle_collector(
        ahead: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """No reference cycle keeps a finished generation's session (and its caches) alive: with
    Python's cyclic collector off, none is left after it returns, on its own session or as a
    batch of one (`ahead`: rounds pipelined, as on a GPU). A proposer held its session
    strongly, and a 64K prompt's keys outlived its request until the collector ran."""
    import gc

    from mtpkit.decoder.tuning.curve import CostCurve

    monkeypatch.setattr(batch_engine, "overlaps", lambda: ahead)
    runner = tiny_runner(vocab=6)
    runner._costs = CostCurve([0.01 * (1 + t) for t in range(16)], 0.011, 0.004)  # not timed
    gc.collect()
    gc.disable()
    try:
        for options in ({"depth": 3}, {"depth": 3, "draft": "both"}, {"depth": "auto"},
                        {"depth": 0}):
            runner.generate([1, 2, 3, 4, 5] * 20, 24, **options)
            assert not [o for o in gc.get_objects() if type(o) is Session], options
    finally:
        gc.enable()


# -- rollback --------------------------------------------------------------------------------

ROLLBACK_FAMILIES = ("qwen3_5", "qwen3_next", "llama")


@pytest.fixture(scope="module")
def rollback_runners(built: Callable[..., Path]) -> Callable[[str], Runner]:
    """float32 runners whose GatedDeltaNet layers remember. Their per-token decay is
    exp(-exp(A_log) * softplus(a + dt_bias)): the fixtures' dt_bias 1 (with A in 1-16) keeps
    under 0.27 of the state per token, so a rejected token's trace left under the replayed ones
    (a replay over a recurrent state that was not restored) fades to as little as 1.2e-5 of the
    state's magnitude, at the float32 tolerance; dt_bias -5 keeps 0.90-0.99 per token, and the
    same wrong rollback moves the state by 0.5 to 1.2 of its magnitude (measured on CPU). The
    rollback must hold for any weights."""
    cache: dict[str, Runner] = {}

    def get(family: str) -> Runner:
        if family not in cache:
            runner = mtpkit.load(built(family), dtype="float32")
            slow = [m for _, m in runner.trunk.inner.named_modules() if "dt_bias" in m]
            assert bool(slow) == (family != "llama")
            for m in slow:
                m.dt_bias = mx.full(m.dt_bias.shape, -5.0, m.dt_bias.dtype)
            mx.eval(runner.trunk.model.parameters())
            cache[family] = runner
        return cache[family]

    return get


def _plain_state(runner: Runner, tokens: list[int]) -> list:
    """The trunk cache after a plain decode fed `tokens`: prompt in one pass, then one by one."""
    cache = runner.trunk.make_cache()
    runner.trunk(mx.array([PROMPT]), cache, logits_for=0)
    for t in tokens[len(PROMPT):]:
        runner.trunk(mx.array([[t]]), cache, logits_for=0)
    mx.eval([c.state for c in cache])
    return cache


def _state_arrays(cache: list) -> list[tuple[str, mx.array]]:
    """(name, array) of every cache: KV entries up to the offset, recurrent (conv, state)."""
    out = []
    for i, c in enumerate(cache):
        if isinstance(c, KVCache):
            out += [(f"layer {i} keys", c.keys[..., :c.offset, :]),
                    (f"layer {i} values", c.values[..., :c.offset, :])]
        else:
            out += [(f"layer {i} recurrent {j}", x) for j, x in enumerate(c.cache)]
    return out


def _assert_same_state(got: list, want: list) -> None:
    """Same offsets, and every array equal to float32 rounding (fixtures/numerics.py: 1e-5 of
    its magnitude). The reference steps one token at a time while the session ran multi-row
    verify passes (and replays): on CPU the two agree bit for bit; a GPU's multi-row products
    round differently, and a perturbation of 1e-6 (relative) of every multi-row linear output
    moves these states by at most ~6e-6 of their magnitude (1e-7: ~1.5e-6). Wrong rollbacks move
    them by 0.3 to 1.7 of it, over 1e4 times the tolerance (measured: committing the recorded
    state of a rejected position, or replaying the kept tokens over a recurrent state that was
    not restored; see rollback_runners and
    test_a_rejected_token_left_in_the_state_is_far_outside_the_tolerance); a KV cache that
    keeps a rejected entry fails on its offset."""
    for a, b in zip(got, want, strict=True):
        if isinstance(a, KVCache):
            assert a.offset == b.offset
    for (name, x), (_, y) in zip(_state_arrays(got), _state_arrays(want), strict=True):
        assert_close(x, y, name)


@pytest.mark.parametrize("family", ROLLBACK_FAMILIES)
@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
@pytest.mark.parametrize("rollback", ["record", "replay"])
def test_rollback_state_equals_plain_decode(rollback_runners: Callable[[str], Runner],
                                            family: str, reject_at: int, rollback: str) -> None:
    """Reject draft `reject_at` of 3 (3 = all kept, bonus) in each of several rounds; the trunk
    state (KV caches and GatedDeltaNet conv/recurrent states) equals a plain decode's, whether
    recorded during verify or restored and replayed."""
    runner = rollback_runners(family)
    plain = _plain_greedy(runner, PROMPT, 40)
    seq = PROMPT + plain
    vocab = runner.trunk.args.vocab_size
    script = {i: t for i, t in enumerate(seq)}
    session = Session(runner.trunk, OracleHead(vocab, script, len(PROMPT)),  # type: ignore[arg-type]
                      SamplingParams(), 3, rollback=rollback)
    assert bool(session.recorders) == (rollback == "record" and family != "llama")
    committed = [*PROMPT, session.start(PROMPT)]
    for _ in range(4):
        position = len(committed) + reject_at
        script[position] = (seq[position] + 1) % vocab  # the draft there will be wrong
        got = session.round(session.head_draft(3)).committed
        assert len(got) == reject_at + 1
        committed += got
        assert committed == seq[:len(committed)]
        _assert_same_state(session.cache, _plain_state(runner, committed[:-1]))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_rejected_token_left_in_the_state_is_far_outside_the_tolerance(
        rollback_runners: Callable[[str], Runner], family: str) -> None:
    """The power of the rollback comparison, measured on this backend: a GatedDeltaNet state
    that kept a rejected token (on top of the kept ones, or under the last one, as a replay over
    an unrestored state leaves it) differs from the right state by over 1e3 times the float32
    tolerance in every conv and recurrent array (measured on CPU: 0.28 to 1.4 of the magnitude)."""
    runner = rollback_runners(family)
    seq = PROMPT + _plain_greedy(runner, PROMPT, 12)
    rejected = (seq[-1] + 1) % runner.trunk.args.vocab_size
    right = _state_arrays(_plain_state(runner, seq))
    for wrong_tokens in ([*seq, rejected], [*seq[:-1], rejected, seq[-1]]):
        wrong = _state_arrays(_plain_state(runner, wrong_tokens))
        gaps = [(name, difference(x, y)) for (name, x), (_, y) in zip(wrong, right, strict=True)
                if "recurrent" in name]
        assert len(gaps) == 4 and min(g for _, g in gaps) > 1e3 * RTOL[mx.float32], gaps


def test_mtp_cache_holds_exactly_the_committed_pairs(runners: Callable[[str], Runner]) -> None:
    """The head's KV cache equals a fresh head pass over (trunk hidden_i, token_i+1) pairs of the
    committed text: chained draft entries never survive a round."""
    runner = runners("qwen3_5")
    session = Session(runner.trunk, runner.head, SamplingParams(), 3)
    seq = [*PROMPT, session.start(PROMPT)]
    for _ in range(12):
        seq += session.round(session.head_draft(3)).committed
    assert runner.head is not None
    n = session.mtp_cache[0].offset
    hidden, _ = runner.trunk(mx.array([seq[:n]]), runner.trunk.make_cache(), logits_for=0)
    fresh = runner.head.make_cache()
    runner.head(hidden, mx.array([seq[1:n + 1]]), fresh, 0)
    assert session.owed is not None and n + session.owed[1].shape[1] == len(seq) - 1
    for name, x, y in (("keys", session.mtp_cache[0].keys, fresh[0].keys),
                       ("values", session.mtp_cache[0].values, fresh[0].values)):
        assert_close(x[..., :n, :], y[..., :n, :], f"head cache {name}")


# -- exact distributions ---------------------------------------------------------------------

V = 5
TINY_PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny() -> Runner:
    return tiny_runner(vocab=V)


def _chi_square(runner: Runner, params: SamplingParams, depth: int, runs: int) -> float:
    exact = exact_joint(runner, params, TINY_PROMPT, V)
    seen = Counter(tuple(runner.generate(TINY_PROMPT, 3, depth=depth, seed=s,
                                         temperature=params.temperature, top_p=params.top_p,
                                         top_k=params.top_k, min_p=params.min_p).tokens)
                   for s in range(runs))
    impossible = sum(c for k, c in seen.items() if exact.get(k, 0.0) == 0.0)
    assert impossible == 0, "a token the filters remove was emitted"
    return pvalue(seen, exact)


def test_plain_sampling_has_the_target_distribution(tiny: Runner) -> None:
    assert _chi_square(tiny, SamplingParams(0.7, top_k=3), depth=0, runs=1200) > 1e-3


def rule_outputs(q: Candidates, p: Candidates, trials: int, seed: int = 0) -> list[list[int]]:
    """The emitted tokens of `trials` rounds of the device rule: drafts drawn from q's rows,
    then kept or corrected against p's (evaluated in blocks: one host read per block)."""
    key, out, block = mx.random.key(seed), [], []
    for i in range(trials):
        key, draft_key, rule_key = mx.random.split(key, 3)
        drafts = q.draw(mx.random.uniform(shape=q.probs.shape, key=draft_key))
        noise = mx.random.uniform(shape=(q.probs.shape[0] + p.width,), key=rule_key)
        block.append(mx.concatenate([drafts, acceptance.accept_sampled(drafts, q, p, noise)]))
        if len(block) == 2000 or i == trials - 1:
            for *drafts_, kept, token in mx.stack(block).tolist():
                out.append([*drafts_[:kept], token])
            block = []
    return out


def test_acceptance_rule_emits_the_target_law() -> None:
    """The rule alone, 20k trials on random p and q (dense rows, and the same laws as sparse
    candidate rows with padding): the first emitted token follows p_1 and the second (after an
    accepted first draft) follows p_2."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(4), size=3).astype(np.float32)
    q = rng.dirichlet(np.ones(4) * 0.5, size=2).astype(np.float32)
    p, q = p / p.sum(axis=1, keepdims=True), q / q.sum(axis=1, keepdims=True)
    order = np.array([[2, 0, 3, 1, -1]] * 3, dtype=np.int32)  # a padded column of id -1
    sparse_p = np.concatenate([p[:, [2, 0, 3, 1]], np.zeros((3, 1), np.float32)], axis=1)
    layouts = {"dense": (Candidates(mx.array(q)), Candidates(mx.array(p))),
               "sparse": (Candidates(mx.array(q[:, [1, 3, 0, 2]]), mx.array([[1, 3, 0, 2]] * 2)),
                          Candidates(mx.array(sparse_p), mx.array(order)))}
    for layout, (cq, cp) in layouts.items():
        first, second = Counter(), Counter()
        for out in rule_outputs(cq, cp, 20000):
            first[out[0]] += 1
            if len(out) > 1:
                second[out[1]] += 1
        for counts, law in ((first, p[0]), (second, p[1])):
            total = sum(counts.values())
            expected = law.astype(np.float64) / law.astype(np.float64).sum() * total
            assert chisquare([counts[i] for i in range(4)], expected).pvalue > 1e-3, layout


# mlx-lm's filters composed every way they can be, at a vocabulary where a partial selection
# differs from a sort, on logits sharp enough for top-p and min-p to cut inside the top k
FILTER_SETTINGS = (SamplingParams(0.6, top_p=0.95, top_k=20), SamplingParams(0.8, top_k=4),
                   SamplingParams(1.2, top_p=0.7), SamplingParams(1.0, min_p=0.2),
                   SamplingParams(0.6, top_p=0.9, top_k=3),
                   SamplingParams(0.7, top_p=0.5, top_k=50, min_p=0.1),
                   SamplingParams(1.0, top_p=0.6, top_k=20), SamplingParams(0.9, top_k=2000))


def dense(c: Candidates) -> np.ndarray:
    if c.ids is None:
        return np.array(c.probs)
    rows, probs, ids = np.zeros((c.probs.shape[0], 40000)), np.array(c.probs), np.array(c.ids)
    for r in range(rows.shape[0]):
        np.add.at(rows[r], ids[r][ids[r] >= 0], probs[r][ids[r] >= 0])
    return rows


@pytest.mark.parametrize("params", FILTER_SETTINGS, ids=str)
def test_candidates_are_mlx_lm_law(params: SamplingParams) -> None:
    """The decoder's device law (`candidates`, a partial selection where a top-k allows it)
    equals the reference chain of mlx-lm's own filters on every row, at scales where top-p and
    min-p keep 1 to hundreds of tokens, ties included."""
    rng = np.random.default_rng(7)
    for scale in (0.5, 3.0, 8.0):
        logits = rng.normal(size=(6, 40000)).astype(np.float32) * scale
        logits[5, :30] = logits[5].max() + 1.0  # 30 tied leaders
        law = probabilities(mx.array(logits), params)
        np.testing.assert_allclose(dense(candidates(mx.array(logits), params)), law,
                                   rtol=2e-5, atol=2e-6, err_msg=f"scale {scale}")  # float32


def test_processed_distribution_matches_mlx_lm_sampler() -> None:
    """Our p/q are mlx-lm's: 40k draws from make_sampler agree with `probabilities`."""
    logits = mx.array([[2.0, 1.5, 0.3, -0.4, 1.1, -2.0, 0.9, 0.0]])
    for params in (SamplingParams(0.8, top_k=4), SamplingParams(1.2, top_p=0.7),
                   SamplingParams(1.0, min_p=0.2), SamplingParams(0.6, top_p=0.9, top_k=3)):
        sampler = make_sampler(params.temperature, params.top_p if params.top_p < 1 else 0.0,
                               params.min_p, top_k=params.top_k)
        mx.random.seed(1)
        batch = mx.broadcast_to(logits - mx.logsumexp(logits, axis=-1, keepdims=True), (40000, 8))
        draws = np.bincount(np.array(sampler(batch)), minlength=8)
        law = probabilities(logits, params)[0]
        assert draws[law == 0].sum() == 0
        keep = law > 0
        assert chisquare(draws[keep], law[keep] * 40000).pvalue > 1e-3


def test_greedy_acceptance_keeps_only_argmax_matches() -> None:
    def rule(drafts: list[int], targets: list[int]) -> list[int]:
        return acceptance.accept_greedy(mx.array(drafts), mx.array(targets)).tolist()

    assert rule([3, 4, 5], [3, 4, 9, 1]) == [2, 9]
    assert rule([3, 4], [3, 4, 8]) == [2, 8]
    assert rule([1], [2, 0]) == [0, 2]
    assert rule([], [6]) == [0, 6]


# -- API, stats, errors ----------------------------------------------------------------------

def test_seeded_runs_are_reproducible(tiny: Runner) -> None:
    a = tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=2, seed=7).tokens
    assert a == tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=2, seed=7).tokens
    assert a != tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=2, seed=8).tokens
    b = tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=0, seed=7).tokens
    assert b == tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=0, seed=7).tokens


def test_a_generations_peak_memory_covers_its_prefill() -> None:
    """The peak a generation reports includes its prompt's prefill (Runner.stream runs the
    scheduler, which resets the peak once a prefill is done so a batch's mates do not count it:
    the prefilled request keeps it)."""
    runner = tiny_runner(vocab=512, hidden=64)
    prompt = [(7 * i + 3) % 512 for i in range(1500)]
    session = Session(runner.trunk, runner.head, SamplingParams(), 0)
    mx.eval(runner.trunk.model.parameters())
    mx.clear_cache()
    mx.reset_peak_memory()
    session.start(prompt)
    prefill = mx.get_peak_memory()
    del session
    mx.clear_cache()
    for depth in (0, 2):
        result = runner.generate(prompt, 3, depth=depth)
        assert result.stats.peak_memory_bytes >= 0.9 * prefill, (depth, prefill)


def test_text_chat_stream_and_stats(built: Callable[..., Path]) -> None:
    runner = mtpkit.load(built("qwen3_5"))
    assert runner.tokenizer is not None
    # Where this random model would emit its EOS depends on the backend's rounding (the bundle's
    # own dtype here): without one, every run is 24 tokens (test_eos_stops_and_is_not_returned
    # covers stopping).
    runner.tokenizer.eos_token_ids = set()
    result = runner.generate("Hello there", 24, depth=2)
    assert len(result.tokens) == 24 and result.finish_reason == "length"
    pieces = list(runner.stream("Hello there", 24, depth=2))
    assert "".join(p.text for p in pieces) == result.text
    assert sum(len(p.tokens) for p in pieces) == len(result.tokens)
    assert pieces[-1].result is not None and pieces[-1].result.tokens == result.tokens
    stats = result.stats.to_dict()
    assert stats["generated_tokens"] == len(result.tokens)
    assert stats["ttft_s"] > 0 and stats["prefill_tps"] > 0 and stats["peak_memory_bytes"] > 0
    assert stats["decode_tps"] > 0 and len(stats["acceptance_by_depth"]) == 2
    messages = [{"role": "user", "content": "Hi"}]
    chat = runner.generate(messages, 8, depth=1)
    assert chat.stats.prompt_tokens == len(runner.encode(messages)) > 2


def test_eos_stops_and_is_not_returned(tiny: Runner) -> None:
    plain = tiny.generate(TINY_PROMPT, 30, depth=0).tokens
    stop_token = plain[5]
    tiny.tokenizer = type("T", (), {"eos_token_ids": {stop_token}, "detokenizer": None,
                                     "decode": lambda self, ids: ""})()
    try:
        for depth in (0, 2):
            out = tiny.generate(TINY_PROMPT, 30, depth=depth)
            assert out.tokens == plain[:plain.index(stop_token)]
            assert out.finish_reason == "stop"
    finally:
        tiny.tokenizer = None


def test_load_refuses_what_it_cannot_run(built: Callable[..., Path],
                                         bundle_copy: Callable[..., Path]) -> None:
    with pytest.raises(UserError) as hf:
        mtpkit.load(built("qwen3_5", hf=True))
    assert hf.value.code == "load.not_converted"
    broken = bundle_copy("qwen3_5")
    BREAKERS["mtp.incomplete"][0](broken)
    with pytest.raises(UserError) as bad:
        mtpkit.load(broken)
    assert bad.value.code == "mtp.incomplete"
    with pytest.raises(UserError) as headless:  # lookup drafting needs none
        mtpkit.load(built("llama")).generate(PROMPT, 4, depth=1, draft="head")
    assert headless.value.code == "options.no_head"
    assert str(headless.value) == 'draft "head" drafts with an MTP head; this model has none'
    for bad, option in ({"depth": 17}, "depth"), ({"draft": "Head"}, "draft"), (
            {"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), (
            {"top_k": 2.5}, "top_k"), ({"min_p": float("nan")}, "min_p"), ({"seed": "1"}, "seed"):
        with pytest.raises(UserError) as err:  # checked before any model work
            mtpkit.load(built("llama")).generate(PROMPT, 4, **bad)
        assert err.value.code == "options.invalid" and str(err.value).startswith(option), bad


def test_delta_sidecar_norms_load_like_absolute(built: Callable[..., Path]) -> None:
    """A sidecar with zero-centred norms declared delta drafts exactly like the absolute one."""
    absolute = mtpkit.load(built("qwen3_5"), dtype="float32")
    delta = mtpkit.load(built("qwen3_5", Sidecar(norms="delta")), dtype="float32")
    a = absolute.generate(PROMPT, 24, depth=3)
    b = delta.generate(PROMPT, 24, depth=3)
    assert a.tokens == b.tokens and a.stats.accepted == b.stats.accepted


def test_layers_mlx_multiplies_wrongly_load_dequantized(built: Callable[..., Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where MLX's quantized matmul is wrong for several rows of a 64-feature input (as MLX's
    CUDA op is), a bundle kept quantized loads those layers dequantized: its logits are the
    right ones (each such weight rounded to bf16 once more, through every layer: a few times
    the dtype's rounding, where the wrong op gives NaN) and MTP keeps the trunk's argmax."""
    bundle = built("qwen3_5")
    ids = mx.array([PROMPT])
    right = mtpkit.load(bundle, dequantize=False)
    _, want = right.trunk(ids, right.trunk.make_cache())
    break_products_over(monkeypatch, right.trunk.args.hidden_size)
    repaired = mtpkit.load(bundle, dequantize=False)
    _, got = repaired.trunk(ids, repaired.trunk.make_cache())
    assert want.dtype == mx.bfloat16 and difference(got, want) <= 10 * RTOL[mx.bfloat16]
    packed = [sum(isinstance(m, nn.QuantizedLinear) for _, m in r.trunk.text.named_modules())
              for r in (right, repaired)]
    assert packed[0] > packed[1] > 0  # the 128-feature inputs stay quantized
    # Each token depth 2 keeps is the trunk's argmax over its prefix, up to bf16's rounding (a
    # 3-row verify pass and a 1-row step may round a near-tie apart on a GPU); NaN fails here.
    tokens = repaired.generate(PROMPT, 24, depth=2).tokens
    _, forced = repaired.trunk(mx.array([PROMPT + tokens]), repaired.trunk.make_cache())
    rows = host(forced[0, len(PROMPT) - 1:-1])
    best, kept = rows.max(axis=-1), rows[np.arange(len(tokens)), tokens]
    assert np.all(best - kept <= 2 * RTOL[mx.bfloat16] * np.abs(rows).max()), (best - kept)


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_trunk_logits_equal_mlx_lm_model(runners: Callable[[str], Runner], family: str) -> None:
    """The wrapper adds nothing: its logits are the mlx-lm model's own, for every family (the
    same graph on the default device, compared to the rounding of the logits' dtype)."""
    trunk = runners(family).trunk
    ids = mx.array([PROMPT])
    _, ours = trunk(ids, trunk.make_cache())
    theirs = trunk.model(ids, cache=trunk.make_cache())
    assert ours is not None and ours.shape == theirs.shape == (1, len(PROMPT), trunk.args.vocab_size)
    assert_close(ours, theirs, f"{family} logits")


def test_contract_override_is_applied(built: Callable[..., Path]) -> None:
    default = mtpkit.load(built("qwen3_5"), dtype="float32")
    swapped = mtpkit.load(built("qwen3_5"), dtype="float32", concat_order="hidden_first",
                          hidden_feed="pre_norm")
    assert swapped.head is not None and swapped.head.contract.concat_order == "hidden_first"
    hidden, _ = swapped.trunk(mx.array([PROMPT]), swapped.trunk.make_cache())
    post, _ = default.trunk(mx.array([PROMPT]), default.trunk.make_cache())
    assert_close(swapped.trunk.inner.norm.norm(hidden), post, "post-norm hidden")
    assert swapped.generate(PROMPT, 16, depth=2).tokens == default.generate(PROMPT, 16,
                                                                             depth=0).tokens
    with pytest.raises(ValueError):
        mtpkit.load(built("qwen3_5"), concat_order="sideways")


def test_blas_detection_tells_reference_from_optimized(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from mtpkit.decoder.model import blas
    from mtpkit.decoder.model.blas import loaded_blas, note

    # Optimized when preloaded or when importing mtpkit (conftest does it first) loaded one.
    loaded = blas.LOADING is not None and blas.LOADING.path is not None
    expected = "optimized" if "openblas" in os.environ.get("LD_PRELOAD", "") or loaded \
        else "reference"
    assert loaded_blas() == expected and (note() is None) == (expected == "optimized")
    openblas = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
    if openblas.exists():  # where an optimized BLAS is installed, preloading it is detected
        code = ("import mlx.core as mx; from mtpkit.decoder.model.blas import loaded_blas; "
                "print(loaded_blas())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "LD_PRELOAD": str(openblas)}, check=True)
        assert out.stdout.strip() == "optimized"


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 40])
def test_few_rows_linear_computes_what_nn_linear_computes(rows: int) -> None:
    mx.random.seed(rows)
    stock = nn.Linear(96, 160, bias=True)
    model = nn.Sequential(nn.Linear(96, 160, bias=True), nn.ReLU())
    model.layers[0].update(stock.parameters())
    assert use_few_rows_linears(model) == 1 and isinstance(model.layers[0], FewRowsLinear)
    x = mx.random.normal((1, rows, 96))
    want, got = stock(x), model.layers[0](x)
    if 1 < rows <= FEW_ROWS:  # a different product, the same numbers
        assert mx.allclose(want, got, rtol=1e-5, atol=1e-5)
    else:  # one row and long inputs run mlx-lm's own graph, bit for bit
        assert mx.array_equal(want, got)
    assert mx.allclose(model(x), nn.relu(want), rtol=1e-5, atol=1e-5)


def test_few_rows_linear_leaves_a_batch_of_sequences_to_nn_linear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Weight-first, B sequences would be B products each reading the whole matrix (a batched
    CPU verify pass of 4 x 4 rows took 3x a plain step of 4): only one sequence's rows go
    weight-first; a batch's run nn.Linear's own graph, bit for bit."""
    mx.random.seed(0)
    stock = nn.Linear(96, 160, bias=True)
    few = FewRowsLinear(stock)
    stock_calls: list[tuple[int, ...]] = []
    real = nn.Linear.__call__

    def spy(self: nn.Linear, x: mx.array) -> mx.array:
        stock_calls.append(tuple(x.shape))
        return real(self, x)

    monkeypatch.setattr(nn.Linear, "__call__", spy)
    one, batch = mx.random.normal((1, 4, 96)), mx.random.normal((4, 2, 96))
    assert mx.allclose(few(one), real(stock, one), rtol=1e-5, atol=1e-5) and stock_calls == []
    assert mx.array_equal(few(batch), real(stock, batch)) and stock_calls == [(4, 2, 96)]


def test_load_multiplies_verify_rows_weight_first_on_cpu_only(
        runners: Callable[[str], Runner]) -> None:
    """load swaps the trunk layers' and the head's float linears for FewRowsLinear on MLX's CPU
    backend (an OpenBLAS cost, decoder/model/rows.py), and on no other backend."""
    runner = runners("qwen3_5")
    assert runner.head is not None
    linears = [m for _, m in runner.trunk.inner.named_modules() if isinstance(m, nn.Linear)]
    head_fc = runner.head.roles[0].fc
    assert linears and isinstance(head_fc, nn.Linear)
    if mx.default_device().type == mx.DeviceType.cpu:
        assert all(isinstance(m, FewRowsLinear) for m in linears)
        assert isinstance(head_fc, FewRowsLinear)
    else:
        assert not any(isinstance(m, FewRowsLinear) for m in linears)
        assert not isinstance(head_fc, FewRowsLinear)


def test_lookup_finds_the_latest_earlier_occurrence() -> None:
    def lookup(seq: list[int], end: int) -> int | None:
        source = misses.lookup_sources(seq)[end]
        return seq[source] if source >= 0 else None

    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert lookup(seq, len(seq)) == 5  # the later "1 2 3" was followed by 5, not 4
    assert lookup(seq, 8) == 4
    assert lookup(seq, 3) is None  # too short to hold an earlier occurrence
    assert lookup([1, 2, 3, 8, 8, 2, 3], 7) is None  # "8 2 3" never occurred before


def test_misses_are_classified_by_what_could_have_drafted_them() -> None:
    # a loop: positions 7 and 8 repeat what followed "10 11 12" / "11 12 13" before; 6 and 3
    # have no earlier occurrence of their three tokens; 99 breaks the loop and cannot be drafted
    seq = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 99]
    rounds = [(7, True), (8, False), (6, False), (11, False), (3, True)]
    counts = misses.classify(seq, rounds, draft_vocab={10, 11, 12, 13})
    assert counts == Counter(accepted_copyable=1, missed_copyable=1, missed_other=1,
                             missed_out_of_vocab=1, accepted_other=1)
    # without a draft vocabulary an unreachable token is just another miss
    assert misses.classify(seq, [(11, False)])["missed_other"] == 1


@pytest.mark.parametrize("policy", ["layers", "all"])
def test_a_quantized_router_in_the_sidecar_loads_and_drafts_like_the_float_one(
        built: Callable[..., Path], policy: str) -> None:
    """DeepSeek-V3's MoE router (mlx-lm's MoEGate) has no quantized form: a sidecar whose
    policy quantized it raised "Unable to quantize model of type MoEGate" in load. It is
    dequantized at load; its drafts then track the float head's within 4-bit error, and the
    greedy tokens stay plain decoding's."""
    runner = mtpkit.load(built("deepseek_v3", Sidecar(policy=policy)), dtype="float32")
    gate = runner.head.layers[0].mlp.gate
    assert not isinstance(gate, nn.QuantizedLinear) and gate.weight.dtype != mx.uint32
    plain = runner.generate("def f(x):", 24, depth=0)
    assert runner.generate("def f(x):", 24, depth=2).tokens == plain.tokens


def test_a_pipelined_step_and_its_input_are_made_on_the_decode_stream() -> None:
    """Every op of a plain step, the next step's input included, is made on the decode stream
    (session.STREAM): an input made on the default stream made each step wait across streams
    (on MLX's CUDA backend a fifth of a plain step's speed: docs/long-context.md). Session's and
    Batch's plain steps both run through `pipelined`, which owns the stream."""
    from mtpkit.decoder.rounds.session import STREAM, pipelined

    with mx.stream(STREAM):
        decode = str(mx.default_stream(mx.default_device()))  # (streams compare by identity)
    outside = str(mx.default_stream(mx.default_device()))
    assert decode != outside
    made: list[tuple[str, str]] = []

    def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
        made.append(("step", str(mx.default_stream(mx.default_device()))))
        return tokens, tokens + 1

    def follow(picks: mx.array) -> mx.array:
        made.append(("follow", str(mx.default_stream(mx.default_device()))))
        return picks[None]

    def take(hidden: mx.array, picks: mx.array) -> int:
        made.append(("take", str(mx.default_stream(mx.default_device()))))
        return int(picks.reshape(-1)[0].item())

    for ahead in (True, False):
        made.clear()
        got = [t for _, t, _ in pipelined(step, mx.array([[1]]), follow, 4, take, ahead=ahead)]
        assert got == [2, 3, 4, 5]
        assert {s for kind, s in made if kind != "take"} == {decode}, made
        assert [kind for kind, _ in made].count("follow") == 3


def test_a_pipelined_step_pays_the_consumers_time_it_ran_beside() -> None:
    """A step queued before the last read runs on the device while the consumer works, so
    what it paid is the time from read to read, the consumer's included (a consumer slower
    than the device sets the pace: --depth auto priced pipelined shapes at a tenth of what
    they took when this was left out). A step not queued ahead ran after the consumer was
    done: its seconds leave the consumer out. What is yielded is the run's mean so far: a
    read that waits for more than its own step (here `take` stalls on every other step) makes
    the next one free, and neither is what a step costs."""
    import time

    from mtpkit.decoder.rounds.session import pipelined

    def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
        return tokens, tokens + 1

    def take(hidden: mx.array, picks: mx.array) -> int:
        return int(picks.reshape(-1)[0].item())

    consumer = 0.05
    for ahead in (True, False):
        paid = []
        for _, _, seconds in pipelined(step, mx.array([[1]]), lambda p: p[None], 4, take,
                                       ahead=ahead):
            paid.append(seconds)
            time.sleep(consumer)
        if ahead:  # three of the four steps ran beside a consumer
            assert paid[-1] * 4 >= 3 * consumer, paid
        else:
            assert paid[-1] < consumer / 4, paid

    def stalling(hidden: mx.array, picks: mx.array) -> int:
        token = take(hidden, picks)
        time.sleep(0.04 if token % 2 == 0 else 0.0)  # steps 1, 3: 0.04 s; steps 2, 4: none
        return token

    paid = [s for _, _, s in pipelined(step, mx.array([[1]]), lambda p: p[None], 4, stalling)]
    assert all(s >= 0.015 for s in paid[1:]), paid  # (each step's own: 0.04, 0, 0.04, 0)


def test_a_pipelined_step_is_not_priced_at_its_shapes_compile() -> None:
    """The first pass of a shape may compile as it is queued (host time, once per shape:
    `fresh` says so): the steps are priced without what that queueing took beyond the usual,
    queued ahead or not, whether the first step compiled or one in the middle of the run.
    Only a first step not queued ahead is read before any usual time is known."""
    import time

    from mtpkit.decoder.rounds.session import pipelined

    def run(ahead: bool, compiles: int) -> list[float]:
        queued = [0]

        def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
            queued[0] += 1
            time.sleep(0.2 if queued[0] == compiles else 0.0)
            return tokens, tokens + 1

        return [s for _, _, s in pipelined(
            step, mx.array([[1]]), lambda p: p[None], 5,
            lambda h, p: int(p.reshape(-1)[0].item()), ahead=ahead,
            fresh=lambda: lambda: queued[0] == compiles)]

    for ahead in (True, False):
        for compiles in (1, 3):
            paid = run(ahead, compiles)
            judged = paid if ahead or compiles > 1 else paid[1:]
            assert len(paid) == 5 and max(judged) < 0.05, (ahead, compiles, paid)


def test_a_pipelined_stretch_is_priced_at_its_steps_not_its_restart() -> None:
    """Queued ahead, a stretch's first step is built while the device idles (a restart, paid
    once a stretch): what a step costs is read from when the first is queued. Here building
    the first step stalls 0.1 s and every step after is free; counted in the mean, a stretch
    of two steps read 0.05 s a step, and auto took plain for dear after a short stretch. Not
    queued ahead (a CPU), every step is built after the last is read, and the first's
    building is its own cost, as every other's is."""
    import time

    from mtpkit.decoder.rounds.session import StretchClock, pipelined

    def run(ahead: bool, count: int, clock: StretchClock | None = None,
            compiles: bool = False) -> list[float]:
        built = [0]

        def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
            built[0] += 1
            time.sleep(0.1 if built[0] == 1 else 0.0)
            return tokens, tokens + 1

        return [s for _, _, s in pipelined(
            step, mx.array([[1]]), lambda p: p[None], count,
            lambda h, p: int(p.reshape(-1)[0].item()), ahead=ahead,
            fresh=lambda: lambda: compiles and built[0] == 1, clock=clock)]

    for count in (2, 5):
        assert max(run(True, count)) < 0.02, count
        assert run(False, count)[0] >= 0.1, count
    clock = StretchClock()  # what the build took is the stretch's restart...
    run(True, 3, clock)
    assert clock.restart is not None and clock.restart >= 0.1
    clock = StretchClock()  # ...unless its pass was the first of its shape (a compile)
    run(True, 3, clock, compiles=True)
    assert clock.restart is None


def test_a_stretchs_slow_first_steps_wear_out_of_its_price() -> None:
    """What a stretch's steps cost now is read over the later half of its reads: the first
    steps after a restart may run slower (a GPU's allocator cache emptied, buffers allocated
    again), and in a mean since the stretch began they priced every round of it dearer (auto
    then kept depth 3 for dear at 1K on an H200). Here the consumer takes 0.1 s over each of
    the first three steps and 0.005 s over the nine after: the mean since the start reads
    0.029 s a step, the later half what the steps cost by then."""
    import time

    from mtpkit.decoder.rounds.session import pipelined

    def take(hidden: mx.array, picks: mx.array) -> int:
        token = int(picks.reshape(-1)[0].item())
        time.sleep(0.1 if token <= 3 else 0.005)
        return token

    def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
        return tokens, tokens + 1

    paid = [s for _, _, s in pipelined(step, mx.array([[0]]), lambda p: p[None], 12, take)]
    assert paid[1] > 0.05, paid  # (the slow steps are what the stretch paid so far)
    assert paid[-1] < 0.015, paid


def test_best_depth_is_the_fastest_depth_or_plain_when_none_beats_it() -> None:
    """`compare.best_depth` (docs/python-api.md): the depth of the largest speedup, 0 where no
    depth beats plain decoding."""
    from types import SimpleNamespace

    from mtpkit.decoder.compare import best_depth

    def swept(*speedups: float) -> dict[int, Any]:
        return {d: SimpleNamespace(speedup=s) for d, s in enumerate(speedups, start=1)}

    assert best_depth(swept(1.2, 1.6, 1.4)) == 2
    assert best_depth(swept(0.9, 0.7)) == 0
    assert best_depth(swept(1.0)) == 0
