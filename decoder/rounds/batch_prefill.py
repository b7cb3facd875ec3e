"""Prompts that arrive together prefilled in one trunk pass, as mlx-lm's BatchGenerator does.

One request at a time, N prompts that start together cost N prefill passes before the batch
decodes, and the last of them waits for all.
Here they go through the trunk left-padded, with mlx-lm's BatchKVCache (its left padding masks
the pads and sets each row's RoPE positions), and each row's keys and values then become its
own session's caches, as its own prefill would have left them; each session commits its first
token as `start` does (Session.prefilled). Only prompts that fit one prefill chunk, in trunks
of attention caches only, with no cached prefix (Session.prefills_with_others): the rest are
prefilled one at a time, in chunks, as before. Only on a GPU (`pays`).
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mtpkit.decoder.cache.caches import FrozenKV
from mtpkit.decoder.cache.shapes import bucket
from mtpkit.decoder.rounds.batch import overlaps
from mtpkit.decoder.rounds.session import Session


def pays() -> bool:
    """Whether one pass for several prompts beats a pass each: where a pass costs about its
    host work whatever its rows (a GPU: batch.overlaps). On a CPU a pass costs its rows'
    compute, so one pass of N prompts costs their sum and the padding, and the first prompt
    waits for them all."""
    return overlaps()


def prefill_together(sessions: list[Session], prompts: list[list[int]]) -> list[int]:
    """Prefill every session's prompt in one pass and commit each one's first token."""
    start = time.perf_counter()
    trunk = sessions[0].trunk
    lengths = [len(ids) for ids in prompts]
    width = max(lengths)
    if any(s.bounded for s in sessions):  # query lengths from a bounded set, as alone
        width = bucket(width)
    pads = [width - n for n in lengths]
    tokens = mx.array([[ids[0]] * pad + ids for ids, pad in zip(prompts, pads, strict=True)])
    caches = [BatchKVCache(pads) for _ in sessions[0].cache]
    hidden, logits = trunk(tokens, caches, logits_for=1)
    assert logits is not None
    for b, session in enumerate(sessions):  # each row's positions, as a prefix restore thaws
        for own, batch in zip(session.cache, caches, strict=True):
            FrozenKV(lengths[b], 0, batch.keys[b:b + 1, :, pads[b]:width, :],
                     batch.values[b:b + 1, :, pads[b]:width, :]).thaw(own)
    rows = [hidden[b:b + 1, pads[b]:] for b in range(len(sessions))]
    mx.eval([c.state for s in sessions for c in s.cache], rows, logits)
    seconds = time.perf_counter() - start
    return [s.prefilled(ids, rows[b], logits[b:b + 1, -1], seconds)
            for b, (s, ids) in enumerate(zip(sessions, prompts, strict=True))]
