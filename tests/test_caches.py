"""decoder/cache/caches.py: what each cache kind can do, on mlx-lm's own caches."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

from mtpkit.decoder.cache.caches import (
    arrays,
    batch_size,
    batchable,
    exportable,
    freeze,
    snapshot,
    traceable,
    trim,
    trimmable,
    window,
)
from mtpkit.decoder.cache.shapes import PaddedKVCache


def _kv(cls: type = KVCache, rows: int = 5, batch: int = 1) -> KVCache:
    cache = cls()
    keys = mx.arange(batch * 2 * rows * 4, dtype=mx.float32).reshape(batch, 2, rows, 4)
    cache.update_and_fetch(keys, keys + 1)
    return cache


def _recurrent(batch: int = 1) -> ArraysCache:
    cache = ArraysCache(2)
    cache.cache = [mx.ones((batch, 3, 8)), mx.full((batch, 2, 4, 4), 2.0)]
    return cache


def test_attention_trims_and_recurrent_snapshots() -> None:
    kv, rec = _kv(), _recurrent()
    assert trimmable([kv]) and not trimmable([kv, rec])
    saved = snapshot([kv, rec])
    assert saved[0] is None and saved[1] is not None and saved[1][1] is rec.cache[1]
    rec.cache = [None, None]
    rec.cache = saved[1]  # a restore is the references back
    trim([kv, rec], [2, 0])
    assert kv.offset == 3


def test_an_export_thaws_into_the_same_state_and_trims_like_its_cache() -> None:
    kv, rec = _kv(), _recurrent()
    assert exportable([kv, rec]) and not exportable([RotatingKVCache(max_size=8)])
    frozen_kv, frozen_rec = freeze(kv), freeze(rec)
    assert frozen_kv.trim(2) == 2 and frozen_rec.trim(2) == 0 and not frozen_rec.is_trimmable()
    fresh_kv, fresh_rec = KVCache(), ArraysCache(2)
    frozen_kv.thaw(fresh_kv)
    frozen_rec.thaw(fresh_rec)
    assert fresh_kv.offset == 3
    assert mx.array_equal(fresh_kv.keys, kv.keys[..., :3, :])
    assert all(a is b for a, b in zip(fresh_rec.cache, rec.cache, strict=True))
    assert frozen_rec.nbytes == sum(a.nbytes for a in rec.cache)


def test_traced_passes_take_padded_attention_and_plain_recurrent_states() -> None:
    padded, rec = _kv(PaddedKVCache), _recurrent()
    assert traceable(padded) and traceable(rec)
    assert not traceable(_kv())  # unbounded shapes: the stock pass
    assert not traceable(ArraysCache(2))  # no state yet
    rec.prepare(lengths=[1])
    assert not traceable(rec)  # batch bookkeeping: the stock pass
    assert len(arrays(padded)) == 2 and len(arrays(_recurrent())) == 2


def test_the_batch_is_the_first_dimension() -> None:
    assert batch_size(_kv(batch=3)) == 3 and batch_size(_recurrent(batch=2)) == 2
    assert batch_size(KVCache()) == 1 and batch_size(ArraysCache(2)) == 1


def test_what_joins_a_batch() -> None:
    """decoder/cache/batch_cache.py holds KVCache, recurrent states, windows that keep no prefix
    (mlx-lm's batched window has none) and CacheLists of those; nothing else."""
    dsa = CacheList(KVCache(), KVCache())
    assert batchable([KVCache(), _recurrent(), RotatingKVCache(8), dsa])
    for kind in (RotatingKVCache(8, keep=4), ChunkedKVCache(16),
                 CacheList(KVCache(), RotatingKVCache(8, keep=4))):
        assert not batchable([KVCache(), kind]), kind
    assert [window(c) for c in (RotatingKVCache(8), KVCache(), dsa)] == [8, None, None]
