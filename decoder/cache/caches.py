"""What each kind of cache can do, in one place: the decoder, the prefix cache, traced passes and
serve ask here instead of finding out by duck typing.

- attention KV (mlx-lm's `KVCache`, our `PaddedKVCache`; the MTP head's too): trimmed to any
  prefix (no snapshot, no recording); exported and restored at any prefix; traced (padded).
- recurrent (mlx-lm's `ArraysCache`: GatedDeltaNet conv and state): never trimmed; snapshot and
  restore (rollback by replay), or the kept positions replayed from what the verify pass
  recorded (decoder/cache/recording.py); exported and restored for prompts that extend the whole export;
  traced (states in and out).
- quantized KV (mlx-lm's `QuantizedKVCache`, what `--kv-bits` turns a trunk's KVCache into
  once it holds `--quantized-kv-start` positions: `quantize`): mlx-lm's own trim; exported
  and restored at any prefix past the switch; not traced, not padded (its attention is two
  quantized matmuls, no cuDNN graph per key length).
- rotating KV (`RotatingKVCache`): mlx-lm's own trim rules; not exported, not traced, not
  quantized (mlx-lm cannot); its `window`.
- a DSA layer's `CacheList` (latent KV, indexer keys): its parts (`leaves`), trimmed together.
- every kind: the batch is the arrays' first dimension (`batch_size`); `batchable`: whether
  decoder/cache/batch_cache.py holds it as rows of one batch.

MLX arrays are immutable values, so a snapshot or an export keeps references, never copies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from mtpkit.decoder.cache.shapes import PaddedKVCache
from mtpkit.decoder.model.kernels import far_off
from mtpkit.decoder.options import KV_GROUP_SIZES, KVQuant

Snapshot = list[Any]  # per cache: None (trimmed instead), a recurrent cache's arrays, or a
# wrapped sliding-window cache's mlx-lm `state`


def is_recurrent(c: Any) -> bool:
    return isinstance(c, ArraysCache)


def batchable(cache: list[Any]) -> bool:
    """Whether decoder/cache/batch_cache.py can hold these caches as rows of one batch: mlx-lm's
    KVCache (a quantized one is refused on its own: options.batch_option), recurrent
    ArraysCache, a sliding window's RotatingKVCache that keeps no prefix (mlx-lm's batched
    window has none), and a CacheList of those (DSA attention)."""
    return all(type(c) in (KVCache, QuantizedKVCache) or is_recurrent(c)
               or type(c) is RotatingKVCache and not c.keep
               or type(c) is CacheList and batchable(list(c.caches)) for c in cache)


def leaves(cache: list[Any]) -> list[Any]:
    """The caches that hold arrays: a CacheList's parts in its place."""
    return [part for c in cache
            for part in (leaves(list(c.caches)) if isinstance(c, CacheList) else [c])]


def window(c: Any) -> int | None:
    """The sliding window a cache's attention sees (None: every position): a RotatingKVCache's
    size, or the `window` a cache that keeps every position masks to (the head's window
    blocks, decoder/model/head.py)."""
    if isinstance(c, RotatingKVCache):
        return c.max_size
    size = getattr(c, "window", None)
    return size if isinstance(size, int) else None


def trimmable(cache: list[Any]) -> bool:
    return all(c.is_trimmable() for c in cache)


def trim(cache: list[Any], counts: list[int]) -> None:
    """Trim each cache by its count (zip: the head's caches trim per block)."""
    for c, n in zip(cache, counts, strict=False):
        if n:
            c.trim(n)


def snapshot(cache: list[Any], ahead: int = 0) -> Snapshot:
    """The states (references) of the caches a pass of `ahead` positions leaves untrimmable, to
    restore them after it: a recurrent cache's arrays; a sliding-window cache (mlx-lm's
    RotatingKVCache) that has wrapped or that the pass wraps (it overwrites its oldest keys, so
    a trim cannot bring them back) by its `state`, its buffers and where it writes next (a
    multi-row pass rebuilds the buffers, never writes into them)."""
    return [None if _trims_after(c, ahead) else list(c.cache) if is_recurrent(c) else c.state
            for c in cache]


def trims_after(cache: list[Any], ahead: int) -> bool:
    """Whether every cache can still be trimmed after a pass of `ahead` more positions (a
    sliding window the pass wraps cannot)."""
    return all(_trims_after(c, ahead) for c in cache)


def _trims_after(c: Any, ahead: int) -> bool:
    window = getattr(c, "max_size", None)
    return c.is_trimmable() and (window is None or c.offset + ahead < window)


def restore(c: Any, saved: Any) -> None:
    """Put back what `snapshot` kept of one cache."""
    if is_recurrent(c):
        c.cache = saved
    else:
        c.state = saved


def recordable(cache: list[Any]) -> bool:
    """Whether a recording pass can commit in place: every cache trims, or is recurrent (its
    layers replay what the pass recorded). Else the round restores and replays."""
    return all(c.is_trimmable() or is_recurrent(c) for c in cache)


