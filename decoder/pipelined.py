"""Greedy MTP rounds queued back to back, so the host builds the next round while the device runs
this one.

A synchronous round costs the host's graph build and hand-off plus the device's pass, because the
next round's inputs wait for this round's acceptance on the host. On MLX's CUDA backend the host
work alone is about a plain step (BENCHMARKS.md, "Second GPU session"), so a round cannot beat a
pipelined plain step by much. Here acceptance stays on the device: the caches' offsets are lazy
scalars (`LiveKVCache`), the kept count `n` trims them by arithmetic, the next round drafts from
row `n` of this round's hidden states, and the host reads round r's tokens only after round r+1
is queued, the way plain decoding reads a token after queuing the next step. Same arithmetic as
a synchronous round: the verify pass writes K+1 rows at the committed length and attends through
a causal mask, so the kept rows are the rows a synchronous round keeps (tests compare tokens).

Used for greedy decoding at a fixed depth with the MTP head over caches that are plain KV caches
(attention only: recurrent, rotating and quantized caches, lookup drafts, sampling, the depth
policy and sharded trunks take the synchronous rounds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mtpkit.decoder.sampling import greedy
from mtpkit.decoder.shapes import PaddedKVCache, padded, pieces
from mtpkit.decoder.trunk import Trunk

if TYPE_CHECKING:
    from mtpkit.decoder.session import Session

PLAIN_CACHES = (KVCache, PaddedKVCache)
# mlx-lm families whose attention selects with the mask (mx.where(mask, scores, min)) rather
# than passing it to scaled_dot_product_attention: they need it bool.
SELECTING_MASK = ("bailing_hybrid", "bailing_moe_v3", "deepseek_v3", "deepseek_v32", "gemma2",
                  "glm4_moe_lite", "kimi_k3", "kimi_linear", "longcat_flash", "mistral4")


@functools.lru_cache(maxsize=64)
def _constant(kind: str, n: int, dtype: mx.Dtype = mx.int32) -> mx.array:
    """Evaluated once: on MLX's CUDA backend an op with no inputs (arange, zeros) in a queued
    graph makes `mx.async_eval` wait for the device, which would undo the pipelining."""
    out = {"rows": lambda: mx.arange(n)[:, None],  # a pass's row offsets
           "cols": lambda: mx.arange(n)[None],  # key positions (mask)
           "slots": lambda: mx.arange(n).reshape(1, 1, n, 1),  # key positions (write)
           "zero": lambda: mx.zeros((), dtype),
           "ninf": lambda: mx.array(-mx.inf, dtype)}[kind]()
    mx.eval(out)
    return out


class LiveKVCache(KVCache):
    """A KV cache whose offset is a lazy int32 scalar. Its buffer has whole STEPs, grown by the
    host (`reserve`) to a bound it knows; every pass sees the whole buffer, with an additive
    mask (bool for SELECTING_MASK families) that hides each row's future (and whatever a discarded pass left past the offset).
    Rows are written by a gather and a select, and the mask is additive, because on MLX's CUDA
    backend a slice update at a lazy start and a bool attention mask wait for the device when
    queued (measured, BENCHMARKS.md)."""

    def __init__(self, source: KVCache, capacity: int, dtype: mx.Dtype,
                 selecting: bool = False) -> None:
        super().__init__()
        self.selecting = selecting  # the model selects with the mask: give it bool
        self.keys, self.values = source.keys, source.values
        self.offset = mx.array(source.offset, mx.int32)
        self.dtype = dtype if self.keys is None else self.keys.dtype
        self.capacity = 0 if self.keys is None else self.keys.shape[2]
        self.reserve(capacity)

    def reserve(self, end: int) -> None:
        """Room for positions up to `end` (a bound on the lazy offset plus a pass)."""
        if end <= self.capacity:
            return
        grow, self.capacity = padded(end) - self.capacity, padded(end)
        if self.keys is not None:
            self.keys, self.values = (mx.concatenate([a, mx.zeros((*a.shape[:2], grow,
                                                                    a.shape[3]), a.dtype)],
                                                     axis=2) for a in (self.keys, self.values))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys = mx.zeros((*keys.shape[:2], self.capacity, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((*values.shape[:2], self.capacity, values.shape[3]),
                                   values.dtype)
            mx.eval(self.keys, self.values)
        rows = keys.shape[2]
        at = _constant("slots", self.capacity) - self.offset  # row of each slot, if written
        written = (at >= 0) & (at < rows)
        index = mx.clip(at[0, 0, :, 0], 0, rows - 1)
        self.keys = mx.where(written, mx.take(keys, index, axis=2), self.keys)
        self.values = mx.where(written, mx.take(values, index, axis=2), self.values)
        self.offset = self.offset + rows
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array:
        seen = self.offset + _constant("rows", n) >= _constant("cols", self.capacity)
        if self.selecting:
            return seen
        return mx.where(seen, _constant("zero", 0, self.dtype), _constant("ninf", 0, self.dtype))

    def settled(self, kind: type, offset: int) -> KVCache:
        """This cache as the session's own kind again, holding `offset` positions."""
        cache = kind()
        cache.keys, cache.values, cache.offset = self.keys, self.values, offset
        return cache


