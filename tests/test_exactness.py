"""Exactness with power: tests that a subtly wrong decoder fails.

1. The sampled law, round state by round state. On a Markov target (a llama trunk whose
   attention output is zeroed: it still attends, caches and rolls back, but its next-token law
   depends on the last token only, so every transition law is known exactly) long runs at
   depths 2, 3 and 4 are tested with a chi-square stratified by what is known before each
   token: the two tokens before it, the round's draft count and the token's index in the round.
   Acceptance at every draft position, the correction after a rejection at any position and the
   bonus after K kept drafts are each checked against the target law, not only their mixture.
   Settings: plain temperature, top-k, top-p with min-p, and a truncated draft vocabulary.
2. The joint law of the first six tokens on an attending trunk (3-token vocabulary, enumerated
   exactly: 3^5 prefixes in one batched forward) against many seeded runs at depth 4: the first
   round drafts 4 tokens, later ones what max_tokens leaves (3, 2, 1).
3. Greedy identity with stock mlx-lm (`stream_generate`, the loop `mlx_lm.generate` runs) on
   every family, plain and MTP, on the same float32 weights.
4. Rollback on the recurrent families: an oracle drafter forces rejections at every draft
   position (and bonus rounds) under both rollbacks; the tokens must equal stock mlx-lm's.

Every test asserts the round structure it claims to exercise (rounds of 2, 3 and 4 drafts, each
ending at every possible position). Their power was measured with mutants of the decoder (issue
18): a replacement drawn from p, drafts accepted untested from the second position on, the bonus
from the previous position's law, q taken before the sampler's processing, rollback committing
one recurrent state too many or too few; each fails at least one test here by far.

Re-run on 2026-11-29 at 68e42eb (decoder/ in sub-packages), each mutant applied to a copy of
the tree; the first failing test (-x) and what else fails here:
- drafts accepted untested after the first (rounds/acceptance.py: ratio | index > 0) and
  accept-everything (kept = depth): test_every_round_state_emits_the_target_law[temperature];
  all six law tests fail, each first at its round-structure assert (kept counts {0, K} or {K});
  with that assert off (checked on the first), the laws fail by far too (round states at
  temperature: p = 2e-163; a filtered token emitted at top_k; six tokens: p = 1e-148).
- q taken before the sampler's processing (rounds/session.py head_draft: q the raw softmax, the
  draft drawn from the processed law): test_every_round_state_emits_the_target_law[top_k]; also
  [top_p_min_p] and the six-token law at top_k (at plain temperature and with a draft
  vocabulary the processed q is the raw one: no mutant there).
- a recurrent state committed one too many (cache/state.py commit_recorded: recorder.commit(keep
  + 1)): test_forced_rejections_keep_greedy_equal_to_stock[record-qwen3_5]; also [record-
  qwen3_next] and greedy identity with stock mlx-lm on qwen3_5, qwen3_5_moe and qwen3_next.
- one too few (keep - 1 where keep > 1): [record-qwen3_5] and [record-qwen3_next] only; a bare
  keep - 1 replays no position when one is kept and crashes (mlx: conv, reshape) in those five.
- replay rollback, sliced single-sequence path (cache/recording.py commit): one position too
  many fails the same five tests as the state committed one too many, [record-qwen3_5] first;
  one too few: as the state committed one too few (both forms).
- replay rollback, the batch's lengths path (recording.py: lengths = keep + 1, keep - 1): NO
  test here fails (whole file run: 18 passed): a lone sequence never takes that path. Both are
  killed by test_batch.py::test_rows_keep_different_counts_in_one_pass[qwen3_5].
The replacement from p and the bonus from the previous position run below as negative controls,
written on the device rule.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2, chisquare

import mtpkit
from fixtures.decoder_models import OracleHead, tiny_runner
from mtpkit.decoder.rounds import acceptance
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import Candidates, SamplingParams, probabilities

ALPHA = 1e-5  # the correct decoder passes at the fixed seeds; the mutants scored far below
# name -> (sampling, draft vocabulary, the head's norm gain: a flatter q at 0.3, one sharp
# enough at 0.6 for top-p and min-p to cut it too)
SETTINGS = {
    "temperature": (SamplingParams(1.0), None, 0.3),
    "top_k": (SamplingParams(0.7, top_k=2), None, 0.3),
    "top_p_min_p": (SamplingParams(0.7, top_p=0.85, min_p=0.15), None, 0.6),
    "draft_vocab": (SamplingParams(1.0), [0, 2], 0.3),
}
FILTERS = {"temperature": [], "top_k": [{"top_k": 0}],
           "top_p_min_p": [{"top_p": 1.0}, {"min_p": 0.0}], "draft_vocab": []}


def options(params: SamplingParams) -> dict[str, Any]:
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "min_p": params.min_p}


def rounds_of(runner: Runner, ids: list[int], max_tokens: int, depth: int,
              **kwargs: Any) -> tuple[list[int], list[tuple[int, int]]]:
    """The generated tokens and each round's (drafted, kept), read from the streamed batches
    (the first batch is the prefill's token; a round drafts min(depth, max_tokens - n - 1)).
    The generation's statistics must count exactly these rounds, per draft position."""
    *pieces, last = runner.stream(ids, max_tokens, depth=depth, **kwargs)
    tokens, outcomes = list(pieces[0].tokens), []
    for piece in pieces[1:]:
        outcomes.append((min(depth, max_tokens - len(tokens) - 1), len(piece.tokens) - 1))
        tokens += piece.tokens
    assert last.result is not None and last.result.tokens == tokens
    stats, verified = last.result.stats, [(d, k) for d, k in outcomes if d > 0]
    assert stats.verify_calls == len(verified)
    assert stats.proposed == [sum(d > i for d, _ in verified) for i in range(depth)]
    assert stats.accepted == [sum(k > i for _, k in verified) for i in range(depth)]
    assert stats.bonus == sum(k == d for d, k in verified)
    assert stats.corrections == len(verified) - stats.bonus
    return tokens, outcomes


def assert_every_outcome(outcomes: list[tuple[int, int]], drafts: tuple[int, ...]) -> None:
    """Rounds of each draft count end in a rejection at every draft position and in a bonus:
    every chain length was verified and every rollback point taken."""
    for drafted in drafts:
        kept = {k for d, k in outcomes if d == drafted}
        assert kept == set(range(drafted + 1)), (drafted, sorted(kept))


def assert_filters_bite(runner: Runner, setting: str, law: Callable[[SamplingParams], Any],
                        distance: Callable[[Any, Any], float]) -> None:
    """Each filter of the setting changes the target law (it is exercised, not idle), and a
    draft vocabulary gives q = 0 outside it."""
    params, draft_vocab, _ = SETTINGS[setting]
    for off in FILTERS[setting]:
        assert distance(law(replace(params, **off)), law(params)) > 0.02, off
    if draft_vocab is not None:
        assert runner.head is not None
        q, _ = runner.head(mx.zeros((1, 1, 32)), mx.array([[1]]), runner.head.make_cache(), 0)
        q = np.array(q)[0, 0]
        outside = np.setdiff1d(np.arange(q.shape[-1]), draft_vocab)
        assert np.isinf(q[outside]).all() and np.isfinite(q[draft_vocab]).all()


# -- 1. long runs on a Markov target: the law in every round state ---------------------------

MV = 4  # the Markov target's vocabulary
LONG = 1500  # tokens per run
MARKOV_PROMPT = [0, 1, 2, 3]
MARKOV_LOGITS = 0.15  # the trunk's logit scale: rows keep 2-4 tokens under the filters


def transition_law(runner: Runner, params: SamplingParams) -> np.ndarray:
    """(MV, MV): row a is the processed law of the token after a. Checks that the trunk is
    Markov: on a longer sequence every position's law is its last token's row."""
    seq = [0, 1, 2, 3, 3, 1, 0, 0, 2, 1, 3, 2, 0, 3, 1, 1, 2, 2]
    logits = runner.trunk.model(mx.array([seq]))[0]
    law = probabilities(logits[:MV], params)
    np.testing.assert_allclose(probabilities(logits, params), law[seq], atol=1e-5)
    return law


def stratified_test(law: np.ndarray, tokens: list[int],
                    outcomes: list[tuple[int, int]]) -> tuple[float, int]:
    """Chi-square (statistic, df) of the emitted tokens against law[last token], stratified by
    what is known before each token: the two tokens before it, the round's draft count and the
    token's index in the round (index K after K kept drafts: the bonus). Exactness means every
    stratum's tokens are i.i.d. from its row of the law. Strata expecting fewer than 5 of some
    possible token are pooled by their last token. A token the filters forbid must not occur."""
    visits: dict[tuple, Counter] = {}
    seq = MARKOV_PROMPT + tokens
    at = len(MARKOV_PROMPT) + 1  # the prefill's token is not part of a round
    for drafted, kept in outcomes:
        for j in range(kept + 1):
            visits.setdefault((seq[at - 2], seq[at - 1], drafted, j), Counter())[seq[at]] += 1
            at += 1
    assert at == len(seq)
    strata: dict[tuple, Counter] = {}
    for key, counts in visits.items():
        row = law[key[1]]
        pooled = sum(counts.values()) * row[row > 0].min() < 5
        strata.setdefault((None, key[1]) if pooled else key, Counter()).update(counts)
    stat, df = 0.0, 0
    for key, counts in strata.items():
        row = law[key[1]]
        observed = np.array([counts[v] for v in range(MV)], dtype=np.float64)
        assert observed[row == 0].sum() == 0, f"a token the filters remove was emitted: {key}"
        support = row > 0
        expected = observed.sum() * row[support]
        stat += float(((observed[support] - expected) ** 2 / expected).sum())
        df += int(support.sum()) - 1
    return stat, df


def markov_statistic(setting: str, traced: bool = False) -> tuple[float, int]:
    """The stratified chi-square (statistic, df) of runs at depths 2, 3 and 4, after checking
    the setting's filters bite and every round outcome occurs at every depth; `traced`: with
    the trunk's verify passes traced (decoder/model/traced.py)."""
    params, draft_vocab, head_norm = SETTINGS[setting]
    runner = tiny_runner(vocab=MV, draft_vocab=draft_vocab, head_norm=head_norm, markov=True,
                         logit_scale=MARKOV_LOGITS)
    if traced:
        runner.trunk.use_traced()
    law = transition_law(runner, params)
    assert_filters_bite(runner, setting, lambda p: transition_law(runner, p),
                        lambda a, b: float(np.abs(a - b).sum(axis=1).max()) / 2)
    stat, df = 0.0, 0
    for depth in (2, 3, 4):
        tokens, outcomes = rounds_of(runner, MARKOV_PROMPT, LONG, depth, seed=depth,
                                     **options(params))
        assert len(tokens) == LONG
        assert_every_outcome(outcomes, (depth,))
        s, d = stratified_test(law, tokens, outcomes)
        stat, df = stat + s, df + d
    return stat, df


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_round_state_emits_the_target_law(setting: str) -> None:
    stat, df = markov_statistic(setting)
    assert chi2.sf(stat, df) > ALPHA, (stat, df)


def replacement_from_p(drafts: mx.array, q: Candidates | None, p: Candidates,
                       noise: mx.array) -> mx.array:
    """Wrong: after a rejection at i, emit a token from p_i, not normalize(max(0, p_i - q_i))."""
    depth = drafts.shape[0]
    if q is None or depth == 0:
        return RIGHT_RULE(drafts, q, p, noise)
    kept = acceptance.kept_prefix(noise[:depth] * q.at(drafts) < p[:depth].at(drafts))
    tokens = p.draw(mx.broadcast_to(noise[None, depth:], p.probs.shape))  # one per row
    return mx.stack([kept.astype(mx.int32), tokens[kept]])


def bonus_from_previous_position(drafts: mx.array, q: Candidates | None, p: Candidates,
                                 noise: mx.array) -> mx.array:
    """Wrong: after K kept drafts, the bonus comes from p_K instead of p_{K+1}."""
    depth = drafts.shape[0]
    shifted = Candidates.concat([p[:depth], p[max(depth - 1, 0):max(depth, 1)]])
    return RIGHT_RULE(drafts, q, shifted, noise)


RIGHT_RULE = acceptance.accept_sampled
WRONG_RULES = {"replacement_from_p": replacement_from_p,
               "bonus_from_previous_position": bonus_from_previous_position}


@pytest.mark.parametrize("rule", WRONG_RULES)
def test_the_law_test_fails_a_subtly_wrong_rule(rule: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above keeps its power: two rules only slightly off (the round structure is
    unchanged) fail it by far, not only an accept-everything rule."""
    monkeypatch.setattr(acceptance, "accept_sampled", WRONG_RULES[rule])
    stat, df = markov_statistic("temperature")
    assert chi2.sf(stat, df) < 1e-10, (stat, df)


# -- 2. the joint law of the first six tokens on an attending trunk --------------------------

V = 3  # vocabulary: 3^6 = 729 sequences of six tokens
N = 6  # tokens per run: the first round drafts min(DEPTH, N - 2) = 4
DEPTH = 4
TINY_PROMPT = [0, 1, 2, 1]
RUNS = 1500
TINY_LOGITS = 0.2


def exact_law(runner: Runner, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first N tokens = x) for every x, by the chain rule over the processed target law."""
    prefixes = list(itertools.product(range(V), repeat=N - 1))
    logits = runner.trunk.model(mx.array([TINY_PROMPT + list(x) for x in prefixes]))
    rows = logits[:, len(TINY_PROMPT) - 1:].reshape(-1, V)
    p = probabilities(rows, params).reshape(len(prefixes), N, V)
    law = {}
    for b, prefix in enumerate(prefixes):
        mass = float(np.prod([p[b, t, x] for t, x in enumerate(prefix)]))
        for x in range(V):
            law[(*prefix, x)] = mass * float(p[b, N - 1, x])
    return law


def sample(runner: Runner, params: SamplingParams, runs: int,
           first_seed: int = 0) -> tuple[Counter, list[tuple[int, int]]]:
    """(first N tokens -> runs, every round's (drafted, kept)) over seeded generations."""
    counts: Counter = Counter()
    outcomes: list[tuple[int, int]] = []
    for seed in range(first_seed, first_seed + runs):
        tokens, rounds = rounds_of(runner, TINY_PROMPT, N, DEPTH, seed=seed, **options(params))
        counts[tuple(tokens)] += 1
        outcomes += rounds
    return counts, outcomes


def law_test(law: dict[tuple[int, ...], float], counts: Counter,
             runs: int) -> tuple[float, int, float]:
    """Chi-square (statistic, df, p) of the observed sequences against the exact law; sequences
    expected fewer than 5 times are pooled. A sequence the filters forbid must never occur."""
    forbidden = {k: c for k, c in counts.items() if law.get(k, 0.0) == 0.0}
    assert not forbidden, f"sequences with target probability 0 were emitted: {forbidden}"
    total = sum(law.values())  # 1 up to the float32 logits' rounding
    cells = [k for k, p in law.items() if p > 0]
    small = [k for k in cells if law[k] * runs < 5]
    big = [k for k in cells if law[k] * runs >= 5]
    observed = [counts[k] for k in big] + [sum(counts[k] for k in small)]
    expected = [law[k] / total * runs for k in big] + [sum(law[k] for k in small) / total * runs]
    result = chisquare(observed, expected)
    return float(result.statistic), len(observed) - 1, float(result.pvalue)


@pytest.mark.parametrize("setting", ["temperature", "top_k"])
def test_first_six_tokens_follow_the_enumerated_joint_law(setting: str) -> None:
    params, draft_vocab, head_norm = SETTINGS[setting]
    runner = tiny_runner(vocab=V, draft_vocab=draft_vocab, head_norm=head_norm,
                         logit_scale=TINY_LOGITS)
    law = exact_law(runner, params)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-6)  # float32 logits
    assert_filters_bite(runner, setting, lambda p: exact_law(runner, p),
                        lambda a, b: sum(abs(a[k] - b[k]) for k in a) / 2)
    counts, outcomes = sample(runner, params, RUNS)
    assert sum(d == DEPTH for d, _ in outcomes) == RUNS  # every run's first round drafts 4
    assert_every_outcome(outcomes, (2, 3, 4))
    assert law_test(law, counts, RUNS)[2] > ALPHA


# -- 3. greedy identity with stock mlx-lm ----------------------------------------------------

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "mimo", "llama")
PROMPT = [5, 17, 42, 99, 7, 3]


