"""An exact prefix cache across generations: the state a prompt left, reused by the next prompt
that starts with it.

Agents resend a long system prompt, tool schemas and the conversation so far every turn. Entries
live in mlx-lm's own LRUPromptCache (a token trie, least recently used out first, a byte bound),
keyed by the prompt's token ids. An entry holds what a started Session holds for its prompt: the
trunk's caches (attention KV, GatedDeltaNet states in ArraysCache) and, for sessions drafting
with the MTP head, the head's cache over the prompt's (hidden, next token) pairs and the prompt's
hiddens (the last one is owed to the head with the request's next token). A session restored
from an entry continues as one that prefilled the whole prompt; the context lookup index is
rebuilt from the ids. Attention KV can be trimmed, so an entry also serves a prompt that leaves it
part way; recurrent states only serve prompts that extend the whole entry.

MLX arrays are values: an entry keeps views of the arrays the prefill made, never copies, and a
session writing after them gets a fresh buffer (MLX copies a buffer another array still reads).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from mtpkit.decoder.caches import Positions, freeze, trimmable
from mtpkit.decoder.session import Session

MAX_ENTRIES = 1 << 16  # the byte bound is the real one
KINDS = ("trunk", "head")  # trie partitions: sessions drafting with the head need its state too


@dataclass
class _Hidden(Positions):
    """The trunk hiddens of the prompt's positions, which the head's pairs start from."""

    hidden: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [self.hidden] if self.hidden is not None else []


FOLLOW_UP = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}]


def turn_end(ids: list[int], followed: list[int]) -> list[int]:
    """Where the next chat turn's prompt will likely leave this one (`ids`): how far it agrees
    with `followed`, the same conversation plus FOLLOW_UP (a reply and a user turn) rendered
    and encoded. A checkpoint there (CachedSession's `checkpoints`) lets a model whose recurrent
    states cannot be trimmed (GatedDeltaNet) reuse this turn when the next arrives; attention
    KV alone needs none (it is trimmed to any prefix)."""
    agree = next((i for i, (a, b) in enumerate(zip(ids, followed, strict=False)) if a != b),
                 min(len(ids), len(followed)))
    return [agree] if 0 < agree < len(ids) else []



class PrefixCache:
    """Prompt states keyed by token ids, least recently used evicted beyond `max_bytes`. One
    generation at a time touches it (serve's queue); counters may be read from any thread."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=max_bytes)
        self.hits = self.misses = 0
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.lru.nbytes

    def __len__(self) -> int:
        return len(self.lru)

    def fetch(self, kind: str, ids: list[int]) -> tuple[list[Any] | None, int]:
        """The state of the longest cached prefix that leaves at least one token of `ids` to
        prefill (the first token's logits come from it), and that prefix's length."""
        with self.lock:
            state, rest = self.lru.fetch_nearest_cache(kind, ids[:-1])
            if state is None:
                self.misses += 1
                return None, 0
            self.hits += 1
            return state, len(ids) - 1 - len(rest)

    def insert(self, kind: str, ids: list[int], state: list[Any]) -> None:
        with self.lock:
            self.lru.insert_cache(kind, list(ids), state)


class CachedSession(Session):
    """A Session whose prompt starts from the longest cached prefix, and whose prompt state
    is cached for the prompts after it. `cached_tokens`: prompt tokens not prefilled.
    `checkpoints`: shorter prompt lengths whose state is kept too, where recurrent states
    cannot be trimmed back to them (the end of the conversation before the assistant's
    turn opens, say: the next turn renders the same history, then differs)."""

    def __init__(self, *args: Any, prefix: PrefixCache, checkpoints: Sequence[int] = (),
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix, self.checkpoints = prefix, checkpoints
        self.cached_tokens = 0
        self.kind = KINDS[bool(self.mtp_cache)]
        self._done: list[mx.array] = []  # head sessions: hiddens before the owed run

    def start(self, ids: list[int]) -> int:
        state, cached = self.prefix.fetch(self.kind, ids)
        if state is not None:
            self._restore(state, ids, cached)
        self.cached_tokens = at = cached
        spent = 0.0
        marks = [] if trimmable(self.cache) else sorted(
            b for b in set(self.checkpoints) if cached < b < len(ids))
        for mark in marks:
            hidden, _ = self._prefill(ids[at:mark], keep_hidden=bool(self.mtp_cache))
            spent += self.stats.prefill_s
            if hidden is not None:
                self._owe(hidden, ids[at + 1:mark + 1])
            if self.lookup is not None:
                self.lookup.extend(ids[at:mark])
            self.prefix.insert(self.kind, ids[:mark], self._settle())
            at = mark
        last = super().start(ids[at:])
        self.stats.prompt_tokens, self.stats.prefill_s = len(ids) - cached, self.stats.prefill_s + spent
        self.prefix.insert(self.kind, ids, self._settle())
        return last

    def _restore(self, state: list[Any], ids: list[int], cached: int) -> None:
        """Caches, lookup index and owed head pair as the cached prefix left them."""
        n, m = len(self.cache), len(self.mtp_cache)
        for cache, frozen in zip(self.cache + self.mtp_cache, state[:n + m], strict=True):
            frozen.thaw(cache)
        if self.lookup is not None:
            self.lookup.extend(ids[:cached])
        if m:
            hidden = state[-1]
            assert hidden.offset == cached and hidden.hidden is not None
            self._done = [hidden.hidden[:, :cached - 1]]
            self.owed = (hidden.hidden[:, cached - 1:cached], mx.array([[ids[cached]]]))

    def _settle(self) -> list[Any]:
        """Feed the head the prompt's pairs but the last (the first round's draft takes that
        one, with the next token), and freeze the state the prompt left (evaluated here: the
        next session may run on another thread)."""
        frozen: list[Any] = [freeze(c) for c in self.cache]
        if self.mtp_cache:
            assert self.owed is not None and self.head is not None
            hidden = self.owed[0]
            self.feed_head(self.owed[1].shape[1] - 1)
            prompt = mx.concatenate([*self._done, hidden], axis=1)  # every prompt position
            self._done = [prompt[:, :-1]]
            frozen += [freeze(c) for c in self.mtp_cache]
            frozen.append(_Hidden(prompt.shape[1], prompt.nbytes, prompt))
        mx.eval([a for f in frozen for a in f.arrays()])
        return frozen

