"""One generation: plain decoding (depth 0) or MTP draft-verify rounds, exact either way.

Plain decoding pipelines like mlx-lm's generate_step (the next forward is queued before the
current token is read). A speculative round drafts K tokens with the head, verifies them with one
trunk forward over K+1 positions, keeps what the acceptance rule keeps, and rolls every cache back
to the last kept token. The head's own cache only ever holds committed (trunk hidden, next token)
pairs: the pairs of a round are owed to the head and consumed by the next round's first draft.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx
import numpy as np

from mtpkit.decoder import acceptance
from mtpkit.decoder.head import MTPHead
from mtpkit.decoder.sampling import SamplingParams, draw, greedy, probabilities, tempered
from mtpkit.decoder.state import commit_recorded, rewind, snapshot, trim
from mtpkit.decoder.stats import Stats
from mtpkit.decoder.trunk import Trunk

PREFILL_STEP = 2048
STREAM = mx.new_thread_local_stream(mx.default_device())
ROLLBACKS = ("record", "replay")


class Session:
    """The state of one generation: caches, the last committed token, and the pairs owed to
    the head. `prefill` returns the first token; each `round` returns the tokens it commits."""

    def __init__(self, trunk: Trunk, head: MTPHead | None, params: SamplingParams, depth: int,
                 seed: int | None = None, rollback: str = "record") -> None:
        if depth > 0 and head is None:
            raise ValueError("depth > 0 needs an MTP head; this bundle has none")
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback must be one of {', '.join(ROLLBACKS)}")
        self.recorders = trunk.recorders if rollback == "record" else []
        self.trunk, self.head, self.params, self.depth = trunk, head, params, depth
        self.cache = trunk.make_cache()
        self.mtp_cache = head.make_cache() if head is not None and depth > 0 else []
        self.rng = np.random.default_rng(seed)
        self.key = mx.random.key(int(self.rng.integers(2**63)))
        self.stats = Stats(depth)
        self.last = -1
        self.owed: tuple[mx.array, mx.array] | None = None

    # -- shared -----------------------------------------------------------------------------

    def _sample(self, logits: mx.array) -> mx.array:
        """A lazy token from logits (1, V), drawn as mlx-lm's sampler draws it."""
        if self.params.greedy:
            return greedy(logits)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(tempered(logits, self.params), key=sub)

    def _prefill(self, ids: list[int], keep_hidden: bool) -> tuple[mx.array | None, mx.array]:
        """Run the prompt through the trunk in chunks: (hidden of every position, last logits)."""
        start = time.perf_counter()
        tokens = mx.array(ids)[None]
        hiddens = []
        for at in range(0, len(ids), PREFILL_STEP):
            chunk = tokens[:, at:at + PREFILL_STEP]
            last = at + PREFILL_STEP >= len(ids)
            hidden, logits = self.trunk(chunk, self.cache, logits_for=1 if last else 0)
            if keep_hidden:
                hiddens.append(hidden)
            mx.eval([c.state for c in self.cache], hiddens[-1:] if keep_hidden else [])
        self.stats.prompt_tokens = len(ids)
        self.stats.prefill_s = time.perf_counter() - start
        return (mx.concatenate(hiddens, axis=1) if keep_hidden else None), logits[:, -1]

    # -- plain ------------------------------------------------------------------------------

    def plain(self, ids: list[int], max_tokens: int) -> Iterator[int]:
        """Yield tokens one at a time, the next forward already queued on its own stream (as
        mlx-lm's generate_step does), so reading a token overlaps the next step's work."""
        with mx.stream(STREAM):
            _, logits = self._prefill(ids, keep_hidden=False)
            y = self._sample(logits)
        mx.async_eval(y)
        for n in range(max_tokens):
            nxt = None
            if n + 1 < max_tokens:
                with mx.stream(STREAM):
                    _, logits = self.trunk(y[None], self.cache, logits_for=1)
                    nxt = self._sample(logits[:, -1])
                mx.async_eval(nxt)
            yield int(y.item())
            y = nxt

    # -- speculative ------------------------------------------------------------------------

    def start(self, ids: list[int]) -> int:
        hidden, logits = self._prefill(ids, keep_hidden=True)
        self.last = int(self._sample(logits).item())
        self._owe(hidden, [*ids[1:], self.last])
        return self.last

    def _owe(self, hidden: mx.array, tokens: list[int]) -> None:
        pairs = (hidden, mx.array(tokens)[None])
        if self.owed is not None:
            pairs = (mx.concatenate([self.owed[0], pairs[0]], axis=1),
                     mx.concatenate([self.owed[1], pairs[1]], axis=1))
        self.owed = pairs

    def _draft(self, depth: int) -> tuple[mx.array, np.ndarray | None, list[int]]:
        """(1, 1 + K) verify input (last token, then K drafts), the distributions the drafts
        were drawn from, and per-block chained entries. Greedy drafts stay lazy (argmax on
        device, chained as arrays), so a whole round costs one host sync, not one per draft."""
        assert self.head is not None and self.owed is not None
        hidden, tokens = self.owed
        self.owed = None
        chain, rows = [mx.array([[self.last]])], []
        chained = [0] * self.head.blocks
        for k in range(depth):
            logits, out = self.head(hidden, tokens, self.mtp_cache, k, last_only=True)
            chained[k % self.head.blocks] += k > 0
            row = logits[:, -1]
            if self.params.greedy:
                tokens = greedy(row, keepdims=True)
            else:
                rows.append(probabilities(row, self.params)[0])
                tokens = mx.array([[draw(rows[-1], self.rng)]])
            chain.append(tokens)
            hidden = out
        return mx.concatenate(chain, axis=1), (np.stack(rows) if rows else None), chained

    def round(self, depth: int) -> list[int]:
        """Draft `depth` tokens, verify them in one trunk pass, commit and roll back."""
        if depth > 0:
            tokens, q, chained = self._draft(depth)
        else:
            tokens, q, chained = mx.array([[self.last]]), None, []
        saved = snapshot(self.cache)
        for recorder in self.recorders:
            recorder.recording = True
        try:
            hidden, logits = self.trunk(tokens, self.cache)
        finally:
            for recorder in self.recorders:
                recorder.recording = False
        if self.params.greedy:
            targets = greedy(logits[0])
            mx.eval(tokens, targets)  # drafts and verify in the round's one host sync
            drafts = tokens[0, 1:].tolist()
            verdict = acceptance.accept_greedy(drafts, targets.tolist())
        else:
            p = probabilities(logits[0], self.params)
            drafts = tokens[0, 1:].tolist()
            verdict = acceptance.accept_sampled(drafts, q if q is not None else p[:0], p,
                                                self.rng)
        kept = verdict.accepted
        if self.recorders:
            commit_recorded(self.cache, self.recorders, depth + 1, kept + 1)
        elif rewind(self.cache, saved, depth + 1, kept + 1):
            self.trunk(tokens[:, :kept + 1], self.cache, logits_for=0)
            mx.eval([c.state for c in self.cache])
        trim(self.mtp_cache, chained)
        committed = [*drafts[:kept], verdict.token]
        self._owe(hidden[:, :kept + 1], committed)
        self.last = verdict.token
        if depth > 0:
            self.stats.verify_calls += 1
            for i in range(depth):
                self.stats.proposed[i] += 1
                self.stats.accepted[i] += i < kept
            self.stats.bonus += verdict.bonus(depth)
            self.stats.corrections += not verdict.bonus(depth)
        return committed


def generate_ids(session: Session, ids: list[int], max_tokens: int,
                 eos: set[int]) -> Iterator[list[int]]:
    """Drive a session: yield committed token batches, stop at EOS (not yielded) or max_tokens,
    and time the generation (TTFT, prefill, decode window, peak memory)."""
    stats = session.stats
    mx.reset_peak_memory()
    start = time.perf_counter()
    first_at = None
    if max_tokens <= 0:
        return

    def batches() -> Iterator[list[int]]:
        if session.depth == 0:
            yield from ([t] for t in session.plain(ids, max_tokens))
            return
        yield [session.start(ids)]
        while True:
            yield session.round(min(session.depth, max_tokens - stats.generated_tokens - 1))

    for batch in batches():
        now = time.perf_counter()
        if first_at is None:
            first_at = now
            stats.ttft_s = now - start
        stop = next((i for i, t in enumerate(batch) if t in eos), None)
        batch = batch[:stop][:max_tokens - stats.generated_tokens]
        stats.generated_tokens += len(batch)
        stats.decode_window_s = now - first_at
        stats.peak_memory_bytes = mx.get_peak_memory()
        if batch:
            yield batch
        if stop is not None or stats.generated_tokens >= max_tokens:
            return