def stock_greedy(path: Path, ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """Tokens and finish reason of stock mlx-lm's generation loop on the bundle's trunk, with
    the weights mtpkit.load(dtype="float32") runs: dequantized and widened by mlx-lm and mlx."""
    import mlx_lm
    from mlx.utils import tree_unflatten
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear
    from mlx_lm.utils import dequantize_model

    model, tokenizer = mlx_lm.load(str(path))
    dequantize_model(model)
    # mlx-lm's dequantize_model leaves MLA's per-head projections quantized (and a GPU has no
    # float32 quantized matmul): dequantize them with mlx's own op into mlx-lm's own class
    dense = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedMultiLinear):
            heads, out, _ = m.weight.shape
            layer = MultiLinear(m.scales.shape[-1] * m.group_size, out, heads)
            layer.weight = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size,
                                         m.bits, mode=m.mode)
            dense.append((name, layer))
    model.update_modules(tree_unflatten(dense))
    model.set_dtype(mx.float32)
    out = list(stream_generate(model, tokenizer, ids, max_tokens=max_tokens))
    tokens = [r.token for r in out]
    if out[-1].finish_reason == "stop":  # the last response carries the EOS token itself
        tokens.pop()
    return tokens, out[-1].finish_reason


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_stock_mlx_lm(built: Callable[..., Path], family: str) -> None:
    path = built(family)
    reference, reason = stock_greedy(path, PROMPT, 64)
    runner = mtpkit.load(path, dtype="float32")
    for depth in (0, 3) if runner.head is not None else (0,):
        result = runner.generate(PROMPT, 64, depth=depth)
        assert result.tokens == reference, (family, depth)
        assert result.finish_reason == reason


