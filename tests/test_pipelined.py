"""Pipelined greedy rounds (decoder/pipelined.py) decide exactly what synchronous rounds decide.

An oracle drafter wrong at a random 30% of positions forces every outcome (rejection at each
draft position, full acceptance) while the next round is already queued on lazy offsets; the
tokens, the per-position acceptance and the round count must equal the synchronous rounds' and
plain decoding's, on the attention-only families (llama, MiMo, DeepSeek-V3's MLA), bounded and
not. With the bundles' own heads the same holds, and a session left by pipelined rounds goes on
exactly (the synchronous tail, a second generation on the prefix cache)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mtpkit
from fixtures.decoder_models import OracleHead
from mtpkit.decoder import pipelined
from mtpkit.decoder.prefix import PrefixCache
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import SamplingParams
from mtpkit.decoder.session import Session, generate_ids

PROMPT = [9, 8, 7, 6, 5, 4]
FAMILIES = ("llama", "mimo", "deepseek_v3")


def decode(runner: Runner, head: object, depth: int, tokens: int, pipelined_: bool,
           bounded: bool) -> tuple[list[int], Session]:
    session = Session(runner.trunk, head, SamplingParams(), depth,  # type: ignore[arg-type]
                      bounded=bounded, pipelined=pipelined_)
    out = [t for batch in generate_ids(session, PROMPT, tokens, set()) for t in batch]
    return out, session


@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forced_outcomes_equal_synchronous_rounds(built: Callable[..., Path], family: str,
                                                  bounded: bool) -> None:
    runner = mtpkit.load(built(family), dtype="float32")
    plain = runner.generate(PROMPT, 120, depth=0)
    assert plain.finish_reason == "length"
    seq = PROMPT + plain.tokens
    vocab = runner.trunk.args.vocab_size
    wrong = np.random.default_rng(1).random(len(seq)) < 0.3
    script = {i: (t + 1) % vocab if wrong[i] else t for i, t in enumerate(seq)}
    for depth in (1, 2, 4):
        oracle = OracleHead(vocab, script, len(PROMPT))
        sync, s_sync = decode(runner, oracle, depth, 120, False, bounded)
        piped, s_piped = decode(runner, oracle, depth, 120, True, bounded)
        assert pipelined.eligible(s_piped) and not s_sync.pipelined
        assert piped == sync == plain.tokens, (family, depth)
        assert s_piped.stats.accepted == s_sync.stats.accepted, (family, depth)
        assert s_piped.stats.proposed == s_sync.stats.proposed
        assert s_piped.stats.verify_calls == s_sync.stats.verify_calls
        kept = s_piped.stats.accepted
        assert 0 < kept[-1] <= kept[0] < s_piped.stats.proposed[0]  # every outcome happened
        assert depth == 1 or kept[-1] < kept[0]


@pytest.mark.parametrize("family", ["mimo", "deepseek_v3"])
def test_own_heads_and_the_session_after(built: Callable[..., Path], family: str) -> None:
    """The bundle's MTP head through `at` (its lazy owed row), then the session's caches and
    owed pairs as synchronous rounds leave them: a prefix-cached second turn continues it."""
    runner = mtpkit.load(built(family), dtype="float32")
    assert runner.head is not None
    plain = runner.generate(PROMPT, 60, depth=0).tokens
    for depth in (1, 3):
        sync, _ = decode(runner, runner.head, depth, 60, False, True)
        piped, session = decode(runner, runner.head, depth, 60, True, True)
        assert piped == sync == plain, (family, depth)
        trunk_at = session.cache[0].offset
        assert isinstance(trunk_at, int) and trunk_at == len(PROMPT) + 59
        assert type(session.cache[0]).__name__ == "PaddedKVCache"
        assert session.owed is not None and session.owed[1].shape[1] >= 1
    prefix = PrefixCache(1 << 30)
    first = runner.generate(PROMPT, 40, depth=2, prefix=prefix)
    again = runner.generate(PROMPT + first.tokens, 40, depth=2, prefix=prefix)
    cold = runner.generate(PROMPT + first.tokens, 40, depth=0)
    assert again.tokens == cold.tokens and again.stats.verify_calls > 0


def test_the_live_cache_masks_what_a_discarded_pass_left() -> None:
    """Rows written past the lazy offset (a queued round that was not kept) are invisible to
    the next pass and overwritten by it: attention equals a fresh cache's."""
    from mlx_lm.models.cache import KVCache

    keys = mx.random.normal((1, 2, 5, 8), key=mx.random.key(0))
    base = KVCache()
    base.update_and_fetch(keys[:, :, :3], keys[:, :, :3])
    live = pipelined.LiveKVCache(base, 16, mx.float32)
    live.update_and_fetch(mx.ones((1, 2, 4, 8)) * 99, mx.ones((1, 2, 4, 8)) * 99)  # discarded
    live.offset = live.offset - 4
    mask = live.make_mask(2)
    k, _ = live.update_and_fetch(keys[:, :, 3:], keys[:, :, 3:])
    assert live.capacity == 256 and k.shape[2] == 256
    assert mx.array_equal(k[:, :, :5], keys).item()
    seen = (mask == 0).tolist()
    assert seen[0][:7] == [True] * 4 + [False] * 3  # row at position 3
    assert seen[1][:7] == [True] * 5 + [False] * 2 and mask[0, 6].item() == -float("inf")
    settled = live.settled(KVCache, 5)
    more = mx.ones((1, 2, 1, 8))
    k, _ = settled.update_and_fetch(more, more)  # mlx-lm's own cache goes on from position 5
    assert k.shape[2] == 6 and mx.array_equal(k, mx.concatenate([keys, more], axis=2)).item()
