"""Drafts from the context (decoder/drafters/lookup.py): the index finds the longest earlier match, and
decoding with lookup drafts (alone, beside the head, fixed or auto depth) stays exact."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

import mtpkit
from fixtures.decoder_models import tiny_runner
from fixtures.drive import generate_ids
from fixtures.laws import exact_joint, pvalue
from mtpkit.decoder.drafters.drafts import Draft
from mtpkit.decoder.drafters.drafts import chain as chained_draft
from mtpkit.decoder.drafters.lookup import MAX_NGRAM, ContextIndex
from mtpkit.decoder.options import Source
from mtpkit.decoder.rounds.controller import CHAIN_MIN_NGRAM, Controller
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import MAX_AUTO_DEPTH, Runner
from mtpkit.decoder.sampling import SamplingParams
from mtpkit.decoder.tuning.curve import CostCurve
from mtpkit.decoder.tuning.policy import LONG_MATCH, DepthPolicy
from mtpkit.schemas import validate

FAMILIES = ("llama", "qwen3_5", "qwen3_next", "deepseek_v3", "mimo")
PROMPT = [5, 17, 42, 99, 7, 3, 5, 17, 42, 99, 7, 3, 5, 17]


def brute_force(tokens: list[int], width: int, after: tuple[int, ...] = (),
                min_ngram: int = 1) -> tuple[list[int], int]:
    """The longest suffix (<= MAX_NGRAM) of tokens + after with an earlier occurrence in the
    committed `tokens` (ending before their last); what followed its latest one, continued
    periodically past the end."""
    text = tokens + list(after)
    for n in range(min(MAX_NGRAM, len(text) - 1), min_ngram - 1, -1):
        suffix = text[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if text[end - n + 1:end + 1] == suffix:
                period = len(text) - 1 - end
                return [text[end + 1 + i % period] for i in range(width)], n
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
            after = tuple(rng.randrange(6) for _ in range(rng.randrange(1, 4)))
            assert index.propose(5, 2, list(after)) == brute_force(tokens, 5, after, 2)
            assert index.tokens == tokens, "a lookup after drafts commits nothing"


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
    assert policy.choose(0) == (None, 0)  # nothing to draft from
    assert policy.choose(4)[0] == "lookup"  # the 50% prior pays at this cost
    for _ in range(40):
        policy.record(4, 0, "lookup")
    assert policy.choose(8) == (None, 0)
    for _ in range(200):
        policy.record(4, 4, "lookup")
    assert policy.choose(8) == ("lookup", 8)  # all kept: draft as far as the match goes
    assert policy.choose(3) == ("lookup", 3)


def test_lookups_are_tracked_by_match_length() -> None:
    """Short matches that miss do not stop long ones from drafting (and vice versa): each
    match length 1, 2, 3, 4+ has its own acceptance."""
    policy = DepthPolicy(CostCurve([1.0 + 0.3 * t for t in range(16)], plain=1.0, draft=0.0),
                         8, sources=("lookup",))
    for _ in range(40):
        policy.record(4, 0, "lookup", match=1)
        policy.record(4, 4, "lookup", match=7)
    assert policy.choose(8, match=1) == (None, 0)
    assert policy.choose(8, match=4) == ("lookup", 8) == policy.choose(8, match=8)
    assert policy.choose(8, match=2)[0] == "lookup", "an untried length starts from the prior"
    assert policy.acceptance("lookup", 1)[0] < 0.1 < 0.9 < policy.acceptance("lookup", 5)[0]


V = 4
SAMPLED_PROMPT = [1, 2, 1, 2, 1, 2, 1]
DE_BRUIJN = [0, 0, 1, 0, 2, 0, 3, 1, 1, 2, 1, 3, 2, 2, 3, 3, 0]  # every pair of tokens once


def test_sampling_with_lookup_drafts_has_the_target_law() -> None:
    """Lookup drafts are one-hot q: kept with probability p(x), else a token from p without x.
    The joint law of the first three tokens over 1,500 seeded runs at depth 3 must be p's."""
    runner = tiny_runner(vocab=V, seed=1)
    params = SamplingParams(0.9)
    exact = exact_joint(runner, params, SAMPLED_PROMPT, V)
    seen: Counter = Counter()
    lookups = 0
    for s in range(1500):
        result = runner.generate(SAMPLED_PROMPT, 3, depth=3, draft="lookup", seed=s,
                                 temperature=0.9)
        seen[tuple(result.tokens)] += 1
        lookups += result.stats.sources.get("lookup", {}).get("rounds", 0)
    assert lookups > 500  # the prompt's repeats give nearly every round a context draft
    assert pvalue(seen, exact) > 1e-3