# -- 4. rollback under forced rejections, against stock --------------------------------------

LONG_PROMPT = [9, 8, 7, 6, 5, 4]  # no EOS within 160 greedy tokens on either recurrent fixture

@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("rollback", ["record", "replay"])
def test_forced_rejections_keep_greedy_equal_to_stock(built: Callable[..., Path], family: str,
                                                      rollback: str) -> None:
    """A drafter wrong at a random 30% of positions: rounds of 2-4 drafts are rejected at every
    position and fully kept, the recurrent (GatedDeltaNet) state rolls back each time, and the
    tokens still equal stock mlx-lm's plain greedy decode."""
    path = built(family)
    reference, reason = stock_greedy(path, LONG_PROMPT, 160)
    assert reason == "length"
    runner = mtpkit.load(path, dtype="float32", rollback=rollback)
    assert runner.trunk.recorders and runner.rollback == rollback
    seq = LONG_PROMPT + reference
    vocab = runner.trunk.args.vocab_size
    wrong = np.random.default_rng(0).random(len(seq)) < 0.3
    script = {i: (t + 1) % vocab if wrong[i] else t for i, t in enumerate(seq)}
    oracle = Runner(runner.trunk, OracleHead(vocab, script, len(LONG_PROMPT)),  # type: ignore[arg-type]
                    None, rollback=rollback)
    for depth in (2, 3, 4):
        tokens, outcomes = rounds_of(oracle, LONG_PROMPT, 160, depth)
        assert tokens == reference, (family, rollback, depth)
        assert_every_outcome(outcomes, (depth,))
