"""Continuous batching: requests join between rounds, each decodes at its own depth, and leave
when done, cancelled or disconnected (decoder/rounds/batch.py runs the passes).

A joining request is prefilled alone (a Session: prefix cache, chunks, first token), in chunks
between the others' rounds: one chunk per round, so a long prompt stalls the batch for no more
than one chunk at a time. Where rounds are synchronous (a CPU) and a server takes arrivals
mid-round (`take_arrivals`), that chunk may run between the stages of a round's pass
(Batch._staged): a request that arrives during a round waits for one stage, not the round.
Each round every row asks for its draft: at a fixed depth as a lone
session would (context drafts where its text offers some, else the head's, else a plain step);
under `--depth auto` the depth policy (decoder/tuning/policy.py's `decide`, as for a lone sequence)
chooses the round's depth from every auto row's acceptance and what a pass of this shape costs
here, and each row drafts from its best source at it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from mtpkit.decoder.cache.caches import extent
from mtpkit.decoder.options import Source
from mtpkit.decoder.rounds.batch import Ask, Batch
from mtpkit.decoder.rounds.batch_prefill import pays as prefill_pays
from mtpkit.decoder.rounds.batch_prefill import prefill_together
from mtpkit.decoder.rounds.controller import Controller
from mtpkit.decoder.rounds.session import RoundOutcome, Session, Stopped
from mtpkit.decoder.stats import Stats
from mtpkit.decoder.tuning.costs import check_batch, check_plain
from mtpkit.decoder.tuning.policy import CostTable, DepthPolicy, Offer, Shape, decide

SPEC_ROUNDS = 16  # pipelined speculative rounds between two of the policy's choices (each
# asks every row's context: not every round), once the stretch's shape has been timed as often


@dataclass
class Request:
    """One sequence to decode: its prompt ids and the session that will decode them (made by
    the runner from the request's options), its stop conditions, and under auto its policy."""

    ids: list[int]
    session: Session
    max_tokens: int
    eos: set[int] = field(default_factory=set)
    policy: DepthPolicy | None = None
    stop: Callable[[], bool] | None = None  # a client gone, a stop sequence seen
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop", "length" or "cancelled" once done
    started: float = 0.0
    first_at: float | None = None

    @property
    def stats(self) -> Stats:
        return self.session.stats

    @property
    def left(self) -> int:
        return self.max_tokens - len(self.tokens)


@dataclass(frozen=True)
class Event:
    """Tokens a request committed (after EOS and max_tokens are applied); `done` with its
    finish reason on its last event."""

    request: Request
    tokens: list[int]
    done: bool = False


class Scheduler:
    """Up to `max_batch` requests decoding together; more wait in arrival order.

    A request that finds no other decodes `solo`: on its own session exactly as
    Runner.stream decodes it (its controller, pipelined plain stretches, traced passes), until
    another arrives; then it ends any plain stretch (its queued step committed) and joins the
    batch at the next clean point, and the newcomer's prefill starts."""

    def __init__(self, batch: Batch, max_batch: int, paid: CostTable | None = None,
                 solo: bool = True, one_row: bool = False) -> None:
        """paid: the runner's cost table (decoder/tuning/policy.py), which auto rows are priced by
        (default: the first auto request's). solo: a lone request may decode on its own
        session; one_row: it may decode as a batch of one where that pays (`_solo`; only
        where the runner's rows batch exactly: Runner.batchable)."""
        self.batch, self.max_batch = batch, max_batch
        self.paid = paid
        self.decider: Callable[[list[Request]], int] | None = None  # overrides the policy's
        # choice of depth (decoder/tuning/batch_costs.py times shapes through it)
        self.waiting: deque[Request] = deque()
        self.filling: tuple[Request, Iterator[int | None]] | None = None
        self.active: list[Request] = []
        self.rows = 0  # rows the last step's round verified (0: none)
        self.allow_solo, self.one_row = solo, one_row
        self.solo: tuple[Request, Iterator[list[int]], Controller | None] | None = None
        self.stretch: Iterator[tuple[int, tuple[list[int], float]]] | None = None  # plain steps
        self.entering: list[Request] = []  # first token sent; join the batch next step
        self.spec: Iterator[tuple[int, list[RoundOutcome]]] | None = None  # pipelined
        # speculative rounds, numbered
        self.arrivals: Callable[[], None] | None = None  # mid-round joins: `take_arrivals`
        self.early: Callable[[list[Event]], None] | None = None
        self._filled = False  # a prefill chunk ran this step (one a step)
        self.next_depth: tuple[int, int] | None = None  # (rows, depth) stop() chose: _asks

    def add(self, request: Request) -> None:
        """Queue a request (prepared by Runner.prepare); the first under auto brings its cost
        table where none was given. Into an idle scheduler, its peak memory counts from here."""
        if not self:
            mx.reset_peak_memory()
        request.started = time.perf_counter()
        if request.policy is not None and self.paid is None:
            self.paid = request.policy.costs
        self.waiting.append(request)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.filling or self.active or self.solo or self.entering
                    or self.spec)

    def step(self) -> list[Event]:
        """One chunk of a joining prompt's prefill, then one round of every active row (or
        one step of the solo request). A request whose first token the last step sent joins
        the batch first: its caches' copy into the batch's is not in its time to first token."""
        for request in self.entering:
            self.batch.join(request.session)
            self.active.append(request)
        self.entering = []
        self._filled = False
        if self.solo is not None:
            return self._solo_step()
        if self.stretch is not None and (events := self._stretch_step()) is not None:
            return events
        if self.spec is not None and (events := self._spec_step()) is not None:
            return events
        events = self._fill()
        self.rows = 0
        if events:  # a first token: sent now, not after the others' round
            return events
        self.rows = len(self.active)
        if self.active:
            events += self._round()
        return events

    # -- alone ------------------------------------------------------------------------------

    def _solo(self, request: Request) -> bool:
        """Whether a lone request decodes on its own session rather than as a batch of one.
        A batch of one runs pipelined speculative rounds (Batch.spec_rounds: the next round
        queued before the last one's verdicts are read), which a lone session's synchronous
        rounds cannot; so a request drafting from the head alone, at a fixed depth or under
        auto, goes into the batch where rounds pipeline (BENCHMARKS.md, context sweep: auto as
        a batch of one against auto alone). Not: with context drafts or a draft model (the
        session drafts them), with a quantized KV cache, sharded or with recurrent layers
        (Runner.scheduler's `one_row`)."""
        session = request.session
        return not (self.one_row and self.batch.pipelined
                    and (session.depth > 0 or request.policy is not None)
                    and session.head is not None
                    and session.lookup is None and session.model is None)

    def _start_solo(self, request: Request) -> None:
        session, policy = request.session, request.policy
        controller = Controller(session, policy) if policy is not None else None

        def left() -> int:
            return request.left

        def wanted() -> bool:  # another request waits: end the plain stretch
            return bool(self.waiting) and self.max_batch > 1

        self.solo = (request, solo_steps(session, left, controller, wanted), controller)

    def _solo_step(self) -> list[Event]:
        request, steps, controller = self.solo  # type: ignore[misc]
        self.rows = 1
        events = self._commit(request, next(steps))
        if controller is not None:
            controller.report(request.stats)
        if request.finish is not None:
            self.solo = None
        elif self.waiting and self.max_batch > 1 and not request.session.pipelined:
            # a clean point (no plain step queued ahead): into the batch
            self.solo = None
            self.batch.join(request.session)
            self.active.append(request)
        return events

    def run(self) -> Iterator[Event]:
        while self:
            yield from self.step()

    # -- joining ----------------------------------------------------------------------------

    def take_arrivals(self, arrivals: Callable[[], None],
                      early: Callable[[list[Event]], None]) -> None:
        """Take requests mid-round too, where rounds are synchronous (a CPU): between the
        stages of a round's pass `arrivals()` queues what arrived since (`add`), and `early`
        sends the events a prefill made there (a server's; offline batches have nothing to
        wait for, and their passes are not staged)."""
        self.arrivals, self.early = arrivals, early
        if not self.batch.pipelined:
            self.batch.between = self._between

    def _between(self) -> None:
        """Between the stages of a synchronous round's pass: what arrived is queued and, once
        a step, a waiting request's next prefill chunk runs; a first token goes out at once
        (`early`) and its request joins the batch next step. Nothing the round's rows
        compute depends on it (its own caches, sessions and draws)."""
        if self.early is None or self._filled:
            return  # (one prefill chunk a step, as between rounds)
        if self.arrivals is not None:
            self.arrivals()
        if self.filling is not None or self.waiting:
            events = self._fill()
            if events:
                self.early(events)

    def _fill(self) -> list[Event]:
        if (self.filling is None and self.waiting
                and len(self.active) + len(self.entering) < self.max_batch):
            if (len(self.waiting) > 1 and prefill_pays()
                    and len(together := self._together()) > 1):
                return self._prefill_together(together)
            request = self.waiting.popleft()
            self.filling = (request, request.session.start_chunks(request.ids))
        if self.filling is None:
            return []
        self._filled = True
        request, chunks = self.filling
        try:
            first = next(chunks)
        except Stopped:
            self.filling = None
            request.finish = "cancelled"
            return [Event(request, [], True)]
        if first is None:
            return []  # more chunks to go: the others' round first
        self.filling = None
        self._prefilled([request])
        return self._commit(request, [first], joining=True)

    def _prefilled(self, requests: list[Request]) -> None:
        """The peak of a prefill counts for the requests it prefilled, not for their mates
        (their peaks count from here)."""
        peak = mx.get_peak_memory()
        for request in requests:
            request.stats.peak_memory_bytes = max(request.stats.peak_memory_bytes, peak)
        mx.reset_peak_memory()

    def _together(self) -> list[Request]:
        """The requests at the head of the line, in arrival order and while the batch has room,
        whose prompts can be prefilled in one pass (decoder/rounds/batch_prefill.py)."""
        together: list[Request] = []
        for request in self.waiting:
            if (len(self.active) + len(together) >= self.max_batch
                    or request.stop is not None and request.stop()
                    or not request.session.prefills_with_others(request.ids)):
                break
            together.append(request)
        return together

    def _prefill_together(self, requests: list[Request]) -> list[Event]:
        """Prefill the prompts in one pass; each sends its first token now and joins the
        batch next step."""
        for _ in requests:
            self.waiting.popleft()
        self._filled = True
        firsts = prefill_together([r.session for r in requests], [r.ids for r in requests])
        self._prefilled(requests)
        events = []
        for request, first in zip(requests, firsts, strict=True):
            events += self._commit(request, [first], joining=True, alone=False)
        return events

    # -- rounds -----------------------------------------------------------------------------

    def _round(self) -> list[Event]:
        asks = self._asks()
        if self._start_stretch(asks):
            events = self._stretch_step()
            if events is not None:
                return events
        if self._start_spec(asks) and (events := self._spec_step()) is not None:
            return events
        events = self._settled(self.batch.round(asks))
        self._leave()
        return events

    def _settled(self, outcomes: list[RoundOutcome], pipelined: bool = False,
                 timed: bool = True) -> list[Event]:
        """A round's outcomes learnt and committed (a row done earlier in a pipelined stretch
        takes no more). Not `timed`: a stretch's first round, whose read may also have
        waited for the restart (host work not overlapped, a shape perhaps compiled) and for
        the round queued behind it: the clock ticks, no price is learnt (the rounds after it
        are priced at the stretch's mean, which spreads that)."""
        if self.paid is not None and timed:
            self._observe(outcomes, pipelined)
        elif self.paid is not None:
            self.paid.tick(len(outcomes))
        events = []
        for request, outcome in zip(list(self.active), outcomes, strict=True):
            if request.finish is None:
                self._learn(request, outcome)
                events += self._commit(request, outcome.committed)
        return events

    def _wanted(self) -> bool:
        """Whether a pipelined stretch ends: a request waits for a place, or every row is done.
        Where passes overlap (a GPU) a row done mid-stretch stays in the batch, taking
        nothing, until then: a pass of one row fewer costs about the same, while leaving
        changes the pass's shape (a cuDNN attention graph not built yet) and restarts the
        pipeline with a round the host cannot overlap. On a CPU a row
        costs its compute, so a row done ends the stretch and leaves."""
        live = sum(r.finish is None for r in self.active)
        if live < len(self.active) and not self.batch.pipelined:
            return True
        return live == 0 or bool(self.waiting) and live < self.max_batch

    def _start_spec(self, asks: list[Ask]) -> bool:
        """Speculative rounds pipelined (Batch.spec_rounds) where every row drafts the same
        depth from the head (under auto: the policy's choice). Every SPEC_ROUNDS rounds the
        policy chooses again, and while the stretch's pass shape has been timed fewer times
        than that, after rounds SPEC_ROUNDS / 4, then twice as many, and so on (an untried
        shape's price is a guess the policy explores on: its first rounds correct it, but the
        rounds just after a restart read slow, and asked after each of them the policy took
        every try for dear and churned through untried depths, a restart each); the stretch
        goes on while it picks this depth (a restart costs a round the host cannot overlap,
        and the slow rounds after it); once a row is done, until every row
        is (a done row stays until then: `_wanted`). With a row at a fixed depth, no round can
        reach a row's max_tokens (its last rounds draft fewer, as alone: its seeded text is the
        same batched); under auto a row's surplus past its max_tokens is dropped (its depth is
        the batch's choice anyway, and what it commits is exact at any depth), so the batch's
        last tokens come pipelined too. Rows then draft from the head only; a row at a fixed
        depth with a context index keeps synchronous rounds (it drafts from its context where
        its text offers, as alone). Only where the host's work overlaps the device's (a GPU:
        batch.overlaps)."""
        depth = asks[0].depth
        if (not self.batch.pipelined or depth < 1
                or any(a.context or a.depth != depth for a in asks)
                or not all(self.batch.headed)
                or any(r.policy is None and r.session.lookup is not None for r in self.active)):
            return False
        fixed = [r.left for r in self.active if r.policy is None]
        rounds = ((min(fixed) - 1) // (depth + 1) if fixed
                  else max(r.left for r in self.active))
        if rounds < 2:
            return False
        auto_rows = [r for r in self.active if r.policy is not None]
        shape = (len(self.active), depth + 1, True)
        read = 0

        def stop() -> bool:  # after each round read: the one queued is the last?
            nonlocal read
            read += 1
            if self._wanted():
                return True
            if not auto_rows or any(r.finish is not None for r in self.active):
                return False
            due = read % SPEC_ROUNDS == 0 or (  # untimed: after rounds 4, 8, 16...
                read >= SPEC_ROUNDS // 4 and read & (read - 1) == 0 and not self._timed(shape))
            return due and self._chosen_otherwise(auto_rows, depth)

        self.spec = enumerate(self.batch.spec_rounds(
            depth, rounds, stop, lambda b: self.active[b].finish is not None))
        return True

    def _timed(self, shape: tuple[int, int, bool]) -> bool:
        """Whether a pass `shape` has been timed here SPEC_ROUNDS times (decayed): the policy's
        price of it is then its own, no longer a guess."""
        return self.paid is None or self.paid.timings(shape) >= SPEC_ROUNDS

    def _chosen_otherwise(self, auto_rows: list[Request], depth: int) -> bool:
        """The policy's choice at a pipelined stretch's check: whether it is not `depth` again
        (the stretch then ends). A different depth is what the next stretch runs: `_asks`
        takes it rather than choosing again."""
        chosen = self._depth(auto_rows, (len(self.active), depth + 1, True))
        if chosen == depth:
            return False
        if chosen > 0:
            self.next_depth = (len(self.active), chosen)
        return True

    def _spec_step(self) -> list[Event] | None:
        """The pipelined stretch's next round of every row (None once it has ended: rows
        done leave)."""
        assert self.spec is not None
        try:
            read, outcomes = next(self.spec)
        except StopIteration:
            self.spec = None
            self._leave()
            return None
        self.rows = len(self.active)
        self._restarted()
        return self._settled(outcomes, pipelined=True, timed=read > 0)

    def _restarted(self) -> None:
        """A pipelined stretch's restart (Batch.restart), into the cost table once."""
        if self.paid is not None and self.batch.restart is not None:
            self.paid.observe_restart(len(self.active), self.batch.restart)
        self.batch.restart = None

    def _start_stretch(self, asks: list[Ask]) -> bool:
        """Plain steps pipelined (Batch.plain_steps) where every row decodes plain for a
        while: rows at a fixed depth 0, and auto rows while the policy prefers plain steps
        (asked again after each). A row at a fixed depth above 0 keeps every round a
        speculative one."""
        if (any(r.policy is None and r.session.depth > 0 for r in self.active)
                or any(a.depth or a.context for a in asks)):
            return False
        steps = min(r.left for r in self.active)
        if steps < 2:
            return False
        auto = [r for r in self.active if r.policy is not None]

        def stop() -> bool:
            return self._wanted() or bool(auto) and self._depth(
                auto, (len(self.active), 1, True)) > 0

        self.stretch = enumerate(self.batch.plain_steps(steps, stop))
        return True

    def _stretch_step(self) -> list[Event] | None:
        """The stretch's next step of every row (None once it has ended: rows done leave). Its
        first step's read may also have waited for work queued before the stretch (a long
        prefill's last piece, the last round): the clock ticks, no price is learnt (one read
        long after a prefill made auto take plain steps for dear: docs/decoding.md)."""
        assert self.stretch is not None
        try:
            read, (tokens, paid) = next(self.stretch)
        except StopIteration:
            self.stretch = None
            self._leave()
            return None
        self.rows = len(self.active)
        self._restarted()
        if self.paid is not None:
            self.paid.tick(self.rows)
        if self.paid is not None and read:
            keys = self._keys()
            self.paid.observe((self.rows, 1, True), paid, keys)
            if self.rows == 1 and self.paid.learn:  # the stored curve judged, as a lone run's
                check_plain(self.paid.curve, self.paid.seconds((1, 1, True), keys))
            elif self.rows > 1:  # and tune's batch prices, by what the batch's steps take
                check_batch(self.paid, (self.rows, 1, True))
        events = []
        for request, token in zip(self.active, tokens, strict=True):
            if request.finish is None:  # a row done earlier in the stretch takes no more
                if request.policy is not None:
                    request.policy.plain()
                events += self._commit(request, [token])
        return events

    def _pipelines(self) -> bool:
        """Whether a round chosen now would run pipelined (as _start_spec asks: every row
        drafting from the head where host and device overlap)."""
        return (self.batch.pipelined and all(self.batch.headed)
                and all(r.session.lookup is None and r.session.model is None
                        for r in self.active))

    def _depth(self, auto: list[Request], running: Shape | None = None) -> int:
        """The depth of the next round for the auto rows (0: plain): the policy's plan over
        every row (mates at a fixed depth priced as a row that commits one token) at the keys
        the batch's pass attends over (`_keys`), or the `decider`'s. `running`: the pass shape
        of the pipelined stretch asking (another one restarts: `decide`)."""
        if self.decider is not None:
            return self.decider(auto)
        assert self.paid is not None and auto
        first = auto[0].policy
        assert first is not None
        offers = [_offer(r) for r in auto] + [Offer()] * (len(self.active) - len(auto))
        stretch = not any(r.policy is None and r.session.depth > 0 for r in self.active)
        return decide(offers, self.paid, first.max_depth, self._keys(), self._pipelines(),
                      (len(self.active), 1, stretch), first.model_step, running,
                      SPEC_ROUNDS).depth

    def _keys(self) -> int:
        """The keys the batch's pass attends over (its buffer: the longest row's, padding and
        holes included): where its rounds are priced, and observed against that price."""
        return extent(self.batch.cache) if self.batch.cache is not None else 0

    def _asks(self) -> list[Ask]:
        auto = [r for r in self.active if r.policy is not None]
        if self.next_depth is not None and self.next_depth[0] == len(self.active):
            depth = self.next_depth[1]  # chosen as the last stretch ended
        else:
            depth = self._depth(auto) if auto else 0
        self.next_depth = None
        return [self._ask(r, depth) for r in self.active]

    def _ask(self, request: Request, batch_depth: int) -> Ask:
        session, most = request.session, request.left - 1
        headed = session.head is not None and session.depth > 0
        if session.model is not None:  # a draft model: the row's depth, or its own choice
            depth = (session.depth if request.policy is None
                     else request.policy.choose()[1])  # (priced as alone: its rows' passes)
            return Ask(depth=min(depth, most), model=True) if min(depth, most) > 0 else Ask()
        if request.policy is None:  # a fixed depth, as Session.next_round drafts
            depth = min(session.depth, most)
            if session.lookup is not None and depth > 0:
                drafts, match = session.lookup.propose(depth)
                if drafts:
                    return Ask(context=tuple(drafts), match=match)
            return Ask(depth=depth if headed else 0)
        depth = min(batch_depth, most)
        if depth <= 0:
            return Ask()
        offer = _offer(request, depth)
        if offer.source(depth) == Source.LOOKUP:
            drafts, match = _context(request, depth)
            return Ask(context=tuple(drafts), match=match)
        return Ask(depth=depth if offer.head else 0)

    def _observe(self, outcomes: list[RoundOutcome], pipelined: bool) -> None:
        """A round's time into the cost table, under its pass's shape (the widest row), against
        the prior at the batch's keys (as it was priced), its head steps priced as the prior
        prices them."""
        assert self.paid is not None
        rows = len(outcomes)
        depth = max(o.depth for o in outcomes)
        steps = max((o.drafted for o in outcomes if o.source in (Source.HEAD, Source.CHAIN)),
                    default=0)
        shape = (rows, depth + 1, pipelined)
        self.paid.tick(rows)
        self.paid.observe(shape, outcomes[0].paid_s, self._keys(), drafting=steps * self.paid.draft)
        if rows > 1:  # tune's batch prices judged by what the batch's passes take
            check_batch(self.paid, shape)

    def _learn(self, request: Request, outcome: RoundOutcome) -> None:
        policy = request.policy
        if policy is None:
            return
        if outcome.depth > 0:
            policy.record(outcome.depth, outcome.kept, outcome.source, outcome.drafted,
                          outcome.match)
        else:
            policy.plain()

    # -- committing and leaving -------------------------------------------------------------

    def _commit(self, request: Request, tokens: list[int], joining: bool = False,
                alone: bool = True) -> list[Event]:
        """Apply EOS and max_tokens to what a request committed, time it, and on its first
        token let it join the batch (unless that token already ended it), or decode solo
        where nothing else runs or waits and it did not start with others (`alone`)."""
        now = time.perf_counter()
        stats = request.stats
        if request.first_at is None:
            request.first_at = now
            stats.ttft_s = now - request.started
        stop = next((i for i, t in enumerate(tokens) if t in request.eos), None)
        tokens = tokens[:stop][:request.left]
        request.tokens += tokens
        stats.generated_tokens = len(request.tokens)
        stats.decode_window_s = now - request.first_at
        stats.peak_memory_bytes = max(stats.peak_memory_bytes, mx.get_peak_memory())
        if request.policy is not None:
            stats.depths = dict(sorted(request.policy.chosen.items()))
        request.finish = ("stop" if stop is not None else "length" if request.left <= 0
                          else "cancelled" if request.stop is not None and request.stop()
                          else None)
        if request.finish is not None and request.policy is not None:  # what it was priced by
            stats.cost_scale = (self.paid or request.policy.costs).summary()
        if joining and request.finish is None:
            # (max_batch 1 never has a mate: solo, on the session's own caches, which a
            # quantized KV cache needs: decoder/options.py batch_option)
            if alone and self.allow_solo and self._solo(request) and (
                    self.max_batch == 1 or not (self.active or self.waiting)):
                self._start_solo(request)
            else:
                self.entering.append(request)
        return [Event(request, tokens, request.finish is not None)]

    def _leave(self) -> None:
        gone = {i for i, r in enumerate(self.active) if r.finish is not None}
        if gone:
            self.batch.leave(gone)
            self.active = [r for i, r in enumerate(self.active) if i not in gone]
            if (len(self.active) == 1 and self.allow_solo and not self.waiting
                    and self.filling is None and not self.entering
                    and self._solo(self.active[0])):  # the last one left: solo again
                self.batch.part()
                self._start_solo(self.active.pop())


def solo_steps(session: Session, left: Callable[[], int], controller: Controller | None = None,
               wanted: Callable[[], bool] | None = None) -> Iterator[list[int]]:
    """A lone session's steps after its first token, each what it committed: pipelined plain
    steps at depth 0 (until `wanted()`), the controller's rounds under auto, else rounds at the
    session's depth; `left()` tokens still to make."""
    if session.depth == 0:
        yield from ([t] for t in session.plain_steps(left(), wanted))
    elif controller is not None:
        controller.interrupt = wanted
        yield from controller.rounds(left)
    while True:
        yield session.next_round(min(session.depth, left() - 1)).committed


def _context(request: Request, width: int) -> tuple[list[int], int]:
    """The row's context drafts (up to `width`) and their match length, where it drafts from
    its context under auto."""
    policy, lookup = request.policy, request.session.lookup
    if policy is None or lookup is None or Source.LOOKUP not in policy.sources:
        return [], 0
    drafts, match = lookup.propose(width)
    return drafts, match


def _offer(request: Request, width: int | None = None) -> Offer:
    """What an auto row offers the policy, up to `width` drafts (default: its deepest): its
    head's acceptance where it has head drafts, and its context's drafts' (a context's are
    those of the match it would draft from now, its tracker by match length)."""
    policy, session = request.policy, request.session
    assert policy is not None
    width = policy.max_depth if width is None else width
    headed = session.head is not None and session.depth > 0 and Source.HEAD in policy.sources
    drafts, match = _context(request, width)
    sources = (Source.HEAD,) * headed + (Source.LOOKUP,)
    return policy.offer(len(drafts), match, sources)
