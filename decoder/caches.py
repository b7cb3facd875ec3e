"""What each kind of cache can do, in one place: the decoder, the prefix cache, traced passes and
serve ask here instead of finding out by duck typing.

- attention KV (mlx-lm's `KVCache`, our `PaddedKVCache`; the MTP head's too): trimmed to any
  prefix (no snapshot, no recording); exported and restored at any prefix; traced (padded).
- recurrent (mlx-lm's `ArraysCache`: GatedDeltaNet conv and state): never trimmed; snapshot and
  restore (rollback by replay), or states recorded per verify position and one committed
  (decoder/recording.py); exported and restored for prompts that extend the whole export;
  traced (states in and out).
- rotating and quantized KV (`RotatingKVCache`, `QuantizedKVCache`): mlx-lm's own trim rules;
  not exported, not traced.
- every kind: the batch is the arrays' first dimension (`batch_size`).

MLX arrays are immutable values, so a snapshot or an export keeps references, never copies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from mtpkit.decoder.shapes import PaddedKVCache

Snapshot = list[list[Any] | None]


def is_recurrent(c: Any) -> bool:
    return isinstance(c, ArraysCache)


def trimmable(cache: list[Any]) -> bool:
    return all(c.is_trimmable() for c in cache)


def trim(cache: list[Any], counts: list[int]) -> None:
    """Trim each cache by its count (zip: the head's caches trim per block)."""
    for c, n in zip(cache, counts, strict=False):
        if n:
            c.trim(n)


def snapshot(cache: list[Any]) -> Snapshot:
    """The untrimmable caches' states (references), to restore them after a pass."""
    return [None if c.is_trimmable() else list(c.cache) for c in cache]


def extent(cache: list[Any]) -> int:
    """The key buffer length of the first attention cache (0 where there is none yet): with
    the rows, what an attention pass's shapes hang on."""
    for c in cache:
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array):
            return keys.shape[2]
    return 0


def batch_size(c: Any) -> int:
    """Sequences the cache holds (its arrays' first dimension; 1 while empty)."""
    arrays = list(c.cache) if is_recurrent(c) else [getattr(c, "keys", None)]
    return next((a.shape[0] for a in arrays if isinstance(a, mx.array)), 1)


def traceable(c: Any) -> bool:
    """A cache a traced pass (decoder/traced.py) can take: a PaddedKVCache, or a recurrent
    cache with every state present and no batch bookkeeping."""
    return type(c) is PaddedKVCache or (type(c) is ArraysCache
                                        and all(a is not None for a in c.cache)
                                        and c.lengths is None and c.left_padding is None)


def arrays(c: Any) -> list[mx.array]:
    """What a cache hands a trace: its KV buffers, or a recurrent layer's states."""
    return list(c.cache) if is_recurrent(c) else [c.keys, c.values]


# -- export and restore (the prefix cache, decoder/prefix.py) -------------------------------


def exportable(cache: list[Any]) -> bool:
    """Caches an export holds exactly: mlx-lm's KVCache (and subclasses) and ArraysCache."""
    return all(isinstance(c, KVCache | ArraysCache) for c in cache)


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

    def thaw(self, cache: KVCache) -> None:
        if self.offset and self.keys is not None and self.values is not None:
            cache.keys = self.keys[..., :self.offset, :]
            cache.values = self.values[..., :self.offset, :]
            cache.offset = self.offset

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]


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

    def thaw(self, cache: ArraysCache) -> None:
        cache.cache = list(self.states)

    def arrays(self) -> list[mx.array]:
        return [a for a in self.states if a is not None]


@dataclass
class FrozenHidden(Positions):
    """The trunk hiddens of a prompt's positions, which the head's pairs start from."""

    hidden: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [self.hidden] if self.hidden is not None else []


def freeze(cache: Any) -> FrozenKV | FrozenArrays:
    """An export of one cache (views of its arrays, not copies)."""
    if isinstance(cache, KVCache):
        if cache.keys is None:
            return FrozenKV(0, 0)
        off = cache.offset
        return FrozenKV(off, cache.keys.nbytes + cache.values.nbytes, cache.keys[..., :off, :],
                        cache.values[..., :off, :])
    states = list(cache.cache)
    return FrozenArrays(states, sum(a.nbytes for a in states if a is not None))