def _chain_session(runner: Runner, params: SamplingParams,
                   seed: int | None = None) -> tuple[Session, Controller]:
    """An auto session whose context drafts alone have failed and whose head's second draft
    has (so depth-1 head rounds are chosen), and whose chain has paid so far: head rounds go
    on with context tokens where the text matches."""
    runner._costs = CostCurve([1.0 + 0.05 * t for t in range(16)], plain=1.0, draft=0.1)
    policy = DepthPolicy(runner.costs(), MAX_AUTO_DEPTH, sources=("head", "lookup"))
    for _ in range(60):
        for match in range(1, LONG_MATCH + 1):
            policy.record(4, 0, "lookup", match=match)
    for _ in range(10):
        policy.record(2, 1, "head")
        policy.trackers["chain"].record(7, 7)
    session = Session(runner.trunk, runner.head, params, MAX_AUTO_DEPTH, seed, runner.rollback,
                      draft=Source.BOTH)
    return session, Controller(session, policy)


@pytest.mark.parametrize("family", FAMILIES[1:])
def test_head_drafts_continued_by_the_context_are_greedy_identical(
        built: Callable[..., Path], family: str) -> None:
    """Every family's rollback through rounds of head drafts plus context drafts, each kept
    or rejected at any position. The tiny random trunks write text no context predicts, so
    the drafts here are the plain run's own tokens, each wrong one time in five (the head's
    cache work done as usual); where the context would append is checked on its own below."""
    runner = _no_eos(mtpkit.load(built(family), dtype="float32"))
    plain = runner.generate(PROMPT, 80, depth=0).tokens + [0] * 16
    session, controller = _chain_session(runner, SamplingParams())
    assert session.lookup is not None
    rng, vocab = random.Random(family), runner.trunk.args.vocab_size
    draft = session.head_draft

    def oracle(start: int, count: int) -> list[int]:
        at = len(session.lookup.tokens) - len(PROMPT) + start
        return [(t + (rng.random() < 0.2)) % vocab for t in plain[at:at + count]]

    def guessing(depth: int) -> Draft:
        made = draft(depth)  # the head's cache work, as usual
        return replace(made, tokens=mx.array([[session.last, *oracle(0, depth)]]))

    def extension(made: Draft, most: int) -> Draft:
        room = min(most, session.depth) - made.depth
        return chained_draft(made, oracle(made.depth, rng.randint(1, room))) if room > 0 else made

    session.head_draft = guessing  # type: ignore[method-assign]
    controller.extend = extension  # type: ignore[method-assign]
    tokens = [t for batch in generate_ids(session, PROMPT, 80, set(), controller) for t in batch]
    assert tokens == plain[:80], family
    validate({"bundle": family, "text": "", "tokens": tokens, "finish_reason": "length",
              "stats": session.stats.to_dict()}, "generation")
    chain = session.stats.sources["head+lookup"]
    assert chain["rounds"] > 5 and chain["accepted"][2] > 0, chain
    assert any(0 < k < p for k, p in zip(chain["accepted"], chain["proposed"], strict=True))


