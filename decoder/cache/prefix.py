"""An exact prefix cache across generations: the state a prompt left, reused by the next prompt
that starts with it.

Agents resend a long system prompt, tool schemas and the conversation so far every turn. Entries
live in mlx-lm's own LRUPromptCache (a token trie, least recently used out first, a byte bound),
keyed by the prompt's token ids. An entry holds what a started Session holds for its prompt
(`Session.export_state`; `restore_state` puts it back): the
trunk's caches (attention KV, GatedDeltaNet states in ArraysCache) and, for sessions drafting
with the MTP head, the head's cache over the prompt's (hidden, next token) pairs and the prompt's
hiddens (the last one is owed to the head with the request's next token); for sessions drafting
with DFlash, the drafter's context keys and values (trimmed as attention KV). Each kind of
session has its own trie (`Session.kind`). A session restored
from an entry continues as one that prefilled the whole prompt; the context lookup index is
rebuilt from the ids. Attention KV can be trimmed, so an entry also serves a prompt that leaves it
part way; recurrent states only serve prompts that extend the whole entry.

MLX arrays are values: an entry keeps views of the arrays the prefill made, never copies, and a
session writing after them gets a fresh buffer (MLX copies a buffer another array still reads).

A shared server partitions the cache (`partition`): a prompt is looked up only among the prompts
of its own partition (serve: the API key, and the request's `cache_salt`), so how much of a
prompt was cached, and how fast its first token came, says nothing of other partitions' prompts.
Partitions share the byte bound and the counters.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Hashable
from typing import Any

from mlx_lm.models.cache import LRUPromptCache

MAX_ENTRIES = 1 << 16  # the byte bound is the real one
FOLLOW_UP = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}]


def turn_end(ids: list[int], followed: list[int]) -> list[int]:
    """Where the next chat turn's prompt will likely leave this one (`ids`): how far it agrees
    with `followed`, the same conversation plus FOLLOW_UP (a reply and a user turn) rendered
    and encoded. A checkpoint there (a Session's `checkpoints`) lets a model whose recurrent
    states cannot be trimmed (GatedDeltaNet) reuse this turn when the next arrives; attention
    KV alone needs none (it is trimmed to any prefix)."""
    agree = next((i for i, (a, b) in enumerate(zip(ids, followed, strict=False)) if a != b),
                 min(len(ids), len(followed)))
    return [agree] if 0 < agree < len(ids) else []


class Counts:
    """Hits and misses, shared by every partition of one cache."""

    def __init__(self) -> None:
        self.hits = self.misses = 0


class PrefixCache:
    """Prompt states keyed by token ids, least recently used evicted beyond `max_bytes`. One
    generation at a time touches it (serve's queue); counters may be read from any thread.
    `namespace`: the partition this view looks up and stores in (see `partition`)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=max_bytes)
        self.counts = Counts()
        self.lock = threading.Lock()
        self.namespace: Hashable = None

    def partition(self, namespace: Hashable) -> PrefixCache:
        """A view of the same cache that finds only what views of `namespace` stored (the
        entries, byte bound, lock and counters are shared)."""
        view = copy.copy(self)
        view.namespace = namespace
        return view

    def _key(self, kind: str) -> tuple[Hashable, str]:
        return self.namespace, kind

    @property
    def hits(self) -> int:
        return self.counts.hits

    @property
    def misses(self) -> int:
        return self.counts.misses

    @property
    def nbytes(self) -> int:
        return self.lru.nbytes

    def __len__(self) -> int:
        return len(self.lru)

    def fetch(self, kind: str, ids: list[int]) -> tuple[list[Any] | None, int]:
        """The state of the longest cached prefix that leaves at least one token of `ids` to
        prefill (the first token's logits come from it), and that prefix's length."""
        with self.lock:
            state, rest = self.lru.fetch_nearest_cache(self._key(kind), ids[:-1])
            if state is None:
                self.counts.misses += 1
                return None, 0
            self.counts.hits += 1
            return state, len(ids) - 1 - len(rest)

    def cached(self, kind: str, ids: list[int]) -> bool:
        """Whether `fetch` would find a prefix of `ids` (not counted as a hit or a miss: the
        scheduler asks before it decides how to prefill; the states found are views)."""
        with self.lock:
            return self.lru.fetch_nearest_cache(self._key(kind), ids[:-1])[0] is not None

    def missed(self) -> None:
        """Count a prompt that found no prefix and was prefilled without `fetch` (with others:
        decoder/rounds/batch_prefill.py), as fetch counts one."""
        with self.lock:
            self.counts.misses += 1

    def insert(self, kind: str, ids: list[int], state: list[Any]) -> None:
        with self.lock:
            self.lru.insert_cache(self._key(kind), list(ids), state)
