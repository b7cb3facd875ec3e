"""One generation: plain decoding (depth 0) or MTP draft-verify rounds, exact either way.

Plain decoding pipelines like mlx-lm's generate_step (the next forward is queued before the
current token is read). A speculative round drafts K tokens with the head, verifies them with one
trunk forward over K+1 positions, keeps what the acceptance rule keeps, and rolls every cache back
to the last kept token. The head's own cache only ever holds committed (trunk hidden, next token)
pairs: the pairs of a round are owed to the head and consumed by the next round's first draft.
A round is a value: `round` verifies what it is given and returns a RoundOutcome (committed
tokens, what was kept, what the pass cost); under `--depth auto` decoder/rounds/controller.py decides
each round and learns from its outcome (the session never sees the policy). With `bounded`
(the default on a GPU) every attention pass has a shape from a bounded set
(decoder/cache/shapes.py), so no round pays a kernel compile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mtpkit.decoder.cache.caches import (
    FrozenHidden,
    extent,
    freeze,
    quantize,
    recordable,
    room,
    snapshot,
    thawable,
    trim,
    trimmable,
    trims_after,
)
from mtpkit.decoder.cache.prefix import PrefixCache
from mtpkit.decoder.cache.shapes import PaddedKVCache, bounded_by_default, padded, pieces
from mtpkit.decoder.cache.state import commit_recorded, rewind
from mtpkit.decoder.drafters.assistant import final_normed
from mtpkit.decoder.drafters.dflash import DFlashProposer
from mtpkit.decoder.drafters.draft_model import DraftModel, ModelProposer
from mtpkit.decoder.drafters.drafts import Draft, cut, widened
from mtpkit.decoder.drafters.lookup import ContextIndex
from mtpkit.decoder.drafters.proposers import ContextProposer, HeadProposer, Proposer
from mtpkit.decoder.model.head import MTPHead
from mtpkit.decoder.model.trunk import Trunk
from mtpkit.decoder.options import Source
from mtpkit.decoder.rounds import acceptance
from mtpkit.decoder.sampling import (
    Candidates,
    SamplingParams,
    candidate_width,
    candidates,
    greedy,
)
from mtpkit.decoder.stats import Stats

PREFILL_STEP = 2048
STREAM = mx.new_thread_local_stream(mx.default_device())
ROLLBACKS = ("record", "replay")
ATTENTION = (KVCache, PaddedKVCache)  # caches a left-padded batched prefill can fill
SOURCE_NAMES = {Source.HEAD: "head", Source.LOOKUP: "lookup",
                Source.CHAIN: "head+lookup", Source.MODEL: "model"}  # in stats


def prefill_sizes(n: int) -> list[int]:
    """n positions in prefill chunks: PREFILL_STEP each, the rest last."""
    return [min(PREFILL_STEP, n - at) for at in range(0, n, PREFILL_STEP)]


@dataclass(frozen=True)
class RoundOutcome:
    """One round: the tokens it committed, and what a controller learns from it."""

    committed: list[int]
    depth: int  # drafts verified (0: one step through the verify path)
    kept: int
    source: Source  # HEAD, LOOKUP, CHAIN (head drafts continued from the context) or MODEL
    drafted: int  # draft steps the head or draft model ran (context drafts cost none)
    match: int  # the context match a lookup round drafted from
    paid_s: float  # the round's wall time, its one host read included
    width: int  # rows the verify pass ran (padding included)
    owed: int  # pairs owed to the head before the round (its first draft fed them)


class Stopped(Exception):
    """stop() turned true between prefill chunks: the generation ends before its first token
    (a long prompt's prefill would otherwise hold the decoder after its client went away)."""


class Session:
    """The state of one generation: caches, the last committed token, and the pairs owed to
    the head. `prefill` returns the first token; each `round` returns the tokens it commits."""

    def __init__(self, trunk: Trunk, head: MTPHead | None, params: SamplingParams, depth: int,
                 seed: int | None = None, rollback: str = "record",
                 bounded: bool | None = None, draft: Source = Source.HEAD,
                 stop: Callable[[], bool] | None = None, prefix: PrefixCache | None = None,
                 checkpoints: Sequence[int] = (), drafter: DraftModel | None = None) -> None:
        """depth: the draft depth (0: plain decoding), or under a controller the deepest it may
        choose. bounded: attention shapes from a bounded set (default: where attention
        compiles per shape, see shapes.bounded_by_default, or where the trunk's verify passes
        are traced, decoder/model/traced.py). draft: where drafts come from,
        a Source, checked by decoder/options.py (a head is optional under "both").
        stop: asked between prefill chunks; true raises Stopped (the caller's own check between
        rounds covers the rest). prefix, checkpoints: a prefix cache the prompt starts from and
        leaves its state in (see start). drafter: the draft model of draft "model"
        (decoder/drafters/draft_model.py), whose cache this session keeps."""
        draft = Source(draft)
        if depth > 0 and head is None and draft is Source.HEAD:
            raise ValueError("head drafts need an MTP head (DecodeOptions.source refuses this)")
        if depth > 0 and drafter is None and draft is Source.MODEL:
            raise ValueError("model drafts need a draft model (DecodeOptions.source refuses this)")
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback must be one of {', '.join(ROLLBACKS)}")
        self.stop = stop
        self.recorders = trunk.recorders if rollback == "record" else []
        self.trunk, self.params, self.depth = trunk, params, depth
        self.head = head if draft in (Source.HEAD, Source.BOTH) else None
        traced = getattr(trunk, "passes", None) is not None  # traced passes need bounded caches
        self.bounded = (bounded_by_default() or traced) if bounded is None else bounded
        self.cache = trunk.make_cache(self.bounded)
        self.kv = getattr(trunk, "kv", None)  # --kv-bits: the trunk's caches turn quantized
        speculative = self.head is not None and depth > 0
        self.mtp_cache = self.head.make_cache(self.bounded) if speculative else []
        self.lookup = (ContextIndex() if draft in (Source.LOOKUP, Source.BOTH) and depth > 0
                       else None)
        self.model: ModelProposer | None = (drafter.proposer(self) if draft is Source.MODEL
                                            and depth > 0 and drafter is not None else None)
        # an assistant drafts from the trunk's last hidden: kept by every commit (keep_hidden)
        self.reads_hidden = getattr(self.model, "reads_hidden", False)
        self.assistant_hidden: mx.array | None = None
        # at a fixed depth, asked in order: the first draft offered is verified (next_round)
        self.proposers: list[Proposer] = [p for p in (
            self.model, ContextProposer(self) if self.lookup is not None else None,
            HeadProposer(self) if self.head is not None else None) if p is not None]
        self.key = mx.random.key(int(np.random.default_rng(seed).integers(2**63)))
        self.stats = Stats(depth)
        self.last = -1
        self.owed: tuple[mx.array, mx.array] | None = None
        self.plain_paid = (0.0, 0)  # (seconds, tokens) the last plain_steps spent, as paid
        self.prefix, self.checkpoints = prefix, checkpoints
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache
        self._exported: list[mx.array] = []  # head sessions: prompt hiddens before the owed run
        self.pipelined = False  # a plain stretch holds a queued step: the caches are ahead

    # -- shared -----------------------------------------------------------------------------

    def _noise(self, count: int) -> mx.array:
        """`count` uniforms in [0, 1): all a round's (or a step's) draws, in one random op."""
        self.key, sub = mx.random.split(self.key)
        return mx.random.uniform(shape=(count,), key=sub)

    def sample(self, logits: mx.array) -> mx.array:
        """A lazy token from logits (1, V), drawn from mlx-lm's sampler's law."""
        if self.params.greedy:
            return greedy(logits)
        rows = candidates(logits, self.params)
        return rows.draw(self._noise(rows.width)[None])

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """(length, padding) of each prefill pass, split where a quantized KV cache's switch
        falls inside the prompt (caches.room)."""
        ahead = room(self.cache, self.kv)
        if ahead is not None and 0 < ahead < n:
            return self._chunks_of(ahead) + self._chunks_of(n - ahead)
        return self._chunks_of(n)

    def _chunks_of(self, n: int) -> list[tuple[int, int]]:
        """(length, padding) of each prefill pass. Bounded, where every cache can still be trimmed
        after the padded passes (a sliding window they wrap cannot: caches.trims_after):
        the same chunks as unbounded, the last padded up to a multiple of STEP (so query
        lengths are multiples of STEP up to PREFILL_STEP); otherwise whole STEPs and the rest
        in power-of-two pieces."""
        sizes = prefill_sizes(n)
        if not self.bounded:
            return [(size, 0) for size in sizes]
        if trims_after(self.cache, padded(n)):
            return [(size, padded(size) - size) for size in sizes]
        return [(size, 0) for size in pieces(n)]

    def _prefill(self, ids: list[int], keep_hidden: bool
                 ) -> Generator[None, None, tuple[mx.array | None, mx.array]]:
        """Run the prompt through the trunk in chunks, pausing (a None) between them; returns
        (hidden of every position, last logits). Between chunks, stop() may end it (Stopped),
        the prefilled tokens counted."""
        start = time.perf_counter()
        hiddens, at = [], 0
        chunks = self._chunks(len(ids))
        for i, (size, pad) in enumerate(chunks):
            if i:
                yield None
            if i and self.stop is not None and self.stop():
                self.stats.prompt_tokens, self.stats.prefill_s = at, time.perf_counter() - start
                raise Stopped()
            last = i == len(chunks) - 1
            chunk = mx.array(ids[at:at + size] + ids[at + size - 1:at + size] * pad)[None]
            hidden, logits = self.trunk(chunk, self.cache, logits_for=1 if last else 0,
                                        real=size if pad else None)
            if pad:
                for c in self.cache:
                    c.trim(pad)
            quantize(self.cache, self.kv)
            if keep_hidden:
                hiddens.append(hidden)
            mx.eval([c.state for c in self.cache], hiddens[-1:] if keep_hidden else [])
            at += size
        self.stats.prompt_tokens = len(ids)
        self.stats.prefill_s = time.perf_counter() - start
        return (mx.concatenate(hiddens, axis=1) if keep_hidden else None), logits[:, -1]

    # -- plain ------------------------------------------------------------------------------

    def plain_steps(self, count: int, stop: Callable[[], bool] | None = None) -> Iterator[int]:
        """Decode `count` tokens after the last committed one, pipelined (`pipelined`). In a
        speculative session the trunk hiddens are owed to the head. When `stop()` turns true
        after a token, the one already queued is the last."""
        if count <= 0:
            return
        self.pipelined = True
        owe = bool(self.mtp_cache)
        hiddens, tokens = [], []

        def step(last: mx.array) -> tuple[mx.array, mx.array]:
            hidden, logits = self.trunk(last, self.cache, logits_for=1)
            quantize(self.cache, self.kv)
            y = self.sample(logits[:, -1])
            mx.async_eval(y)
            return hidden, y

        def take(hidden: mx.array, y: mx.array) -> int:
            token = int(y.item())
            if owe:
                hiddens.append(hidden)
                tokens.append(token)
            self.commit([token])
            return token

        def fresh() -> Callable[[], bool]:
            was = extent(self.cache)
            return lambda: self.trunk.first_pass(("plain", was, extent(self.cache)))

        n, emitted = 0, None  # emitted: the hidden of the step that emitted the last token
        for hidden, token, mean in pipelined(step, mx.array([[self.last]]),
                                             lambda y: y[None], count, take, stop, fresh=fresh):
            n, emitted = n + 1, hidden
            self.plain_paid = (mean * n, n)  # as paid so far: the consumer may stop here
            yield token
        if owe and tokens:
            self.owe(mx.concatenate(hiddens, axis=1), tokens)
        if emitted is not None:
            self.keep_hidden(emitted, 0)
        self.pipelined = False

    def plain(self, ids: list[int], max_tokens: int) -> Iterator[int]:
        """Plain decoding: the prompt's next token, then pipelined steps."""
        yield self.start(ids)
        yield from self.plain_steps(max_tokens - 1)

    # -- speculative ------------------------------------------------------------------------

    def start(self, ids: list[int]) -> int:
        """Prefill the prompt and commit its next token (see start_chunks)."""
        for first in self.start_chunks(ids):
            if first is not None:
                return first
        raise AssertionError("a start ends with its first token")

    def start_chunks(self, ids: list[int]) -> Iterator[int | None]:
        """Prefill the prompt and commit its next token, in steps: None after each prefill
        chunk but the last (a batch runs its other rows' round there), then the token. With a
        prefix cache: from its longest cached prefix (`cached_tokens` of the prompt are not
        prefilled), leaving the prompt's state there, and the state at each of `checkpoints`
        (shorter prompt lengths kept where recurrent states cannot be trimmed back to them:
        the end of the conversation before the assistant's turn opens, say; decoder/cache/prefix.py's
        turn_end)."""
        if self.prefix is None:
            yield (yield from self._first(ids))
            return
        kind = self.kind
        state, cached = self.prefix.fetch(kind, ids)
        if state is not None and not thawable(state[:len(self.cache)], cached, self.kv):
            state, cached = None, 0
        if state is not None:
            self.restore_state(state, ids, cached)
        self.cached_tokens = at = cached
        spent = 0.0
        marks = [] if trimmable(self.cache) else sorted(
            b for b in set(self.checkpoints) if cached < b < len(ids))
        for mark in marks:
            hidden, _ = yield from self._prefill(ids[at:mark], keep_hidden=bool(self.mtp_cache))
            spent += self.stats.prefill_s
            if hidden is not None:
                self.owe(hidden, ids[at + 1:mark + 1])
            self.taken(ids[at:mark])
            self.prefix.insert(kind, ids[:mark], self.export_state(mark))
            at = mark
        last = yield from self._first(ids[at:])
        self.stats.prompt_tokens = len(ids) - cached
        self.stats.prefill_s += spent
        self.prefix.insert(kind, ids, self.export_state(len(ids)))
        yield last

    @property
    def kind(self) -> str:
        """The prefix cache's partition (decoder/cache/prefix.py) this session's exports go to,
        by what they hold beside the trunk's caches: "head" (the head's state), "dflash" (the
        drafter's context) or "trunk" (nothing)."""
        if self.mtp_cache:
            return "head"
        return "dflash" if isinstance(self.model, DFlashProposer) else "trunk"

    def restore_state(self, state: list[Any], ids: list[int], cached: int) -> None:
        """Caches, lookup index, owed head pair and a DFlash drafter's context as an export of
        the prompt's first `cached` tokens left them (decoder/cache/caches.py thaws each
        cache)."""
        n, m = len(self.cache), len(self.mtp_cache)
        self.cache[:] = [f.thaw(c) for c, f in zip(self.cache, state[:n], strict=True)]
        self.mtp_cache[:] = [f.thaw(c) for c, f in zip(self.mtp_cache, state[n:n + m],
                                                        strict=True)]
        quantize(self.cache, self.kv)  # float keys restored up to the switch: it is here
        if isinstance(self.model, DFlashProposer):
            self.model.restore(state[n:], cached)
        self.taken(ids[:cached])
        if m:
            hidden = state[-1]
            assert hidden.offset == cached and hidden.hidden is not None
            self._exported = [hidden.hidden[:, :cached - 1]]
            self.owed = (hidden.hidden[:, cached - 1:cached], mx.array([[ids[cached]]]))

    def export_state(self, positions: int) -> list[Any]:
        """The state the prompt's first `positions` tokens left, frozen (decoder/cache/caches.py:
        views, not copies): the trunk's caches, and for head sessions the head's cache, fed
        every pair but the last (the first round's draft takes that one, with the next token),
        and every prompt position's hidden; for DFlash sessions the drafter's context.
        Evaluated here: the next session may run on another thread."""
        frozen: list[Any] = [freeze(c) for c in self.cache]
        if isinstance(self.model, DFlashProposer):
            frozen += self.model.export(positions)
        if self.mtp_cache:
            assert self.owed is not None and self.head is not None
            hidden = self.owed[0]
            self.feed_head(self.owed[1].shape[1] - 1)
            prompt = mx.concatenate([*self._exported, hidden], axis=1)  # every prompt position
            self._exported = [prompt[:, :-1]]
            frozen += [freeze(c) for c in self.mtp_cache]
            frozen.append(FrozenHidden(prompt.shape[1], prompt.nbytes, prompt))
        mx.eval([a for f in frozen for a in f.arrays()])
        return frozen

    def _first(self, ids: list[int]) -> Generator[None, None, int]:
        """Prefill `ids` (after whatever the caches hold) and commit the next token."""
        hidden, logits = yield from self._prefill(
            ids, keep_hidden=bool(self.mtp_cache) or self.reads_hidden)
        return self._commit_first(ids, hidden, logits)

    def _commit_first(self, ids: list[int], hidden: mx.array | None, logits: mx.array) -> int:
        """The token after the prefilled `ids` (logits (1, V)), the head owed their pairs."""
        token = int(self.sample(logits).item())
        if hidden is not None:
            self.keep_hidden(hidden, hidden.shape[1] - 1)
        if self.mtp_cache:
            assert hidden is not None
            self.owe(hidden, [*ids[1:], token])
        self.commit([*ids, token])
        return token

    def prefills_with_others(self, ids: list[int]) -> bool:
        """Whether this prompt may be prefilled in one pass with other sessions' prompts
        (decoder/rounds/batch_prefill.py): attention caches only (a left-padded recurrent layer
        would run its state through the padding), one prefill chunk, no cached prefix to
        start from, and no DFlash drafter (its context is taken from this session's own
        passes: a shared prefill would leave it to be rebuilt)."""
        if (len(ids) > PREFILL_STEP or not all(type(c) in ATTENTION for c in self.cache)
                or isinstance(self.model, DFlashProposer)):
            return False
        return self.prefix is None or not self.prefix.cached(self.kind, ids)

    def prefilled(self, ids: list[int], hidden: mx.array, logits: mx.array,
                  seconds: float) -> int:
        """Commit the first token of a prompt prefilled in another pass, which left this
        session's caches as `start` would have (hidden (1, len(ids), H), logits (1, V)); the
        prompt's state goes to the prefix cache as start leaves it."""
        self.cached_tokens = 0
        self.stats.prompt_tokens, self.stats.prefill_s = len(ids), seconds
        first = self._commit_first(ids, hidden, logits)
        if self.prefix is not None:
            self.prefix.missed()
            self.prefix.insert(self.kind, ids, self.export_state(len(ids)))
        return first

    def commit(self, tokens: list[int], depth: int = 0, kept: int = 0,
               source: Source = Source.HEAD) -> None:
        """Committed tokens into this sequence's state, wherever they were decoded (a lone
        round or plain step, a batch's row, the prompt's first token): every drafter that keeps
        text sees them (`taken`), the next step starts from the last, and a verified round of
        `depth` drafts, `kept` of them kept, is counted."""
        self.taken(tokens)
        self.last = tokens[-1]
        if depth > 0:
            self.stats.count_round(SOURCE_NAMES[source], depth, kept, kept == depth)

    def taken(self, tokens: list[int]) -> None:
        """Committed text, as every drafter that keeps some sees it: the context index grows;
        a draft model keeps the drafts it fed as far as they were kept (its `settle`)."""
        if self.lookup is not None:
            self.lookup.extend(tokens)
        if self.model is not None:
            self.model.settle(tokens)

    def keep_hidden(self, hidden: mx.array, at: int) -> None:
        """Keep the trunk's final-normed hidden at position `at` of a pass, the last the caches
        hold after a commit: what an assistant drafts from (decoder/drafters/assistant.py); lazy."""
        if self.reads_hidden:
            self.assistant_hidden = final_normed(self.trunk, hidden[:, at:at + 1])

    def owe(self, hidden: mx.array, tokens: list[int]) -> None:
        pairs = (hidden, mx.array(tokens)[None])
        if self.owed is not None:
            pairs = (mx.concatenate([self.owed[0], pairs[0]], axis=1),
                     mx.concatenate([self.owed[1], pairs[1]], axis=1))
        self.owed = pairs

    def feed_head(self, count: int) -> tuple[mx.array, mx.array]:
        """Feed the first `count` owed (hidden, token) pairs to the head's cache (in bounded
        pieces where shapes are bounded; their logits are never evaluated); the rest stay owed
        and are returned. A prompt's pairs are fed PREFILL_STEP at a time, each evaluated
        before the next, as the trunk's prefill is: one pass over every pair of a long prompt
        holds its intermediates for all of them at once."""
        assert self.head is not None and self.owed is not None
        hidden, tokens = self.owed
        at = done = 0
        for size in pieces(count) if self.bounded else prefill_sizes(count):
            self.head(hidden[:, at:at + size], tokens[:, at:at + size], self.mtp_cache, 0,
                      last_only=True)
            at += size
            if at - done >= PREFILL_STEP and at < count:
                mx.eval([c.state for c in self.mtp_cache])
                done = at
        self.owed = (hidden[:, count:], tokens[:, count:])
        return self.owed

    def round_noise(self, head_steps: int, drafts: int = 0
                     ) -> tuple[mx.array | None, mx.array | None]:
        """Every draw of a sampled round from one random op: (the head's draft draws as
        (head_steps, width) rows, the rule's: a ratio test per possible draft, a chain's
        context drafts included, then the emitted token's); (None, None) when greedy. A
        session at depth 0 has no ratio tests: its round draws what `sample` draws for a plain
        step, so a seeded plain row draws the same uniforms alone, in a batch's plain step, or
        in a speculative batch round beside drafting mates (one key per step either way)."""
        if self.params.greedy:
            return None, None
        columns = candidate_width(self.params, self.trunk.args.vocab_size)
        tests = max(self.depth, head_steps, drafts)
        noise = self._noise(head_steps * columns + tests + columns)
        draws = noise[:head_steps * columns].reshape(head_steps, columns) if head_steps else None
        return draws, noise[head_steps * columns:]

    def head_draft(self, depth: int) -> Draft:
        """The head's `depth` drafts after the last committed token, drawn and chained on the
        device (one host read per round, not per draft); depth 0: the token alone (a plain
        step through the verify path). The head is first fed the pairs it is owed."""
        draws, rule = self.round_noise(depth)
        if depth == 0:
            return Draft(mx.array([[self.last]]), None, Source.HEAD, 0, rule=rule)
        assert self.head is not None and self.owed is not None
        owed = self.owed[1].shape[1]  # a long run (prompt, plain stretch): pieces first
        hidden, tokens = self.feed_head(owed - pieces(owed)[-1] if self.bounded
                                        else max(owed - PREFILL_STEP, 0))
        self.owed = None
        chain, rows = [mx.array([[self.last]])], []
        chained = [0] * self.head.blocks
        for k in range(depth):
            logits, out = self.head(hidden, tokens, self.mtp_cache, k, last_only=True)
            chained[k % self.head.blocks] += k > 0
            row = logits[:, -1]
            if draws is None:
                tokens = greedy(row, keepdims=True)
            else:
                rows.append(candidates(row, self.params, drafter=True))
                tokens = rows[-1].draw(draws[k:k + 1])[:, None]
            chain.append(tokens)
            hidden = out
        return Draft(mx.concatenate(chain, axis=1), Candidates.concat(rows) if rows else None,
                     Source.HEAD, depth, chained=tuple(chained), rule=rule)

    def context_draft(self, drafts: list[int], match: int) -> Draft:
        """Context drafts (decoder/drafters/lookup.py) from a `match`-token match: q is one-hot."""
        _, rule = self.round_noise(0, len(drafts))
        q = None if self.params.greedy else Candidates.one_hot(drafts)
        return Draft(mx.array([[self.last, *drafts]]), q, Source.LOOKUP, 0, match, rule=rule)

    def round(self, draft: Draft, width: int | None = None) -> RoundOutcome:
        """Verify `draft` in one trunk pass, keep what the acceptance rule keeps, commit and roll
        back. `width` may pad the pass to a wider, cheaper width (the cost curve's); padding
        rows repeat the last token and are rolled back like rejected drafts."""
        start = time.perf_counter()
        owed = self.owed[1].shape[1] if self.owed is not None else 0
        ahead = room(self.cache, self.kv)  # the pass ends where the KV cache turns quantized
        draft = cut(draft, draft.depth if ahead is None else max(ahead - 1, 0))
        tokens, depth = draft.tokens, draft.depth
        width = max(width or 0, depth + 1)
        verify = widened(tokens, width)
        saved = snapshot(self.cache, width)
        hidden, logits = self.trunk(verify, self.cache, real=depth + 1,
                                    record=bool(self.recorders))
        verdict = judge(draft, logits[0], self.params)
        # the round's one host read: drafts, kept count and emitted token
        *drafts, kept, token = mx.concatenate([tokens[0, 1:].astype(mx.int32), verdict]).tolist()
        if self.recorders and recordable(self.cache):
            commit_recorded(self.cache, self.recorders, width, kept + 1)
        elif rewind(self.cache, saved, width, kept + 1):
            self.trunk(tokens[:, :kept + 1], self.cache, logits_for=0)
            mx.eval([c.state for c in self.cache])
        quantize(self.cache, self.kv)
        trim(self.mtp_cache, list(draft.chained))
        committed = [*drafts[:kept], token]
        if self.mtp_cache:
            self.owe(hidden[:, :kept + 1], committed)
        self.keep_hidden(hidden, kept)
        self.commit(committed, depth, kept, draft.source)
        paid = time.perf_counter() - start
        return RoundOutcome(committed, depth, kept, draft.source, draft.drafted, draft.match,
                            paid, width, owed)

    def next_round(self, depth: int) -> RoundOutcome:
        """A round at a fixed depth: the first draft a proposer offers (a draft model's; else
        context drafts where the text offers some, up to `depth`; else the head's), else one
        plain step."""
        for proposer in self.proposers if depth > 0 else ():
            if (draft := proposer.propose(depth)) is not None:
                return self.round(draft)
        return self.round(self.head_draft(0))


Fresh = Callable[[], Callable[[], bool]]  # asked as a step is queued; what it returns says, once
# the step is, whether its pass was the first of its shape here (Trunk.first_pass: the caches
# before and after it, so the pass that grows a buffer and the first to read it both count)


class StretchClock:
    """What the steps of a pipelined stretch paid, on average so far (`pipelined`'s steps and
    Batch.spec_rounds' rounds): a step read after it was queued behind the last read paid
    from that read to its own (the consumer's work between ran beside it on the device, and a
    consumer slower than the device is what a step costs), else the seconds from `resume` to
    its read; a mean, since a read may wait for more than its own step (one step then
    reads long and the next free): over the later half of the reads so far (four at least,
    all of a shorter stretch), so what the first steps after a restart paid wears out of the
    price as the stretch goes on (after the allocator's cache was emptied they run slower
    while buffers are allocated again; in a mean since the start they priced a whole
    stretch, and the policy kept the shape for dear). Not fewer: a stretch's last read is
    nearly free where its step ran beside the host deciding to end the stretch, and over two
    reads it halved a short stretch's price (auto on a CPU then took plain steps for cheap).
    What queueing a pass that may have compiled took beyond
    what queueing one usually takes here (`queue`) is left out: a shape compiles once, its
    steps are paid every time (the usual part is real host work, on a CPU most of a step).
    Where steps are queued ahead, the clock starts once the first is queued (`started`): the
    device idles while the host builds it: a restart's cost, paid once a stretch, not a step's
    (in the mean of a short stretch it priced every step of it dearer). What building it took
    is the stretch's `restart`, which the depth policy weighs against switching stretches."""

    def __init__(self) -> None:
        self.paid = [0.0]  # seconds the reads so far paid, cumulated: [0, first, first two..]
        self.begin = self.last = time.perf_counter()
        self.fresh: list[float] = []  # seconds queueing a shape's first pass took, unread
        self.since = 0  # the read the first of them is paid in
        self.usual: float | None = None  # the least queueing any other pass took
        self.restart: float | None = None  # seconds building the first step took (`started`)

    def queue(self, fresh: Fresh | None, build: Callable[..., Any], *args: Any) -> Any:
        """`build(*args)` queues a step; `fresh` says whether its pass is the first of its
        shape here."""
        start, first = time.perf_counter(), fresh() if fresh is not None else None
        out = build(*args)
        took = time.perf_counter() - start
        if first is not None and first():
            self.since = self.since if self.fresh else len(self.paid) - 1
            self.fresh.append(took)
        else:
            self.usual = took if self.usual is None else min(self.usual, took)
        return out

    def started(self) -> None:
        """The first step is queued: from here the device is busy (its building left out,
        compile included; its seconds are the `restart`, unless its pass was the first of
        its shape: a compile is paid once, a restart every stretch)."""
        now = time.perf_counter()
        self.restart = None if self.fresh else now - self.begin
        self.begin, self.fresh = now, []

    def read(self) -> float:
        """A step was read: what a step paid over the later half of the reads so far (first
        passes queued so far count at the usual time once one is known, taken from the reads
        that paid them: until then, as they took)."""
        self.last = time.perf_counter()
        paid = self.paid
        paid.append(paid[-1] + self.last - self.begin)
        if self.usual is not None and self.fresh:
            extra = sum(max(0.0, t - self.usual) for t in self.fresh)
            own = [b - a for a, b in zip(paid[self.since:-1], paid[self.since + 1:], strict=True)]
            for i, seconds in enumerate(own, start=self.since + 1):  # from the reads that paid it
                cut = min(extra, seconds)
                paid[i], extra = paid[i - 1] + seconds - cut, extra - cut
            self.fresh = []
        reads = len(paid) - 1
        later = min(max(4, (reads + 1) // 2), reads)
        return (paid[-1] - paid[-1 - later]) / later

    def resume(self, overlapped: bool) -> None:
        """The consumer is done with the last step; `overlapped`: the next was queued before
        that step was read (it ran beside the consumer)."""
        self.begin = self.last if overlapped else time.perf_counter()


def pipelined(step: Callable[[mx.array], tuple[mx.array, mx.array]], first: mx.array,
              follow: Callable[[mx.array], mx.array], count: int,
              take: Callable[[mx.array, mx.array], Any], stop: Callable[[], bool] | None = None,
              ahead: bool = True, fresh: Fresh | None = None, clock: StretchClock | None = None
              ) -> Iterator[tuple[mx.array, Any, float]]:
    """`count` plain steps of one sequence or of a batch's rows, written once: `step(tokens)`
    queues a step ((hidden, picks), the picks evaluating asynchronously), `follow(picks)` makes
    the next step's tokens, `take(hidden, picks)` reads and commits them. With `ahead`, each
    next step is queued before the current one is taken (as mlx-lm's generate_step and
    BatchGenerator do), so the host's read and its work overlap the device's next step. Yields
    (hidden, what take returned, what a step of this run has paid so far, on average:
    `StretchClock`, the caller's `clock` if given; `fresh`: whether a step's pass is the
    first of its shape here).
    When stop() turns true after a step, the one already queued is the last.

    Every step, `follow` included, runs on STREAM: an op of one step on another stream (the
    default one) makes each step wait across streams, which on MLX's CUDA backend cost a
    plain step a fifth of its speed (docs/long-context.md, "Decode")."""

    clock = clock or StretchClock()

    def queue(tokens: mx.array) -> tuple[mx.array, mx.array]:
        with mx.stream(STREAM):
            return clock.queue(fresh, step, tokens)

    def then(picks: mx.array) -> tuple[mx.array, mx.array]:
        with mx.stream(STREAM):
            return clock.queue(fresh, lambda: step(follow(picks)))

    hidden, picks = queue(first)
    if ahead:
        clock.started()
    n = 0
    while n < count:
        queued = then(picks) if ahead and n + 1 < count else None
        taken = take(hidden, picks)
        yield hidden, taken, clock.read()
        clock.resume(queued is not None)
        n += 1
        if stop is not None and n + 1 < count and stop():
            count = n + 1 if queued is not None else n  # a queued step is the last
        if queued is not None:
            hidden, picks = queued
        elif n < count:
            hidden, picks = then(picks)


def judge(draft: Draft, logits: mx.array, params: SamplingParams) -> mx.array:
    """[kept, token] for `draft` given the verify pass's logits of its row (its first
    depth + 1 positions count; padding after them is ignored): the acceptance rule
    (decoder/rounds/acceptance.py), greedy or sampled as the draft was drawn."""
    depth = draft.depth
    if draft.rule is None:
        return acceptance.accept_greedy(draft.tokens[0, 1:], greedy(logits[:depth + 1]))
    p = candidates(logits[:depth + 1], params)
    rule = mx.concatenate([draft.rule[:depth], draft.rule[-p.width:]])
    return acceptance.accept_sampled(draft.tokens[0, 1:], draft.q, p, rule)
