"""Many sequences verified in one trunk pass, each exactly as it would be decoded alone.

A row is a Session prefilled on its own (its prompt, prefix cache, first token, seed, context
index and the pairs it owes the head stay the session's); its caches then join the batch's
(decoder/cache/batch_cache.py). Each round every row asks for a draft of its own (`Ask`: head drafts,
context drafts, or none: a plain step through the verify path); the head drafts of every row
are chained together, one head pass per draft step; one trunk pass verifies every row, right-
padded to the widest; each row judges its draft by its own sampling parameters and noise
(session.judge, the rule a lone session applies) and keeps, commits and rolls back on its own.
The host reads one small array per round for the whole batch; on a GPU, rounds in which every
row drafts one depth from the head run pipelined (`spec_rounds`: round t+1 queued before round
t's verdicts are read), as plain steps do (`plain_steps`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from mtpkit.decoder.cache.batch_cache import (
    Holes,
    RowKVCache,
    batched,
    drop,
    exact_views,
    join,
    keep_rows,
    row_kv,
    settle,
    single,
)
from mtpkit.decoder.cache.caches import extent, leaves
from mtpkit.decoder.cache.recording import recorded
from mtpkit.decoder.cache.shapes import bounded_by_default
from mtpkit.decoder.drafters.assistant import AssistantProposer
from mtpkit.decoder.drafters.dflash import DFlashProposer
from mtpkit.decoder.drafters.drafts import Draft, widened
from mtpkit.decoder.model.head import MTPHead
from mtpkit.decoder.model.trunk import Trunk
from mtpkit.decoder.options import Source
from mtpkit.decoder.rounds import acceptance
from mtpkit.decoder.rounds.session import (
    Fresh,
    RoundOutcome,
    Session,
    StretchClock,
    judge,
    pipelined,
)
from mtpkit.decoder.sampling import Candidates, candidates, greedy


@dataclass(frozen=True)
class Ask:
    """What a row drafts this round: `context` drafts (from its context index, with the
    `match` they came from), else `depth` drafts from its draft model (`model`, drafted by the
    row's own proposer) or the head; neither: a plain step."""

    depth: int = 0
    context: tuple[int, ...] = ()
    match: int = 0
    model: bool = False

    @property
    def head_steps(self) -> int:
        return 0 if self.context or self.model else self.depth


Owed = tuple[mx.array, mx.array, mx.array, int]  # hidden, tokens, counts (rows,), width


def overlaps() -> bool:
    """Whether the host's work overlaps the device's: on a GPU. On a CPU both share the cores,
    so pipelined rounds save nothing and their holes (no tail trimmed) cost attention work
    (docs/batching.md), and a plain step queued ahead makes a joining request wait for it too."""
    return mx.default_device().type == mx.DeviceType.gpu


STAGES = 8  # pieces a synchronous round's pass is evaluated in, `between` after each


def _padded(a: mx.array, width: int) -> mx.array:
    """(1, n, ...) right-padded with zeros to (1, width, ...)."""
    extra = width - a.shape[1]
    if extra <= 0:
        return a
    return mx.concatenate([a, mx.zeros((1, extra, *a.shape[2:]), a.dtype)], axis=1)


class Batch:
    """The caches of every active row and the passes over them. Rows are sessions, in the
    order they joined (minus those that left)."""

    def __init__(self, trunk: Trunk, head: MTPHead | None, bounded: bool | None = None,
                 between: Callable[[], None] | None = None) -> None:
        """bounded: attention shapes from a bounded set (default: where a GPU compiles each
        shape, decoder/cache/shapes.py). between: run between the stages of a synchronous round's
        pass (`_staged`)."""
        self.trunk, self.head = trunk, head
        self.between = between
        self.stock_pass = False  # the last pass ran stock (not a traced replay)
        self.bounded = bounded_by_default() if bounded is None else bounded
        self.pipelined = overlaps()  # steps and rounds may run pipelined (a GPU)
        self.rows: list[Session] = []
        self.headed: list[bool] = []  # rows with a place in the head's caches
        self.cache: list | None = None
        self.holes = Holes()
        self.exact = False  # one row whose trunk caches hold no holes and no padding
        self.restart: float | None = None  # seconds the last pipelined stretch's first pass
        # took to build, the device idle (StretchClock.restart), until the scheduler takes it
        blocks = head.blocks if head is not None else 0
        self.mtp_cache: list | None = None
        self.mtp_holes = [Holes() for _ in range(blocks)]

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, session: Session) -> None:
        """A started session (prefilled alone, first token committed) becomes the last row.
        A session with head state is first fed every prompt pair but the last, alone: the
        batch's head passes then carry about a round's worth of pairs per row. Rows without
        (plain or context drafts only) hold no place in the head's caches."""
        headed = bool(session.mtp_cache)
        if headed:
            assert session.owed is not None and self.head is not None
            session.feed_head(session.owed[1].shape[1] - 1)
        self.exact = not self.rows  # (a first row holds its real positions only)
        self.cache = self._join(self.cache, session.cache, [self.holes], self.bounded)
        if headed:
            self.mtp_cache = self._join(self.mtp_cache, session.mtp_cache, self.mtp_holes,
                                        self.bounded)
        session.cache, session.mtp_cache = [], []  # the batch's now
        self.rows.append(session)
        self.headed.append(headed)
        if isinstance(session.model, AssistantProposer):  # it reads the batch's caches now
            session.model.batched = lambda layer, last: self._row_view(session, layer, last)
        elif isinstance(session.model, DFlashProposer):  # it keeps its row of the batch's passes
            session.model.batched = lambda: (self.cache, self.rows.index(session))
        mx.eval(self._arrays())

    def _row_view(self, session: Session, layer: int, last: int
                  ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """A row's view of one trunk cache (assistant.RowView): its keys, values, which of
        them are its own, and its length."""
        assert self.cache is not None
        b = self.rows.index(session)
        cache = self.cache[layer]
        keys, values, real = row_kv(cache, self.holes, b, last)
        return keys, values, real, cache.offset[b:b + 1]

    @staticmethod
    def _join(batch: list | None, caches: list, holes: list[Holes], bounded: bool) -> list:
        """`caches` (one sequence's) appended to `batch` as a row. The trunk's attention
        layers share one Holes; each head block has its own."""
        shared = len(holes) == 1
        rows = [batched([c], holes[0 if shared else i], bounded)[0]
                for i, c in enumerate(caches)]
        if batch is None:
            seen: set[int] = set()
            for i, c in enumerate(rows):
                h = holes[0 if shared else i]
                first = next((p for p in leaves([c]) if isinstance(p, RowKVCache)), None)
                if first is not None and id(h) not in seen:
                    seen.add(id(h))
                    h.join(1, first._idx, 0, first._idx)
            return rows
        if shared:
            join(batch, rows, holes[0])
        else:
            for b, c, h in zip(batch, rows, holes, strict=True):
                join([b], [c], h)
        return batch

    def leave(self, gone: set[int]) -> None:
        """Rows at the indices `gone` leave (finished, cancelled, disconnected)."""
        stay = [i for i in range(len(self.rows)) if i not in gone]
        heads = [sum(self.headed[:i]) for i in stay if self.headed[i]]
        for i in gone:  # a row gone keeps no view of the batch
            if isinstance(model := self.rows[i].model, AssistantProposer | DFlashProposer):
                model.batched = None
        if not stay:
            self.__init__(self.trunk, self.head, self.bounded, self.between)  # type: ignore[misc]
            return
        assert self.cache is not None
        keep_rows(self.cache, stay, self.holes)
        self.exact = False  # (the rows left may keep padding and holes)
        if self.mtp_cache is not None:
            if heads:
                for c, holes in zip(self.mtp_cache, self.mtp_holes, strict=True):
                    keep_rows([c], heads, holes)
            else:
                self.mtp_cache, self.mtp_holes = None, [Holes() for _ in self.mtp_holes]
        self.rows = [self.rows[i] for i in stay]
        self.headed = [self.headed[i] for i in stay]
        mx.eval(self._arrays())

    def part(self) -> Session:
        """The one row left decodes alone again (the solo path is the faster one): its caches,
        compacted to its real positions, become its session's own, as before it joined."""
        assert len(self.rows) == 1 and self.cache is not None
        session = self.rows[0]
        session.cache = single(self.cache, [self.holes], session.trunk.make_cache(session.bounded))
        if self.headed[0]:
            assert self.head is not None and self.mtp_cache is not None
            session.mtp_cache = single(self.mtp_cache, self.mtp_holes,
                                       self.head.make_cache(session.bounded))
        if isinstance(session.model, AssistantProposer | DFlashProposer):
            session.model.batched = None
        self.__init__(self.trunk, self.head, self.bounded, self.between)  # type: ignore[misc]
        return session

    def _squeeze(self) -> None:
        """The lone row's trunk caches rebuilt without holes or padding (its real positions,
        as `part` hands them back to its session), so its plain steps see exact keys and no
        mask (`exact_views`). Costs one copy of its keys, once per stretch of plain steps."""
        assert self.cache is not None
        own = single(self.cache, [self.holes], self.trunk.make_cache())
        self.holes = Holes()
        self.cache = self._join(None, own, [self.holes], self.bounded)
        self.exact = True
        mx.eval(self._arrays())

    def _arrays(self) -> list[mx.array]:
        out = [h.valid for h in [self.holes, *self.mtp_holes] if h.valid is not None]
        for c in leaves((self.cache or []) + (self.mtp_cache or [])):
            out += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
        return out

    # -- a round ----------------------------------------------------------------------------

    def round(self, asks: list[Ask]) -> list[RoundOutcome]:
        """Draft, verify, judge and commit one round of every row (asks in row order)."""
        assert len(asks) == len(self.rows) and self.cache is not None
        start = time.perf_counter()
        owed = [s.owed[1].shape[1] if s.owed is not None else 0 for s in self.rows]
        drafts = self._drafts(asks)
        width = max(d.depth + 1 for d in drafts)
        verify = mx.concatenate([widened(d.tokens, width) for d in drafts])
        hidden, logits = self._pass(verify, mx.array([d.depth + 1 for d in drafts]), width)
        self._staged()
        verdicts = self._judged(verify, logits, drafts, mx.array([d.depth for d in drafts]))
        # the round's one host read: every row's drafts, kept count and emitted token
        committed, kept = self._read(_verdicts(verify, verdicts).tolist(), width)
        self._settle(mx.array([k + 1 for k in kept]), width, width - max(kept) - 1)
        paid = time.perf_counter() - start
        outcomes = []
        for b, draft in enumerate(drafts):
            if self.headed[b]:
                self.rows[b].owe(hidden[b:b + 1, :kept[b] + 1], committed[b])
            self.rows[b].keep_hidden(hidden[b:b + 1], kept[b])
            outcomes.append(self._outcome(b, RoundOutcome(
                committed[b], draft.depth, kept[b], draft.source, draft.drafted, draft.match,
                paid, width, owed[b])))
        return outcomes

    def _staged(self) -> None:
        """The pass just built, evaluated in STAGES pieces (up to each piece's last attention
        layer's keys: every layer before it runs), `between` after each. A request that
        arrives during a synchronous round is then prefilled and sent its first token after
        one piece, not after the whole round (on a CPU a round of a few rows is long). The same
        ops run in the same order: nothing a row computes changes. Only
        stock passes stage (a traced one is one replay; on a GPU rounds are short)."""
        if self.between is None or not self.stock_pass:
            return
        rows = [c for c in leaves(self.cache or []) if isinstance(c, RowKVCache)]
        every = max(1, len(rows) // STAGES)
        for c in rows[every - 1::every]:
            mx.eval(c.fed)
            self.between()
        for c in rows:
            c.fed = None  # (evaluated; the references go)

    def spec_rounds(self, depth: int, count: int, stop: Callable[[], bool] | None = None,
                    done: Callable[[int], bool] | None = None) -> Iterator[list[RoundOutcome]]:
        """`count` rounds in which every row drafts `depth` from the head, each next round
        queued before the last one's verdicts are read (as plain_steps queues plain steps):
        the host builds round t+1 while the device runs round t. Round t+1's head is fed the
        pairs round t committed straight from the device (right-padded to depth + 1, each
        row's count a device array) and its pass starts at each row's emitted token; no
        tail is trimmed (that needs the verdicts), so rejected positions stay as holes. Each
        row drafts, judges, keeps and commits as in `round`. Yields every row's outcome
        (paid: what a round of this stretch has cost so far, on average: StretchClock);
        when stop() turns true, the round already queued is the last. A row whose
        generation is `done(b)` takes nothing more (its session's counts stay as its result
        reported them)."""
        assert self.cache is not None and all(self.headed) and depth > 0 and count > 0
        rows, width, self.exact = len(self.rows), depth + 1, False  # (rejections stay as holes)
        asks = [Ask(depth=depth)] * rows
        full = mx.full((rows,), width, mx.int32)
        depths = mx.full((rows,), depth, mx.int32)
        columns = mx.arange(width)[None]

        def queue(last: mx.array, owed: Owed | None) -> tuple[mx.array, Owed, mx.array]:
            noise = [s.round_noise(depth) for s in self.rows]
            tokens, laws = self._head(depth, asks, [d for d, _ in noise], owed)
            verify = mx.concatenate([last[:, None], tokens], axis=1)
            hidden, logits = self._pass(verify, full, width)
            drafts = [Draft(verify[b:b + 1], Candidates.concat(laws[b]) if laws[b] else None,
                            Source.HEAD, depth, rule=rule) for b, (_, rule) in enumerate(noise)]
            verdicts = self._judged(verify, logits, drafts, depths)
            kept, token = verdicts[:, 0], verdicts[:, 1:].astype(verify.dtype)
            self._settle(kept + 1, width, 0)
            after = mx.concatenate([verify[:, 1:], token], axis=1)
            pairs = (hidden, mx.where(columns < kept[:, None], after, token), kept + 1, width)
            read = _verdicts(verify, verdicts)
            mx.async_eval(read)
            return read, pairs, token[:, 0]

        owed = [0 if s.owed is None else s.owed[1].shape[1] for s in self.rows]
        n, clock = 0, StretchClock()
        fresh = self._fresh(width)
        current = clock.queue(fresh, queue, mx.array([s.last for s in self.rows]), None)
        clock.started()
        self.restart = clock.restart
        while n < count:
            queued = clock.queue(fresh, queue, current[2], current[1]) if n + 1 < count else None
            committed, kept = self._read(current[0].tolist(), width)
            paid = clock.read()
            outcomes = [RoundOutcome(committed[b], depth, kept[b], Source.HEAD, depth, 0, paid,
                                     width, owed[b]) for b in range(rows)]
            yield [o if done is not None and done(b) else self._outcome(b, o)
                   for b, o in enumerate(outcomes)]
            clock.resume(True)  # (the next round, if any, was queued before this read)
            owed = [k + 1 for k in kept]
            n += 1
            if stop is not None and n + 1 < count and stop():
                count = n + 1  # the queued round is the last
            if queued is not None:
                current = queued
        hidden = current[1][0]
        for b, session in enumerate(self.rows):  # the last round's pairs, as round leaves them
            session.owe(hidden[b:b + 1, :kept[b] + 1], committed[b])

    def _fresh(self, width: int) -> Fresh:
        """Whether a pass about to be queued, `width` positions of every row, is the first of
        its shape here (session.Fresh)."""
        def buffers() -> tuple[int, int]:
            return extent(self.cache or []), extent(self.mtp_cache or [])

        def before() -> Callable[[], bool]:
            was = buffers()
            return lambda: self.trunk.first_pass(("rows", len(self.rows), width, was, buffers()))

        return before

    def _judged(self, verify: mx.array, logits: mx.array, drafts: list[Draft],
                depths: mx.array) -> mx.array:
        """Every row's [kept, token]: greedy rows at once, each sampled row by its own law and
        noise (session.judge, the rule a lone session applies)."""
        verdicts = acceptance.accept_greedy_rows(verify, logits, depths)
        for b, (d, s) in enumerate(zip(drafts, self.rows, strict=True)):
            if d.rule is not None:
                verdicts = _put(verdicts, b, judge(d, logits[b], s.params))
        return verdicts

    def _read(self, read: list[int], width: int) -> tuple[list[list[int]], list[int]]:
        """Every row's committed tokens and kept count from a round's one host read."""
        rows = len(self.rows)
        verdict = read[rows * (width - 1):]
        kept = [verdict[2 * b] for b in range(rows)]
        at = [b * (width - 1) for b in range(rows)]
        return [[*read[at[b]:at[b] + kept[b]], verdict[2 * b + 1]] for b in range(rows)], kept

    def _outcome(self, b: int, outcome: RoundOutcome) -> RoundOutcome:
        """Row b's session takes what its round committed (its context index, last token,
        acceptance counts)."""
        self.rows[b].commit(outcome.committed, outcome.depth, outcome.kept, outcome.source)
        return outcome

    def _pass(self, tokens: mx.array, real: mx.array, width: int) -> tuple[mx.array, mx.array]:
        """One trunk pass over every row's `width` tokens, row b's first real[b] real (the
        rest pad it): (hidden, logits), traced where the caches allow (decoder/model/traced.py)."""
        if self.holes.valid is not None:  # (a trunk with attention caches of every position)
            self.holes.open(real, width)
        passes, exact = self.trunk.passes, width == 1 and self.exact  # (exact: one row)
        traced = passes.run_rows(tokens, self.cache, self.holes) \
            if passes is not None and not exact else None
        self.stock_pass = traced is None  # its layers' keys are what `_staged` evaluates
        if traced is not None:
            return traced
        def forward() -> tuple[mx.array, mx.array]:
            return recorded(self.trunk.recorders, True,
                            lambda: self.trunk.forward(tokens, self.cache))

        if not exact:  # (the views are set only around the passes that take them)
            return forward()
        exact_views(self.cache or [], True)
        try:
            return forward()
        finally:
            exact_views(self.cache or [], False)

    def _settle(self, keep: mx.array, width: int, trimmed: int) -> None:
        """After a pass: row b keeps its first keep[b] positions (attention and recurrent)."""
        settle(self.cache, self.holes, keep, width, trimmed)
        for recorder in self.trunk.recorders:
            recorder.commit(keep)

    def plain_steps(self, count: int, stop: Callable[[], bool] | None = None
                    ) -> Iterator[tuple[list[int], float]]:
        """`count` plain steps of every row, each next pass queued before the last one's
        tokens are read (session.pipelined, the loop Session.plain_steps runs for one
        sequence; mlx-lm's BatchGenerator does the same): the host builds step t+1 while the
        device runs step t.
        Yields every row's token and what a step of this stretch has cost so far, on average
        (`pipelined`); headed rows owe the head their hiddens. When `stop()` turns true after
        a step, the one already queued is the last. Only where host and device work overlap (a GPU:
        `overlaps`); on a CPU each step is built after the last is read, so a request that
        arrives waits for the step in flight only, not for one queued behind it too."""
        if count <= 0:
            return
        if len(self.rows) == 1 and not self.exact:
            self._squeeze()
        rows = len(self.rows)
        ones = mx.ones(rows, mx.int32)
        sampled = [b for b, s in enumerate(self.rows) if not s.params.greedy]

        def step(tokens: mx.array) -> tuple[mx.array, mx.array]:
            hidden, logits = self._pass(tokens, ones, 1)
            self._settle(ones, 1, 0)
            picks = greedy(logits[:, -1])
            for b in sampled:
                picks = _put(picks, b, self.rows[b].sample(logits[b:b + 1, -1]))
            mx.async_eval(picks)
            return hidden, picks

        hiddens, steps = [], []

        def take(hidden: mx.array, picks: mx.array) -> list[int]:
            got = picks.tolist()
            hiddens.append(hidden)
            steps.append(got)
            for session, token in zip(self.rows, got, strict=True):
                session.commit([token])
            return got

        clock = StretchClock()
        for n, (_, got, seconds) in enumerate(pipelined(
                step, mx.array([[s.last] for s in self.rows]),
                lambda y: y[:, None].astype(mx.int32), count, take, stop, self.pipelined,
                self._fresh(1), clock)):
            if n == 0:
                self.restart = clock.restart
            yield got, seconds
        for b, session in enumerate(self.rows):
            if self.headed[b]:
                session.owe(mx.concatenate([h[b:b + 1] for h in hiddens], axis=1),
                            [got[b] for got in steps])
            if hiddens:
                session.keep_hidden(hiddens[-1][b:b + 1], 0)

    def _drafts(self, asks: list[Ask]) -> list[Draft]:
        """Every row's draft: context drafts, a draft model's and plain steps as a lone session
        makes them (a draft model's pass per row, on its own cache), head drafts chained for
        every row at once (`_head`)."""
        noise = [s.round_noise(a.head_steps) if a.head_steps else (None, None)
                 for s, a in zip(self.rows, asks, strict=True)]
        steps = max(a.head_steps for a in asks)
        headed = [b for b, h in enumerate(self.headed) if h]
        assert all(self.headed[b] for b, a in enumerate(asks) if a.head_steps)
        heads = self._head(steps, [asks[b] for b in headed],
                           [noise[b][0] for b in headed]) if steps else None
        place = {b: i for i, b in enumerate(headed)}  # a row's place in the head's caches
        drafts = []
        for b, (session, ask) in enumerate(zip(self.rows, asks, strict=True)):
            if ask.context:
                drafts.append(session.context_draft(list(ask.context), ask.match))
            elif ask.model and session.model is not None and ask.depth > 0:
                drafts.append(session.model.propose(ask.depth) or session.head_draft(0))
            elif ask.depth == 0:
                drafts.append(session.head_draft(0))
            else:
                assert heads is not None
                tokens, q = heads
                d = ask.depth
                i = place[b]
                chain = mx.concatenate([mx.array([[session.last]]), tokens[i:i + 1, :d]], axis=1)
                drafts.append(Draft(chain, Candidates.concat(q[i]) if q[i] else None,
                                    Source.HEAD, d, rule=noise[b][1]))
        return drafts

    def _head(self, steps: int, asks: list[Ask], draws: list[mx.array | None],
              owed: Owed | None = None) -> tuple[mx.array, list[list[Candidates]]]:
        """`steps` chained head drafts for every row with a head place ((H, steps) tokens,
        and per sampled row the law of each of its own drafts; asks and draws: those rows').
        Each row's owed pairs are fed first, right-padded to the longest: the sessions' own,
        or `owed` (the last pipelined round's, still on the device); the chained positions
        leave the head's caches afterwards, as a lone session trims them."""
        assert self.head is not None and self.mtp_cache is not None
        head = self.head
        rows = [s for s, h in zip(self.rows, self.headed, strict=True) if h]
        if owed is None:
            owed = _owed(rows)
        hidden, tokens, n, width = owed
        chained = [0] * head.blocks
        out_tokens, laws = [], [[] for _ in rows]
        for k in range(steps):
            block = k % head.blocks
            holes = self.mtp_holes[block]
            holes.open(n if k == 0 else mx.ones(len(rows), mx.int32), width if k == 0 else 1)
            logits, hidden = head(hidden, tokens, self.mtp_cache, k,
                                  pick=n - 1 if k == 0 else None, last_only=True)
            if k == 0:
                settle([self.mtp_cache[0]], holes, n, width, 0)
            else:
                settle([self.mtp_cache[block]], holes, mx.ones(len(rows), mx.int32), 1, 0)
                chained[block] += 1
            row_logits = logits[:, -1]
            picks = greedy(row_logits)
            for b, (session, ask) in enumerate(zip(rows, asks, strict=True)):
                if draws[b] is not None and k < ask.head_steps:
                    law = candidates(row_logits[b:b + 1], session.params, drafter=True)
                    laws[b].append(law)
                    picks = _put(picks, b, law.draw(draws[b][k:k + 1])[0])
            tokens = picks[:, None]
            out_tokens.append(tokens)
        for block, count in enumerate(chained):
            if count:
                drop([self.mtp_cache[block]], self.mtp_holes[block], count)
        for session in rows:
            session.owed = None
        return mx.concatenate(out_tokens, axis=1), laws


def _owed(rows: list[Session]) -> Owed:
    """The pairs each session owes the head, right-padded to the longest, with each row's
    count (on the device) and the padded width."""
    owed = [s.owed for s in rows]
    assert all(o is not None for o in owed)
    counts = [o[1].shape[1] for o in owed]  # type: ignore[index]
    width = max(counts)
    hidden = mx.concatenate([_padded(o[0], width) for o in owed])  # type: ignore[index]
    tokens = mx.concatenate([_padded(o[1], width) for o in owed])  # type: ignore[index]
    return hidden, tokens, mx.array(counts), width


def _verdicts(verify: mx.array, verdicts: mx.array) -> mx.array:
    """What a round's one host read holds: every row's drafts, then its kept count and
    emitted token."""
    return mx.concatenate([verify[:, 1:].astype(mx.int32).reshape(-1), verdicts.reshape(-1)])


def _put(a: mx.array, index: int, value: mx.array) -> mx.array:
    """a with row `index` replaced by `value` (lazily)."""
    row = (mx.arange(a.shape[0]) == index).reshape(-1, *[1] * (a.ndim - 1))
    return mx.where(row, value.astype(a.dtype), a)