def eligible(session: Session) -> bool:
    """Whether this session's rounds can be queued back to back (see the module docstring)."""
    return (session.params.greedy and session.head is not None and session.lookup is None
            and session.policy is None and session.depth > 0 and type(session.trunk) is Trunk
            and all(type(c) in PLAIN_CACHES for c in [*session.cache, *session.mtp_cache]))


def rounds(session: Session, left: Callable[[], int]) -> Iterator[list[int]]:
    """Yield each round's committed tokens, round r read after round r+1 is queued. Returns
    (the session consistent again, as after synchronous rounds) once fewer than two rounds'
    worth of tokens are wanted; closing it early does the same."""
    depth, head = session.depth, session.head
    assert head is not None and session.owed is not None
    width = depth + 1
    owed_hidden, owed_tokens = session.owed
    _feed(session, owed_hidden[:, :-1], owed_tokens[:, :-1])
    kinds = [type(c) for c in session.cache], [type(c) for c in session.mtp_cache]
    trunk_at = session.cache[0].offset  # host-known committed lengths
    head_at = [c.offset for c in session.mtp_cache]
    dtype = owed_hidden.dtype
    selecting = getattr(session.trunk.args, "model_type", "") in SELECTING_MASK
    trunk = [LiveKVCache(c, trunk_at + 2 * width, dtype, selecting) for c in session.cache]
    heads = [LiveKVCache(c, head_at[0] + 2 * width + depth, dtype, selecting)
             for c in session.mtp_cache]
    state = (mx.array([[session.last]]), owed_hidden[:, -1:], owed_tokens[:, -1:],
             mx.array(0, mx.int32))
    last, owed = session.last, (owed_hidden[:, -1:], owed_tokens[:, -1:])
    feed = 1  # owed rows the head takes in the round being read
    state, out = _round(session, trunk, heads, state)
    mx.async_eval(out)
    try:
        while left() > 2 * width:
            for cache in trunk:
                cache.reserve(trunk_at + 2 * width)
            for cache in heads:
                cache.reserve(head_at[0] + 2 * width + depth)
            queued, queued_out = _round(session, trunk, heads, state)
            mx.async_eval(queued_out)
            targets, kept = out
            n = int(kept.item())
            committed = targets.tolist()[:n + 1]
            trunk_at += n + 1
            head_at[0] += feed
            feed = n + 1
            last, owed = committed[-1], (state[1][:, :n + 1], state[2][:, :n + 1])
            session.stats.count_round("head", depth, n, n == depth)
            session.last = last
            yield committed
            state, out = queued, queued_out
    finally:
        session.cache[:] = [c.settled(k, trunk_at) for c, k in zip(trunk, kinds[0], strict=True)]
        session.mtp_cache[:] = [c.settled(k, at) for c, k, at
                                in zip(heads, kinds[1], head_at, strict=True)]
        session.last, session.owed = last, owed


def _feed(session: Session, hidden: mx.array, tokens: mx.array) -> None:
    """Owed pairs into the head's cache (bounded pieces where shapes are bounded)."""
    head = session.head
    assert head is not None
    at = 0
    for size in pieces(tokens.shape[1]) if session.bounded else [tokens.shape[1]] * bool(
            tokens.shape[1]):
        head(hidden[:, at:at + size], tokens[:, at:at + size], session.mtp_cache, 0,
             last_only=True)
        at += size
    mx.eval([c.state for c in session.mtp_cache])


def _round(session: Session, trunk: list[LiveKVCache], heads: list[LiveKVCache],
           state: tuple[mx.array, mx.array, mx.array, mx.array]
           ) -> tuple[tuple[mx.array, ...], tuple[mx.array, mx.array]]:
    """One lazy round from the last one's (last token, hidden rows, their next tokens, index of
    the last kept row): (the next round's state, (this round's targets, kept count))."""
    head, depth = session.head, session.depth
    assert head is not None
    last, hidden, tokens, at = state
    kept_heads: list[Any] = []
    drafts = []
    for k in range(depth):
        logits, hidden = head(hidden, tokens, heads, k, at=at if k == 0 else None,
                              last_only=True)
        if k == 0:
            # chained entries beyond are dropped; copies, as a head may `offset += 1`, which
            # MLX does in place on the array object
            kept_heads = [c.offset + 0 for c in heads]
        tokens = greedy(logits[:, -1], keepdims=True)
        drafts.append(tokens)
    for cache, offset in zip(heads, kept_heads, strict=True):
        cache.offset = offset
    verify = mx.concatenate([last, *drafts], axis=1)
    rows, logits = session.trunk(verify, trunk)
    targets = greedy(logits[0])
    n = mx.cumprod((verify[0, 1:] == targets[:-1]).astype(mx.int32)).sum()
    for cache in trunk:
        cache.offset = cache.offset - depth + n
    nxt = mx.take(targets, n).reshape(1, 1)
    return (nxt, rows, targets[None], n), (targets, n)