def _keys(c: Any) -> mx.array | None:
    """An attention cache's key buffer (a quantized one's packed keys), or None."""
    keys = getattr(c, "keys", None)
    return keys[0] if isinstance(c, QuantizedKVCache) and keys is not None else keys


def extent(cache: list[Any]) -> int:
    """The key buffer length of the first attention cache (0 where there is none yet): with
    the rows, what an attention pass's shapes hang on."""
    for c in cache:
        keys = _keys(c)
        if isinstance(keys, mx.array):
            return keys.shape[2]
    return 0


def batch_size(c: Any) -> int:
    """Sequences the cache holds (its arrays' first dimension; 1 while empty)."""
    arrays = list(c.cache) if is_recurrent(c) else [_keys(c)]
    return next((a.shape[0] for a in arrays if isinstance(a, mx.array)), 1)


# -- quantized KV (--kv-bits: mlx-lm's QuantizedKVCache) ------------------------------------


def unquantizable(cache: list[Any], kv: KVQuant) -> tuple[str, str, str] | None:
    """(the option at fault, why with {name} for its spelling, a hint) where mlx-lm could not
    quantize these caches (filled by a pass: the widths are the keys'), or None. mlx-lm
    converts whatever has `to_quantized`: a sliding-window cache's raises, and a group size
    must divide the heads' width."""
    quantized = [c for c in cache if hasattr(c, "to_quantized")]
    if not quantized:
        return ("kv_bits", "{name} finds no attention KV cache to quantize in this model",
                "drop kv_bits: its state does not grow with the context")
    for c in quantized:
        if not isinstance(c, KVCache):
            return ("kv_bits", f"{{name}}: mlx-lm cannot quantize this model's "
                    f"{type(c).__name__}", "drop kv_bits for this model")
        width = min(a.shape[-1] for a in (c.keys, c.values) if a is not None)
        if any(a.shape[-1] % kv.group_size for a in (c.keys, c.values) if a is not None):
            fits = [g for g in KV_GROUP_SIZES if width % g == 0]
            return ("kv_group_size", f"{{name}} {kv.group_size} does not divide the attention "
                    f"heads' width ({width})", f"use kv_group_size {max(fits)}" if fits
                    else "drop kv_bits: no group size divides this width")
    if (error := attends_quantized(quantized[0], kv)) is not None:
        return ("kv_bits", f"{{name}}: MLX on this device cannot attend over a quantized KV "
                f"cache ({error[:160]})", "drop kv_bits here: mlx-lm's own generate fails "
                "the same way on this device")
    return None


def attends_quantized(c: KVCache, kv: KVQuant) -> str | None:
    """None where this device runs mlx-lm's attention over `c`'s keys quantized as `kv` says,
    through the sliced views a QuantizedKVCache hands it, and gets it right for several query
    rows (a verify pass's, a prefill chunk's) against the float attention over the same keys
    dequantized; else why not. MLX 0.32's CUDA quantized matmul takes only contiguous keys
    (without this check mlx-lm, and we, fail mid-decode with a RuntimeError), and returns
    garbage for two or more rows of a 64-wide input (decoder/model/rows.py)."""
    heads, width = c.keys.shape[1], c.keys.shape[-1]
    keys, values, queries = (mx.random.normal(shape, key=mx.random.key(seed)).astype(c.keys.dtype)
                             for seed, shape in enumerate(((1, heads, 16, width),) * 2
                                                          + ((1, heads, 4, width),)))
    probe = QuantizedKVCache(kv.group_size, kv.bits)
    probe.update_and_fetch(keys[..., :15, :], values[..., :15, :])
    quantized = probe.update_and_fetch(keys[..., 15:, :], values[..., 15:, :])  # sliced views
    try:
        got = quantized_scaled_dot_product_attention(
            queries, *quantized, scale=1.0, mask=None, group_size=kv.group_size, bits=kv.bits)
        mx.eval(got)
    except RuntimeError as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    dense = [mx.dequantize(*q, group_size=kv.group_size, bits=kv.bits).astype(mx.float32)
             for q in quantized]
    want = mx.fast.scaled_dot_product_attention(queries.astype(mx.float32), *dense, scale=1.0)
    if far_off(got, want):
        return f"wrong results for {queries.shape[2]} query rows of {width}-wide heads"
    return None


def quantize(cache: list[Any], kv: KVQuant | None) -> None:
    """mlx-lm's `maybe_quantize_kv_cache`: every KVCache holding at least `kv.start` positions
    becomes a QuantizedKVCache (in place in the list). Called after every pass that commits
    positions; passes never cross the switch (`room`), so a position attends to float keys
    exactly when it lies before `kv.start`, however the text was chunked, drafted or cached."""
    if kv is not None:
        maybe_quantize_kv_cache(cache, kv.start, kv.group_size, kv.bits)


def room(cache: list[Any], kv: KVQuant | None) -> int | None:
    """Positions a pass may add before the caches switch to quantized keys (None: no switch
    ahead). A prefill chunk is split there, a verify pass's drafts cut short (mlx-lm's
    one-token steps switch at the same position)."""
    if kv is None:
        return None
    offsets = [c.offset for c in cache if hasattr(c, "to_quantized")]
    return max(kv.start - offsets[0], 0) if offsets else None


