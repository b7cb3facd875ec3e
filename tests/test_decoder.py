"""The reference decoder: greedy identity, exact distributions, exact rollback, API and stats."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler
from scipy.stats import chisquare

import mtpkit
from fixtures.breaker import BREAKERS
from fixtures.decoder_models import OracleHead, tiny_runner
from fixtures.factory import Sidecar
from mtpkit.decoder import acceptance, misses
from mtpkit.decoder.rows import FEW_ROWS, FewRowsLinear, use_few_rows_linears
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import SamplingParams, draw, probabilities
from mtpkit.decoder.session import Session
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


# -- greedy identity -------------------------------------------------------------------------

@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_greedy_identity_every_depth(runners: Callable[[str], Runner], family: str) -> None:
    runner = runners(family)
    plain = runner.generate(PROMPT, 64, depth=0)
    assert len(plain.tokens) == 64 and plain.stats.verify_calls == 0
    for depth in (1, 2, 3, 4):
        spec = runner.generate(PROMPT, 64, depth=depth)
        assert spec.tokens == plain.tokens, (family, depth)
        stats = spec.stats
        assert stats.verify_calls > 0 and len(stats.acceptance_by_depth) == depth
        assert stats.proposed[0] == stats.verify_calls
        assert stats.bonus + stats.corrections == stats.verify_calls


def _plain_greedy(runner: Runner, ids: list[int], n: int) -> list[int]:
    return runner.generate(ids, n, depth=0).tokens


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_long_generation_with_acceptance_is_identical(runners: Callable[[str], Runner],
                                                      built: Callable[..., Path],
                                                      family: str) -> None:
    """An oracle drafter that is right most of the time (wrong every 7th position): long runs
    with accepted drafts, bonus tokens and rejections at every depth still match plain greedy."""
    runner = runners(family) if family != "llama" else mtpkit.load(built("llama"), dtype="float32")
    plain = _plain_greedy(runner, PROMPT, 300)
    seq = PROMPT + plain
    vocab = runner.trunk.args.vocab_size
    script = {i: (t + 1) % vocab if i % 7 == 0 else t for i, t in enumerate(seq)}
    oracle = Runner(runner.trunk, OracleHead(vocab, script, len(PROMPT)), None)  # type: ignore[arg-type]
    for depth in (1, 3, 4):
        spec = oracle.generate(PROMPT, 300, depth=depth)
        assert spec.tokens == plain
        assert spec.stats.bonus > 0 and spec.stats.corrections > 0
        assert 0.5 < spec.stats.acceptance_by_depth[0] < 1.0


# -- rollback --------------------------------------------------------------------------------

def _plain_state(runner: Runner, tokens: list[int]) -> list:
    """The trunk cache after a plain decode fed `tokens`: prompt in one pass, then one by one."""
    cache = runner.trunk.make_cache()
    runner.trunk(mx.array([PROMPT]), cache, logits_for=0)
    for t in tokens[len(PROMPT):]:
        runner.trunk(mx.array([[t]]), cache, logits_for=0)
    mx.eval([c.state for c in cache])
    return cache


def _assert_same_state(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        if isinstance(a, KVCache):
            assert a.offset == b.offset
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                np.testing.assert_allclose(np.array(x[..., :a.offset, :]),
                                           np.array(y[..., :b.offset, :]), atol=1e-5)
        else:
            for x, y in zip(a.cache, b.cache, strict=True):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "llama"])
@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
@pytest.mark.parametrize("rollback", ["record", "replay"])
def test_rollback_state_equals_plain_decode(runners: Callable[[str], Runner],
                                            built: Callable[..., Path], family: str,
                                            reject_at: int, rollback: str) -> None:
    """Reject draft `reject_at` of 3 (3 = all kept, bonus) in each of several rounds; the trunk
    state (KV caches and GatedDeltaNet conv/recurrent states) equals a plain decode's, whether
    recorded during verify or restored and replayed."""
    runner = runners(family) if family != "llama" else mtpkit.load(built("llama"), dtype="float32")
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
        got = session.round(3)
        assert len(got) == reject_at + 1
        committed += got
        assert committed == seq[:len(committed)]
        _assert_same_state(session.cache, _plain_state(runner, committed[:-1]))


def test_mtp_cache_holds_exactly_the_committed_pairs(runners: Callable[[str], Runner]) -> None:
    """The head's KV cache equals a fresh head pass over (trunk hidden_i, token_i+1) pairs of the
    committed text: chained draft entries never survive a round."""
    runner = runners("qwen3_5")
    session = Session(runner.trunk, runner.head, SamplingParams(), 3)
    seq = [*PROMPT, session.start(PROMPT)]
    for _ in range(12):
        seq += session.round(3)
    assert runner.head is not None
    n = session.mtp_cache[0].offset
    hidden, _ = runner.trunk(mx.array([seq[:n]]), runner.trunk.make_cache(), logits_for=0)
    fresh = runner.head.make_cache()
    runner.head(hidden, mx.array([seq[1:n + 1]]), fresh, 0)
    assert session.owed is not None and n + session.owed[1].shape[1] == len(seq) - 1
    for x, y in ((session.mtp_cache[0].keys, fresh[0].keys),
                 (session.mtp_cache[0].values, fresh[0].values)):
        np.testing.assert_allclose(np.array(x[..., :n, :]), np.array(y[..., :n, :]), atol=1e-4)


# -- exact distributions ---------------------------------------------------------------------

V = 5
TINY_PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny() -> Runner:
    return tiny_runner(vocab=V)


def _exact_joint(runner: Runner, params: SamplingParams, n: int = 3) -> dict[tuple, float]:
    """P(first n tokens) by enumeration over the trunk's processed distributions."""
    out: dict[tuple, float] = {}
    for prefix in itertools.product(range(V), repeat=n - 1):
        _, logits = runner.trunk(mx.array([TINY_PROMPT + list(prefix)]), runner.trunk.make_cache())
        p = probabilities(logits[0, len(TINY_PROMPT) - 1:], params)
        mass = float(np.prod([p[i, t] for i, t in enumerate(prefix)]))
        for t in range(V):
            out[(*prefix, t)] = mass * p[n - 1, t]
    return out


