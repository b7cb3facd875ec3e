"""Bounded attention shapes (decoder/cache/shapes.py): the padded cache computes what mlx-lm's computes,
decoding with it is greedy-identical on every family, and multi-row attention only ever sees key
lengths that are multiples of 256 (so a GPU compiles each shape once, not once per round)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import mtpkit
from fixtures.drive import generate_ids
from mtpkit.decoder.cache.shapes import (
    STEP,
    PaddedKVCache,
    bounded_caches,
    bucket,
    padded,
    pieces,
)
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import SamplingParams

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "mimo")  # with MTP heads
PROMPT = [5, 17, 42, 99, 7, 3] * 50  # 300 tokens: the prompt crosses a 256 boundary


def test_pieces_cover_every_length_from_a_fixed_set() -> None:
    allowed = {STEP >> i for i in range(9)}
    for n in range(0, 1300):
        sizes = pieces(n)
        assert sum(sizes) == n and set(sizes) <= allowed
        assert len(sizes) <= n // STEP + 8


def test_bucket_holds_every_length_in_a_bounded_set() -> None:
    """Prompts prefilled together are padded to a power of two below STEP, whole STEPs above:
    never twice the work below STEP, and few shapes."""
    allowed = {STEP >> i for i in range(9)}
    for n in range(1, 1300):
        b = bucket(n)
        assert b >= n and (b in allowed or b == padded(n))
        assert b < 2 * n or n == 1
    assert bucket(128) == 128 and bucket(129) == 256 and bucket(300) == 512


def test_padded_cache_views_masks_and_buffer() -> None:
    cache = PaddedKVCache()
    k = mx.ones((1, 2, 300, 8))
    keys, values = cache.update_and_fetch(k, k)
    assert keys.shape[2] == values.shape[2] == 512 and cache.offset == 300
    assert cache.keys.shape[2] % STEP == 0
    mask = cache.make_mask(3)  # before the next 3-row pass: rows 300..302
    assert mask.shape == (3, 512) and mask.dtype == mx.bool_
    want = np.arange(512)[None] <= np.arange(300, 303)[:, None]
    assert np.array_equal(np.array(mask), want)  # causal, and False over every padded key
    keys, _ = cache.update_and_fetch(mx.ones((1, 2, 3, 8)), mx.ones((1, 2, 3, 8)))
    assert keys.shape[2] == 512
    # a pass ending on a STEP boundary sees exactly its keys: mlx-lm's "causal" (no array)
    assert cache.make_mask(512 - 303) == "causal"
    assert cache.make_mask(512 - 303, return_array=True).shape == (209, 512)
    keys, _ = cache.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    assert keys.shape[2] == 304 and cache.make_mask(1) is None  # one row: exactly mlx-lm's
    cache.trim(100)
    keys, _ = cache.update_and_fetch(mx.ones((1, 2, 400, 8)), mx.ones((1, 2, 400, 8)))
    assert cache.offset == 604 and keys.shape[2] == padded(604) == 768
    assert cache.keys.shape[2] % STEP == 0  # grown by whole steps, never sliced first


def test_bounded_caches_replace_only_plain_kv_caches() -> None:
    other = object()
    out = bounded_caches([KVCache(), other])
    assert type(out[0]) is PaddedKVCache and out[1] is other


def verify_passes(trunk, cache: list) -> list[np.ndarray]:
    """Prefill, verify passes of several widths with rollbacks, one-row steps: every logits."""
    out = []
    _, logits = trunk(mx.array([PROMPT]), cache)
    out.append(np.array(logits[0, -1]))
    for width, keep in ((3, 1), (5, 5), (2, 0), (4, 2)):
        _, logits = trunk(mx.array([[9, 4, 11, 2, 8][:width]]), cache)
        out.append(np.array(logits[0]))
        for c in cache:
            c.trim(width - keep)
        _, logits = trunk(mx.array([[6]]), cache)
        out.append(np.array(logits[0]))
    return out


def test_padded_attention_computes_what_mlx_lm_computes(built: Callable[..., Path]) -> None:
    """float32: the padding is masked out exactly; what is left is float32 rounding of the
    reordered softmax sums (the logits here spread over units, a wrong mask moves them by
    tenths)."""
    runner = mtpkit.load(built("llama"), dtype="float32")
    ref = verify_passes(runner.trunk, runner.trunk.make_cache())
    got = verify_passes(runner.trunk, runner.trunk.make_cache(bounded=True))
    for want, have in zip(ref, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_bounded_decoding_is_greedy_identical(built: Callable[..., Path], family: str) -> None:
    """Bounded prefill (padded last chunk, or power-of-two pieces for recurrent families),
    bounded head feeds and padded verify views: the same tokens as unbounded plain decoding."""
    loaded = mtpkit.load(built(family), dtype="float32")
    runner = Runner(loaded.trunk, loaded.head, None)  # token ids, no EOS: every run is 48 long
    plain = Session(runner.trunk, runner.head, SamplingParams(), 0, bounded=False)
    want = [t for b in generate_ids(plain, PROMPT, 48, set()) for t in b]
    for depth in (0, 1, 3):
        session = Session(runner.trunk, runner.head, SamplingParams(), depth, bounded=True)
        got = [t for b in generate_ids(session, PROMPT, 48, set()) for t in b]
        assert got == want, (family, depth)


def _attention_shapes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    real = mx.fast.scaled_dot_product_attention

    def spy(q: mx.array, k: mx.array, v: mx.array, **kw: object) -> mx.array:
        seen.append((q.shape[2], k.shape[2]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("bounded", [True, False])
def test_multi_row_attention_sees_bounded_key_lengths(built: Callable[..., Path],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      bounded: bool) -> None:
    """Unbounded, every verify round presents a new key length (a compile per round on a GPU);
    bounded, multi-row passes only see multiples of 256 and a handful of distinct shapes."""
    loaded = mtpkit.load(built("mimo"), dtype="float32")
    runner = Runner(loaded.trunk, loaded.head, None)
    seen = _attention_shapes(monkeypatch)
    session = Session(runner.trunk, runner.head, SamplingParams(), 2, bounded=bounded)
    list(generate_ids(session, PROMPT, 60, set()))
    multi = {(q, k) for q, k in seen if q > 1}
    assert session.stats.verify_calls >= 20
    if bounded:
        assert all(k % STEP == 0 for _, k in multi)
        assert len(multi) <= 8, sorted(multi)
    else:
        assert len({k for _, k in multi}) >= 20