def thawable(state: list[Any], cached: int, kv: KVQuant | None) -> bool:
    """Whether a trunk's export restores exactly at `cached` positions under `kv`: not where
    it holds quantized keys cut back below the switch (a fresh run attends to those positions'
    float keys), nor float keys past it (an export made without kv_bits)."""
    return kv is None or all(cached >= kv.start if isinstance(f, FrozenQKV)
                             else cached <= kv.start or not isinstance(f, FrozenKV)
                             for f in state)


def traceable(c: Any) -> bool:
    """A cache a traced pass (decoder/model/traced.py) can take: a PaddedKVCache, or a recurrent
    cache with every state present and no batch bookkeeping."""
    return type(c) is PaddedKVCache or (type(c) is ArraysCache
                                        and all(a is not None for a in c.cache)
                                        and c.lengths is None and c.left_padding is None)


def arrays(c: Any) -> list[mx.array]:
    """What a cache hands a trace: its KV buffers, or a recurrent layer's states."""
    return list(c.cache) if is_recurrent(c) else [c.keys, c.values]


# -- export and restore (the prefix cache, decoder/cache/prefix.py) -------------------------------


def exportable(cache: list[Any]) -> bool:
    """Caches an export holds exactly: mlx-lm's KVCache (and subclasses), QuantizedKVCache and
    ArraysCache."""
    return all(isinstance(c, KVCache | QuantizedKVCache | ArraysCache) for c in cache)


@dataclass
class Positions:
    """Arrays over a prompt's first `offset` positions, trimmed like an attention cache. An
    export's parts are shared by the copies mlx-lm's LRUPromptCache makes on fetch (MLX arrays
    are values); only `offset` is the copy's own."""

    offset: int
    nbytes: int  # of the buffers the arrays keep alive

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def __deepcopy__(self, memo: dict) -> Positions:
        return replace(self)

    def arrays(self) -> list[mx.array]:
        return []


@dataclass
class FrozenKV(Positions):
    """An attention cache's keys and values (views)."""

    keys: mx.array | None = None
    values: mx.array | None = None

    def thaw(self, cache: KVCache) -> KVCache:
        """The export restored into `cache` (returned: every thaw says which cache to use)."""
        if self.offset and self.keys is not None and self.values is not None:
            cache.keys = self.keys[..., :self.offset, :]
            cache.values = self.values[..., :self.offset, :]
            cache.offset = self.offset
        return cache

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]


@dataclass
class FrozenQKV(Positions):
    """A quantized attention cache's packed keys and values with their scales and biases."""

    keys: tuple[mx.array, ...] = ()
    values: tuple[mx.array, ...] = ()
    group_size: int = 64
    bits: int = 8

    def thaw(self, cache: Any) -> QuantizedKVCache:
        """A QuantizedKVCache in place of the session's fresh `cache`."""
        out = QuantizedKVCache(self.group_size, self.bits)
        if self.offset and self.keys:
            out.keys = tuple(a[..., :self.offset, :] for a in self.keys)
            out.values = tuple(a[..., :self.offset, :] for a in self.values)
            out.offset = self.offset
        return out

    def arrays(self) -> list[mx.array]:
        return [*self.keys, *self.values]


@dataclass
class FrozenArrays:
    """A recurrent cache's arrays (GatedDeltaNet conv and state): not trimmable."""

    states: list[mx.array | None]
    nbytes: int

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    def __deepcopy__(self, memo: dict) -> FrozenArrays:
        return replace(self, states=list(self.states))

    def thaw(self, cache: ArraysCache) -> ArraysCache:
        cache.cache = list(self.states)
        return cache

    def arrays(self) -> list[mx.array]:
        return [a for a in self.states if a is not None]


@dataclass
class FrozenHidden(Positions):
    """The trunk hiddens of a prompt's positions, which the head's pairs start from."""

    hidden: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [self.hidden] if self.hidden is not None else []


def freeze(cache: Any) -> FrozenKV | FrozenQKV | FrozenArrays:
    """An export of one cache (views of its arrays, not copies)."""
    if isinstance(cache, QuantizedKVCache):
        if cache.keys is None:
            return FrozenQKV(0, 0, group_size=cache.group_size, bits=cache.bits)
        off = cache.offset
        keys, values = (tuple(a[..., :off, :] for a in part)
                        for part in (cache.keys, cache.values))
        return FrozenQKV(off, cache.nbytes, keys, values, cache.group_size, cache.bits)
    if isinstance(cache, KVCache):
        if cache.keys is None:
            return FrozenKV(0, 0)
        off = cache.offset
        return FrozenKV(off, cache.keys.nbytes + cache.values.nbytes, cache.keys[..., :off, :],
                        cache.values[..., :off, :])
    states = list(cache.cache)
    return FrozenArrays(states, sum(a.nbytes for a in states if a is not None))