def _chi_square(runner: Runner, params: SamplingParams, depth: int, runs: int) -> float:
    exact = _exact_joint(runner, params)
    seen = Counter(tuple(runner.generate(TINY_PROMPT, 3, depth=depth, seed=s,
                                         temperature=params.temperature, top_p=params.top_p,
                                         top_k=params.top_k, min_p=params.min_p).tokens)
                   for s in range(runs))
    impossible = sum(c for k, c in seen.items() if exact.get(k, 0.0) == 0.0)
    assert impossible == 0, "a token the filters remove was emitted"
    big = [k for k, p in exact.items() if p * runs >= 5]
    small = [k for k, p in exact.items() if 0 < p * runs < 5]
    observed = [seen[k] for k in big] + ([sum(seen[k] for k in small)] if small else [])
    expected = [exact[k] * runs for k in big] + ([sum(exact[k] for k in small) * runs]
                                                   if small else [])
    return float(chisquare(observed, expected).pvalue)


def test_plain_sampling_has_the_target_distribution(tiny: Runner) -> None:
    assert _chi_square(tiny, SamplingParams(0.7, top_k=3), depth=0, runs=1200) > 1e-3


def test_acceptance_rule_emits_the_target_law() -> None:
    """The rule alone, 60k trials on random p and q: the first emitted token follows p_1 and the
    second (after an accepted first draft) follows p_2."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(4), size=3)
    q = rng.dirichlet(np.ones(4) * 0.5, size=2)
    first, second = Counter(), Counter()
    for _ in range(60000):
        drafts = [draw(q[0], rng), draw(q[1], rng)]
        v = acceptance.accept_sampled(drafts, q, p, rng)
        out = [*drafts[:v.accepted], v.token]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    for counts, law in ((first, p[0]), (second, p[1])):
        total = sum(counts.values())
        assert chisquare([counts[i] for i in range(4)], law * total).pvalue > 1e-3


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
    assert acceptance.accept_greedy([3, 4, 5], [3, 4, 9, 1]) == acceptance.Verdict(2, 9)
    assert acceptance.accept_greedy([3, 4], [3, 4, 8]) == acceptance.Verdict(2, 8)
    assert acceptance.accept_greedy([1], [2, 0]) == acceptance.Verdict(0, 2)


# -- API, stats, errors ----------------------------------------------------------------------

def test_seeded_runs_are_reproducible(tiny: Runner) -> None:
    a = tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=2, seed=7).tokens
    assert a == tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=2, seed=7).tokens
    assert a != tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=2, seed=8).tokens
    b = tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=0, seed=7).tokens
    assert b == tiny.generate(TINY_PROMPT, 40, temperature=1.0, depth=0, seed=7).tokens


def test_text_chat_stream_and_stats(built: Callable[..., Path]) -> None:
    runner = mtpkit.load(built("qwen3_5"))
    result = runner.generate("Hello there", 24, depth=2)
    assert len(result.tokens) == 24 and result.finish_reason == "length"  # no EOS within 24
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
    with pytest.raises(ValueError):
        mtpkit.load(built("llama")).generate(PROMPT, 4, depth=1)


def test_delta_sidecar_norms_load_like_absolute(built: Callable[..., Path]) -> None:
    """A sidecar with zero-centred norms declared delta drafts exactly like the absolute one."""
    absolute = mtpkit.load(built("qwen3_5"), dtype="float32")
    delta = mtpkit.load(built("qwen3_5", Sidecar(norms="delta")), dtype="float32")
    a = absolute.generate(PROMPT, 24, depth=3)
    b = delta.generate(PROMPT, 24, depth=3)
    assert a.tokens == b.tokens and a.stats.accepted == b.stats.accepted


def test_trunk_logits_equal_mlx_lm_model(runners: Callable[[str], Runner]) -> None:
    """The wrapper adds nothing: its logits are the mlx-lm model's own, for every family."""
    for family in MTP_FAMILIES:
        trunk = runners(family).trunk
        ids = mx.array([PROMPT])
        _, ours = trunk(ids, trunk.make_cache())
        theirs = trunk.model(ids, cache=trunk.make_cache())
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-5)