def test_chain_extends_only_past_a_match_of_the_drafts() -> None:
    """What a chain round appends is what followed the text plus the head's drafts in the
    context (a match of at least CHAIN_MIN_NGRAM tokens), and it is verified with them."""
    runner = tiny_runner(vocab=12, markov=True, logit_scale=4.0)
    session, controller = _chain_session(runner, SamplingParams())
    assert session.lookup is not None
    chained: list[tuple[list[int], list[int], list[int]]] = []
    extension, draft = controller.extend, session.head_draft

    def guessing(depth: int) -> Draft:
        """A head that has learnt the cycle: its drafts are the context's guess."""
        made = draft(depth)
        guess = session.lookup.propose(depth)[0] or made.tokens.tolist()[0][1:]
        return replace(made, tokens=mx.array([[session.last, *guess]]))

    def spy(made: Draft, most: int) -> Draft:
        committed = list(session.lookup.tokens)
        longer = extension(made, most)
        if longer.depth > made.depth:
            drafts = made.tokens.tolist()[0][1:]
            chained.append((committed, drafts, longer.tokens.tolist()[0][1 + made.depth:]))
        return longer

    controller.extend, session.head_draft = spy, guessing  # type: ignore[method-assign]
    list(generate_ids(session, [1, 2, 3], 120, set(), controller))
    assert chained, "the cycle gives the head's drafts a context match"
    for committed, drafts, more in chained:
        assert len(drafts) + len(more) <= MAX_AUTO_DEPTH
        reference, n = brute_force(committed, len(more), tuple(drafts), CHAIN_MIN_NGRAM)
        assert more == reference and n >= CHAIN_MIN_NGRAM
    chain = session.stats.sources["head+lookup"]
    assert chain["rounds"] == len(chained)
    assert sum(chain["proposed"]) == sum(len(d) + len(m) for _, d, m in chained)


def test_chain_policy_counts_head_and_extension_apart() -> None:
    policy = DepthPolicy(CostCurve([1.0 + 0.05 * t for t in range(16)], plain=1.0, draft=0.1),
                         8, sources=("head", "lookup"))
    assert "chain" in policy.trackers
    assert "chain" not in DepthPolicy(policy.curve, 8, sources=("head",)).trackers
    policy.record(5, 1, "chain", drafted=2)  # a head draft rejected: the chain untested
    assert policy.trackers["head"].seen[:3] == [1.0, 1.0, 0.0]
    assert policy.trackers["head"].kept[:2] == [1.0, 0.0]
    assert sum(policy.trackers["chain"].seen) == 0
    policy.record(5, 3, "chain", drafted=2)  # both head drafts kept, one of three extensions
    assert policy.trackers["chain"].seen[:4] == [1.0, 1.0, 1.0, 0.0]
    assert policy.trackers["chain"].kept[:2] == [1.0, 0.0]
    for _ in range(100):
        policy.record(3, 3, "chain", drafted=1)
    assert policy.extension(1, 7) == 7, "kept extensions are worth their cheap verify rows"
    assert policy.extension(1, 2) == 2 and policy.extension(2, 7) == 6, "8 drafts at most"
    for _ in range(200):
        policy.record(4, 1, "chain", drafted=1)
    assert policy.extension(1, 7) == 0, "rejected extensions are not drafted"
    dear = DepthPolicy(CostCurve([1.0 + 2.0 * t for t in range(16)], plain=1.0, draft=0.1),
                       8, sources=("head", "lookup"))
    assert dear.extension(1, 7) == 0, "a 50% guess is not worth a row that costs 2 passes"


def test_sampling_with_chain_rounds_has_the_target_law() -> None:
    """Head drafts (q from the head) followed by context drafts (one-hot q) in one round: the
    joint law of the first three tokens over 1,500 seeded runs must be p's."""
    runner = tiny_runner(vocab=V, seed=1)
    params = SamplingParams(0.9)
    exact = exact_joint(runner, params, DE_BRUIJN, V)
    seen: Counter = Counter()
    chains = 0
    for s in range(1500):
        session, controller = _chain_session(runner, params, seed=s)
        batches = generate_ids(session, DE_BRUIJN, 12, set(), controller)
        tokens = next(batches) + next(batches)  # the first token, then the first round's
        chains += session.stats.sources.get("head+lookup", {}).get("rounds", 0)
        while len(tokens) < 3:
            tokens += next(batches)
        seen[tuple(tokens[:3])] += 1
    assert chains > 1000, "most first rounds chain context drafts to the head's"
    assert pvalue(seen, exact) > 1e-3
