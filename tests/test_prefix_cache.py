"""The prefix cache (decoder/cache/prefix.py): a prompt that starts with a cached one prefills only its
new tokens and decodes exactly as a cold start, in every family and drafting mode."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import fixtures.numerics  # noqa: F401  (float32 runs in float32 on GPU backends too)
import mtpkit
from fixtures.configs import FAMILIES
from mtpkit.decoder.cache.caches import exportable
from mtpkit.decoder.cache.prefix import PrefixCache, turn_end
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.sampling import SamplingParams

TURN1 = [5, 9, 14, 3, 22, 7, 8, 30, 11, 4] * 3
TURN2 = TURN1 + [17, 6, 25, 13]  # the next turn: the first, then new tokens
BRANCH = TURN1[:12] + [40, 41, 42]  # leaves the first turn part way
RECURRENT = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # GatedDeltaNet layers: no trim


def _modes(has_head: bool) -> list[dict]:
    lookup = {"depth": 2, "draft": "lookup"}
    return [{"depth": 0}, lookup] + ([{"depth": 2, "draft": "head"}, {"depth": "auto"}]
                                     if has_head else [{"depth": "auto", "draft": "lookup"}])


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_prompts_decode_exactly_as_cold_ones(built: Callable[..., Path], family: str) -> None:
    runner = mtpkit.load(built(family), dtype="float32")
    assert exportable(runner.trunk.make_cache())
    # --depth auto decides by the curve as given, uncorrected by timings, and each generation
    # starts from the same acceptance prior (the runner's memory of earlier requests cleared),
    # so cold and warm runs choose alike and their drafts can be compared
    runner._costs = replace(runner.costs(), estimate=False)

    def generate(prompt: list[int], **options: Any) -> Any:
        runner.kept.clear()
        return runner.generate(prompt, 40, **options)

    for mode in _modes(runner.head is not None):
        cold = {n: generate(p, **mode) for n, p in
                (("turn1", TURN1), ("turn2", TURN2), ("branch", BRANCH))}
        cache = PrefixCache(1 << 30)
        for name, prompt in (("turn1", TURN1), ("turn2", TURN2), ("branch", BRANCH),
                             ("turn2", TURN2), ("turn1", TURN1)):
            warm = generate(prompt, prefix=cache, **mode)
            want = cold[name]
            assert warm.tokens == want.tokens, (family, mode, name)
            # the same drafts were proposed and kept: the head's and the lookup's state came back
            assert (warm.stats.proposed, warm.stats.accepted) == (
                want.stats.proposed, want.stats.accepted), (family, mode, name)
            assert warm.stats.prompt_tokens + warm.cached_tokens == len(prompt)
        # a recurrent state serves only prompts extending its whole entry: turn 2 (twice)
        assert (cache.hits, cache.misses) == ((2, 3) if family in RECURRENT else (4, 1))
    turn2 = runner.generate(TURN2, 8, prefix=(cache := PrefixCache(1 << 30)))
    assert turn2.cached_tokens == 0 and turn2.stats.prompt_tokens == len(TURN2)
    extended = runner.generate(TURN2 + [3, 3], 8, prefix=cache)
    assert (extended.cached_tokens, extended.stats.prompt_tokens) == (len(TURN2), 2)
    branch = runner.generate(BRANCH, 8, prefix=cache)
    # attention KV is trimmed back to the shared 12 tokens; a recurrent state cannot be
    assert branch.cached_tokens == (0 if family in RECURRENT else 12)


def test_the_byte_bound_evicts_the_least_recently_used(built: Callable[..., Path]) -> None:
    runner = mtpkit.load(built("llama"), dtype="float32")
    probe = PrefixCache(1 << 30)
    runner.generate(TURN1, 4, depth=0, prefix=probe)
    one = probe.nbytes
    assert one > 0 and len(probe) == 1
    cache = PrefixCache(int(1.5 * one))
    others = [[t + 50 for t in TURN1], [t + 100 for t in TURN1]]
    for prompt in [TURN1, *others]:
        runner.generate(prompt, 4, depth=0, prefix=cache)
        assert len(cache) == 1 and cache.nbytes <= cache.max_bytes
    assert runner.generate(others[1] + [1], 4, depth=0, prefix=cache).cached_tokens == len(TURN1)
    assert runner.generate(TURN1 + [1], 4, depth=0, prefix=cache).cached_tokens == 0, "evicted"
    assert PrefixCache(0).max_bytes == 0
    nothing = PrefixCache(0)
    runner.generate(TURN1, 4, depth=0, prefix=nothing)
    assert len(nothing) == 0 and nothing.nbytes == 0



def _state(session: Session) -> list[np.ndarray]:
    """Every array a started session decodes from: trunk caches, head caches, the owed pair."""
    out = []
    for c in session.cache + session.mtp_cache:
        arrays = [c.keys[..., :c.offset, :], c.values[..., :c.offset, :]] if \
            isinstance(c, KVCache) else [a for a in c.cache if a is not None]
        out += [np.array(a) for a in arrays]
    assert session.owed is not None
    return out + [np.array(a) for a in session.owed]


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
@pytest.mark.parametrize("bounded", [False, True])
def test_a_restored_session_holds_the_cold_sessions_state(built: Callable[..., Path], family: str,
                                                          bounded: bool) -> None:
    """Greedy identity cannot see the head's state (any drafts keep the output exact): compare
    it, and every other cache, with a cold start's, array by array: from a whole entry, and
    from the checkpoint the first prompt left at 12 tokens (a recurrent model's only way back
    there; attention KV is trimmed to it instead)."""
    runner = mtpkit.load(built(family), dtype="float32")

    def session(cache: PrefixCache, marks: tuple[int, ...] = ()) -> Session:
        return Session(runner.trunk, runner.head, SamplingParams(), 2, None, "record", bounded,
                       draft="both", prefix=cache, checkpoints=marks)

    cache = PrefixCache(1 << 30)
    first = session(cache, (12, 12, 500))
    first.start(TURN1)
    assert first.stats.prompt_tokens == len(TURN1) and len(cache) == 1 + (family in RECURRENT)
    for prompt, cached in ((TURN2, len(TURN1)), (BRANCH, 12)):
        warm, cold = session(cache), session(PrefixCache(1 << 30))
        assert warm.start(prompt) == cold.start(prompt) and warm.cached_tokens == cached
        assert warm.stats.prompt_tokens == len(prompt) - cached
        assert warm.lookup is not None and cold.lookup is not None
        assert warm.lookup.tokens == cold.lookup.tokens and warm.lookup.ends == cold.lookup.ends
        got, want = _state(warm), _state(cold)
        assert [a.shape for a in got] == [a.shape for a in want] and len(got) > 4
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max() or 1))


def test_turn_end_is_where_the_next_turn_leaves_this_one() -> None:
    """The checkpoint serve asks for: the length this prompt shares with its follow-up; none
    where the follow-up keeps all of it (the cache serves it whole) or none of it."""
    assert turn_end([1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9]) == [3]
    assert turn_end([1, 2, 3], [1, 2, 3, 7, 7]) == []
    assert turn_end([1, 2, 3], [1, 2]) == [2]
    assert turn_end([1, 2, 3], [8, 2, 3]) == []
