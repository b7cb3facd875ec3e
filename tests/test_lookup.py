"""Drafts from the context (decoder/lookup.py): the index finds the longest earlier match, and
decoding with lookup drafts (alone, beside the head, fixed or auto depth) stays exact."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

import mtpkit
from fixtures.decoder_models import tiny_runner
from mtpkit.decoder.costs import CostCurve
from mtpkit.decoder.lookup import MAX_NGRAM, ContextIndex
from mtpkit.decoder.policy import DepthPolicy
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import SamplingParams, probabilities

FAMILIES = ("llama", "qwen3_5", "qwen3_next", "deepseek_v3", "mimo")
PROMPT = [5, 17, 42, 99, 7, 3, 5, 17, 42, 99, 7, 3, 5, 17]


def brute_force(tokens: list[int], width: int) -> tuple[list[int], int]:
    """The longest suffix (<= MAX_NGRAM) with an earlier occurrence; what followed its latest
    one, continued periodically past the end."""
    for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # an occurrence ending before the last
            if tokens[end - n + 1:end + 1] == suffix:
                period = len(tokens) - 1 - end
                return [tokens[end + 1 + i % period] for i in range(width)], n
    return [], 0


def test_index_proposes_what_followed_the_longest_match() -> None:
    index = ContextIndex()
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3])
    assert index.propose(3) == ([4, 5, 9], 3)  # [1, 2, 3] beats the later [2, 3] -> 7
    index.extend([8])
    assert index.propose(3) == ([], 0)  # 8 never occurred before: no match, not itself
    index.extend([1, 2])
    assert index.propose(2) == ([3, 8], 2)  # the latest occurrence of [1, 2]
    index.extend([3, 8, 1, 2])
    assert index.propose(6) == ([3, 8, 1, 2, 3, 8], 6)  # past the end: the period goes on


def test_incremental_index_equals_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(20):
        index, tokens = ContextIndex(), []
        for _ in range(300):
            batch = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            index.extend(batch)
            tokens += batch
            assert index.propose(5) == brute_force(tokens, 5)


def _no_eos(runner: Runner) -> Runner:
    return Runner(runner.trunk, runner.head, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_lookup_decoding_is_greedy_identical(built: Callable[..., Path], family: str) -> None:
    """Fixed depth and auto, lookup alone and beside the head; llama has no head: lookup
    drafting gives every model speculation."""
    runner = _no_eos(mtpkit.load(built(family), dtype="float32"))
    runner._costs = CostCurve([1.0 + 0.05 * t for t in range(16)], plain=1.0, draft=0.1)
    plain = runner.generate(PROMPT, 80, depth=0).tokens
    drafts = ["lookup"] + (["both"] if runner.head is not None else [])
    for draft, depth in itertools.product(drafts, (3, "auto")):
        result = runner.generate(PROMPT, 80, depth=depth, draft=draft)
        assert result.tokens == plain, (family, draft, depth)
        assert result.stats.sources.get("lookup", {}).get("rounds", 0) > 0, (draft, depth)


def test_a_repeating_text_is_drafted_from_the_context() -> None:
    """A Markov trunk over 12 tokens falls into a cycle: once it has, lookup drafts are right
    and most tokens come in long accepted rounds."""
    runner = tiny_runner(vocab=12, markov=True, logit_scale=4.0)
    runner._costs = CostCurve([1.0 + 0.05 * t for t in range(16)], plain=1.0, draft=0.1)
    plain = runner.generate([1, 2, 3], 200, depth=0).tokens
    result = runner.generate([1, 2, 3], 200, depth="auto", draft="lookup")
    assert result.tokens == plain
    lookup = result.stats.sources["lookup"]
    assert lookup["accepted"][0] / lookup["proposed"][0] > 0.8
    assert result.stats.verify_calls < 60  # 200 tokens in far fewer passes


def test_policy_backs_off_lookup_that_misses_and_takes_it_when_it_hits() -> None:
    """Matches whose continuations are rejected stop being drafted (plain decoding wins), and
    a head-less policy takes a matching context as soon as it pays."""
    policy = DepthPolicy(CostCurve([1.0 + 0.3 * t for t in range(16)], plain=1.0, draft=0.0),
                         8, sources=("lookup",))
    assert policy.choose(0) == ("plain", 0)  # nothing to draft from
    assert policy.choose(4)[0] == "lookup"  # the 50% prior pays at this cost
    for _ in range(40):
        policy.record(4, 0, "lookup")
    assert policy.choose(8) == ("plain", 0)
    for _ in range(200):
        policy.record(4, 4, "lookup")
    assert policy.choose(8) == ("lookup", 8)  # all kept: draft as far as the match goes
    assert policy.choose(3) == ("lookup", 3)


V = 4
SAMPLED_PROMPT = [1, 2, 1, 2, 1, 2, 1]


def _exact_joint(runner: Runner, params: SamplingParams, n: int = 3) -> dict[tuple, float]:
    out: dict[tuple, float] = {}
    for prefix in itertools.product(range(V), repeat=n - 1):
        _, logits = runner.trunk(mx.array([SAMPLED_PROMPT + list(prefix)]),
                                 runner.trunk.make_cache())
        p = probabilities(logits[0, len(SAMPLED_PROMPT) - 1:], params)
        mass = float(np.prod([p[i, t] for i, t in enumerate(prefix)]))
        for t in range(V):
            out[(*prefix, t)] = mass * p[n - 1, t]
    return out


def test_sampling_with_lookup_drafts_has_the_target_law() -> None:
    """Lookup drafts are one-hot q: kept with probability p(x), else a token from p without x.
    The joint law of the first three tokens over 1,500 seeded runs at depth 3 must be p's."""
    runner = tiny_runner(vocab=V, seed=1)
    params = SamplingParams(0.9)
    exact = _exact_joint(runner, params)
    seen: Counter = Counter()
    lookups = 0
    for s in range(1500):
        result = runner.generate(SAMPLED_PROMPT, 3, depth=3, draft="lookup", seed=s,
                                 temperature=0.9)
        seen[tuple(result.tokens)] += 1
        lookups += result.stats.sources.get("lookup", {}).get("rounds", 0)
    assert lookups > 500  # the prompt's repeats give nearly every round a context draft
    big = [k for k, p in exact.items() if p * 1500 >= 5]
    small = [k for k, p in exact.items() if 0 < p * 1500 < 5]
    observed = [seen[k] for k in big] + ([sum(seen[k] for k in small)] if small else [])
    expected = [exact[k] * 1500 for k in big] + ([sum(exact[k] for k in small) * 1500]
                                                   if small else [])
    assert chisquare(observed, expected).pvalue > 1e-3
