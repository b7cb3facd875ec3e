"""Exactness past one prefill chunk (issue 49): a prompt the session prefills in two chunks
(decoder/rounds/session.py's PREFILL_STEP, mlx-lm's prefill_step_size: 2,048 tokens, fixed; no public
option shrinks it, so the prompts here are 2,048 + 64 tokens on tiny trunks), then MTP rounds
rejected at every draft position and fully kept.

1. Greedy identity with stock mlx-lm (`stream_generate`, the same 2,048-token chunks) on both
   families: the Llama-shaped fixture (attention KV only, trimmed on rejection) and the
   Qwen3.5-shaped hybrid (GatedDeltaNet states committed per position, and rolled back by
   replay), with an oracle drafter wrong at a random 30% of positions, and the hybrid's own MTP
   head, whose owed (hidden, token) pairs span both chunks; after the rounds every trunk cache
   equals plain decoding's. Untraced and traced (traced passes prefill in padded, bounded
   chunks: decoder/cache/shapes.py).
2. The sampled law after a long prompt: tests/test_exactness.py's stratified chi-square on
   its Markov target, the prompt two chunks long.

Power, checked on 2026-11-28 by breaking the decoder once each: attention caches trimmed one
position too few after a rejection (session.rewind and commit_recorded given one verified
position less) fail all five greedy tests (the cache check: on the Llama fixture the tokens
alone stayed equal); the replacement drawn from p fails the law test (p = 4e-13).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2
from test_exactness import (
    ALPHA,
    MARKOV_PROMPT,
    MV,
    assert_every_outcome,
    rounds_of,
    stock_greedy,
    stratified_test,
    transition_law,
)

import mtpkit
from fixtures.decoder_models import OracleHead, tiny_runner
from fixtures.drive import generate_ids
from mtpkit.decoder.cache.caches import is_recurrent
from mtpkit.decoder.rounds import session as session_module
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import SamplingParams

STEP = session_module.PREFILL_STEP
LENGTH = STEP + 64  # two prefill chunks: a whole one and a part
TOKENS = 64
EOS = 2  # the fixtures' (configs.py); kept out of the prompt


def long_prompt(vocab: int, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, LENGTH)]


def forced(runner: Runner, ids: list[int], reference: list[int]) -> Runner:
    """The runner's trunk drafting with an oracle that proposes the reference token at a
    random 70% of positions and a wrong one elsewhere."""
    vocab = runner.trunk.args.vocab_size
    seq = ids + reference
    wrong = np.random.default_rng(0).random(len(seq)) < 0.3
    script = {i: (t + 1) % vocab if wrong[i] else t for i, t in enumerate(seq)}
    return Runner(runner.trunk, OracleHead(vocab, script, len(ids)),  # type: ignore[arg-type]
                  None, rollback=runner.rollback)


@pytest.fixture(scope="module")
def references(built: Callable[..., Path]) -> dict[str, tuple[Path, list[int], list[int]]]:
    """family -> (bundle, prompt, stock mlx-lm's greedy tokens after it)."""
    out = {}
    for family in ("llama", "qwen3_5"):
        path = built(family)
        ids = long_prompt(512)
        reference, reason = stock_greedy(path, ids, TOKENS)
        assert reason == "length" and EOS not in ids
        out[family] = (path, ids, reference)
    return out


def decoded(runner: Runner, ids: list[int], depth: int
            ) -> tuple[list[int], list[tuple[int, int]], Session]:
    """Greedy tokens at a forced depth, each round's (drafted, kept), and the session after
    it (as test_exactness.rounds_of reads them, the session kept)."""
    request = runner.prepare(ids, TOKENS, depth=depth)
    batches = list(generate_ids(request.session, ids, TOKENS, request.eos))
    tokens, outcomes = list(batches[0]), []
    for batch in batches[1:]:
        outcomes.append((min(depth, TOKENS - len(tokens) - 1), len(batch) - 1))
        tokens += batch
    return tokens, outcomes, request.session


def assert_same_state(got: Session, want: Session) -> None:
    """Every trunk cache holds what plain decoding left: as many positions, the same keys and
    values (a kept stale position would shift every later one), the same recurrent states.
    Tokens alone miss a stale key among 2,000 on a tiny trunk; the cache does not."""
    for a, b in zip(got.cache, want.cache, strict=True):
        if is_recurrent(a):
            pairs = list(zip(a.cache, b.cache, strict=True))
        else:
            assert a.offset == b.offset
            pairs = [(x[..., :a.offset, :], y[..., :b.offset, :])
                     for x, y in ((a.keys, b.keys), (a.values, b.values))]
        for x, y in pairs:
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("family,rollback,traced", [
    ("llama", "record", False), ("llama", "record", True), ("qwen3_5", "record", False),
    ("qwen3_5", "record", True), ("qwen3_5", "replay", False)])
def test_forced_rejections_after_two_chunks_keep_greedy_equal_to_stock(
        references: dict, family: str, rollback: str, traced: bool) -> None:
    path, ids, reference = references[family]
    runner = mtpkit.load(path, dtype="float32", rollback=rollback)
    if traced:
        runner.trunk.use_traced()
    plain, _, plain_session = decoded(runner, ids, 0)
    assert len(plain_session._chunks(len(ids))) >= 2  # the prompt spans two prefill chunks
    assert plain == reference and plain_session.stats.prompt_tokens == LENGTH
    tokens, outcomes, session = decoded(forced(runner, ids, reference), ids, 3)
    assert tokens == reference, (family, rollback, traced)
    assert_every_outcome(outcomes, (3,))
    assert_same_state(session, plain_session)
    if runner.head is not None:  # the real head: its owed pairs cross the chunk boundary
        assert runner.generate(ids, TOKENS, depth=3, draft="head").tokens == reference


def test_sampled_law_holds_after_two_chunks() -> None:
    """Depths 2 and 4 at temperature 1 after a two-chunk prompt: every round state's tokens
    follow the Markov target's law (test_exactness's stratified chi-square), every outcome
    seen. With the replacement drawn from p (test_exactness.replacement_from_p) the same runs
    score p = 4e-13; depth 3 alone over 900 tokens only 0.05, too weak to fail."""
    runner = tiny_runner(vocab=MV, head_norm=0.3, markov=True, logit_scale=0.15)
    law = transition_law(runner, SamplingParams(1.0))
    head = np.random.default_rng(5).integers(0, MV, LENGTH - len(MARKOV_PROMPT))
    ids = [int(t) for t in head] + MARKOV_PROMPT  # its last tokens: what the strata start on
    stat, df = 0.0, 0
    for depth in (2, 4):
        tokens, outcomes = rounds_of(runner, ids, 1500, depth, seed=3, temperature=1.0)
        assert_every_outcome(outcomes, (depth,))
        s, d = stratified_test(law, tokens, outcomes)
        stat, df = stat + s, df + d
    assert chi2.sf(stat, df) > ALPHA, (stat, df)