def test_contract_override_is_applied(built: Callable[..., Path]) -> None:
    default = mtpkit.load(built("qwen3_5"), dtype="float32")
    swapped = mtpkit.load(built("qwen3_5"), dtype="float32", concat_order="hidden_first",
                          hidden_feed="pre_norm")
    assert swapped.head is not None and swapped.head.contract.concat_order == "hidden_first"
    hidden, _ = swapped.trunk(mx.array([PROMPT]), swapped.trunk.make_cache())
    post, _ = default.trunk(mx.array([PROMPT]), default.trunk.make_cache())
    np.testing.assert_allclose(np.array(swapped.trunk.inner.norm.norm(hidden)), np.array(post),
                               atol=1e-5)
    assert swapped.generate(PROMPT, 16, depth=2).tokens == default.generate(PROMPT, 16,
                                                                             depth=0).tokens
    with pytest.raises(ValueError):
        mtpkit.load(built("qwen3_5"), concat_order="sideways")


def test_blas_detection_tells_reference_from_optimized(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from mtpkit.decoder import blas
    from mtpkit.decoder.blas import loaded_blas, note

    # Optimized when preloaded or when importing mtpkit (conftest does it first) loaded one.
    loaded = blas.LOADING is not None and blas.LOADING.path is not None
    expected = "optimized" if "openblas" in os.environ.get("LD_PRELOAD", "") or loaded \
        else "reference"
    assert loaded_blas() == expected and (note() is None) == (expected == "optimized")
    openblas = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
    if openblas.exists():  # where an optimized BLAS is installed, preloading it is detected
        code = ("import mlx.core as mx; from mtpkit.decoder.blas import loaded_blas; "
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


def test_cpu_load_multiplies_verify_rows_weight_first(runners: Callable[[str], Runner]) -> None:
    runner = runners("qwen3_5")
    assert mx.default_device().type == mx.DeviceType.cpu
    kinds = {type(m) for _, m in runner.trunk.inner.named_modules()}
    assert FewRowsLinear in kinds and nn.Linear not in kinds
    assert runner.head is not None and isinstance(runner.head.roles[0].fc, FewRowsLinear)


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
