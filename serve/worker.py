"""One owner for turns at the decoder: requests wait in a bounded first-in first-out line, and
every generation a server runs happens on one thread, the one that called serve_forever.

With max_batch above 1, up to that many submitted requests decode together in one batch
(decoder/rounds/scheduler.py): each joins between rounds as a place frees up, in arrival order, and
leaves when done. Otherwise one at a time. MLX state is not shared across threads; arrival
order, because threads woken from a lock come in any order (and a full line is refused at
once, so the client hears 503 with Retry-After instead of waiting without a word). On one
thread, because MLX keeps compiled functions per thread (a request thread of its own traced
every verify shape again), and a thread that used them frees them as it ends: one ending while
the interpreter shut down (Ctrl-C right after an answer) aborted the process under Python 3.13
and older ("terminate called without an active exception").
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from mtpkit.serve.protocol import RequestError

if TYPE_CHECKING:
    from mtpkit.decoder.rounds.scheduler import Event, Request, Scheduler
    from mtpkit.serve.channels import Delta

    Shape = Callable[[Event], list[Delta]]  # a batched request's events as its deltas

POLL_S = 0.1  # how often a waiting request looks at its client
END = object()  # on a ticket's channel: the generation is over, its last delta was sent


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Gone(Exception):
    """The client went away: while its request waited, or during its generation (whose last
    delta would pass a cut answer for a finished one)."""


def stopping() -> RequestError:
    return RequestError(503, "the server is shutting down", kind="server_error")


class Ticket:
    """One admitted request: its place in the line, its arrival `number` (1 = the first the
    worker admitted) and its generation, `deltas`, which the service attaches. Iterate it for the
    deltas: once submitted, the serving thread makes them; otherwise the iterating thread waits
    for its turn and makes them itself (the Python API, verify-run). `cancelled`: its client went
    away (seen while it waited or between rounds), or the server is stopping; `left`: its
    client went away, so its generation may have been cut: its end is Gone, never a finish."""

    def __init__(self, worker: Worker, number: int, gone: Callable[[], bool] | None) -> None:
        self.worker, self.number, self._gone = worker, number, gone
        self.deltas: Iterator[Delta] = iter(())
        # batched serving: the request for the scheduler, and how its events become deltas
        self.join: Callable[[], tuple[Request, Shape]] | None = None
        self.submitted = False
        self.channel: queue.SimpleQueue[object] = queue.SimpleQueue()  # serving thread -> request
        self.started: float | None = None  # when its turn came
        self.cancelled = False
        self.left = False
        self.finished = False  # its request read the end of the channel

    def gone(self) -> bool:
        if not self.cancelled and self._gone is not None:
            self.cancelled = self.left = self._gone()
        return self.cancelled

    def _last(self, delta: Delta) -> Delta:
        """A delta for its request; the generation's last one only if its client is there."""
        if delta.result is not None and self.left:
            raise Gone()
        return delta

    def wait(self, gone: Callable[[], bool] | None = None) -> None:
        """Until its turn (at once if it has it); Gone, out of the line, if gone() says first."""
        self.worker.take(self, gone)

    def leave(self) -> None:
        """Give up the place, whether its turn came or not (a second time: nothing)."""
        self.worker.release(self)

    def close(self) -> None:
        """Its request is done with it: a turn that has not come leaves the line; a submitted
        generation still running is cancelled (it ends at its next round, on the serving
        thread); one this thread runs ends now."""
        if not self.submitted:
            self._end()
        elif not self.worker.withdraw(self) and not self.finished:
            self.cancelled = True

    def __iter__(self) -> Ticket:
        return self

    def __next__(self) -> Delta:
        if not self.submitted:
            if self.started is None:
                self.wait(self.gone)
            try:
                return self._last(next(self.deltas))
            except BaseException:
                self._end()
                raise
        while True:
            try:
                item = self.channel.get(timeout=POLL_S)
            except queue.Empty:
                if self.gone() and self.worker.withdraw(self):
                    raise Gone() from None  # gone while waiting: it left the line
                continue
            if item is END:
                self.finished = True
                raise StopIteration
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            return self._last(cast("Delta", item))

    def _end(self) -> None:
        getattr(self.deltas, "close", lambda: None)()
        self.leave()


class Worker:
    """The line and the serving thread. enter() admits a request and hands out its Ticket
    (QueueFull when max_waiting already wait behind the running one; 0: none); run() makes the
    generations of submitted tickets in arrival order on the thread that calls it, until stop().
    A place is given back only in release()."""

    def __init__(self, max_waiting: int, max_batch: int = 1,
                 batcher: Callable[[], Scheduler] | None = None,
                 on_pass: Callable[[int], Any] | None = None) -> None:
        """max_batch above 1 (with `batcher`, which makes an empty Scheduler): submitted
        generations decode together, up to that many; `on_pass` hears each pass's rows."""
        self.max_waiting, self.max_batch = max_waiting, max_batch if batcher else 1
        self.batcher, self.on_pass = batcher, on_pass
        self.cond = threading.Condition()  # reentrant: release() may be called holding it
        self.waiting: deque[Ticket] = deque()
        self.running: Ticket | None = None  # a turn of its own (one at a time)
        self.batch: list[Ticket] = []  # generations decoding together
        self.cuts: list[Ticket] = []  # batched generations stop() cancelled
        self.recent_s = 1.0  # a moving mean of turn lengths, for Retry-After
        self.admitted = 0  # tickets handed out: each request's arrival number
        self.cut: Ticket | None = None  # the generation stop() cancelled
        self.stopped = threading.Event()

    @property
    def depth(self) -> int:
        return len(self.waiting)

    @property
    def busy(self) -> int:
        """Generations running now."""
        return int(self.running is not None) + len(self.batch)

    def enter(self, gone: Callable[[], bool] | None = None) -> Ticket:
        """A place at the end of the line. gone(): its client went away (asked while it waits
        and, by its generation, after each round)."""
        with self.cond:
            busy = self.running is not None or self.waiting or self.batch
            room = self.max_batch - len(self.batch) if self.max_batch > 1 else 0
            if busy and len(self.waiting) >= self.max_waiting + room:
                ahead = len(self.waiting) + 1
                raise QueueFull(max(1, min(600, math.ceil(ahead * self.recent_s))))
            self.admitted += 1
            ticket = Ticket(self, self.admitted, gone)
            self.waiting.append(ticket)
            return ticket

    def submit(self, ticket: Ticket) -> Ticket:
        """Its generation is made on the serving thread; a stopped worker refuses it (503)."""
        with self.cond:
            if self.stopped.is_set():
                self.release(ticket)
                raise stopping()
            ticket.submitted = True
            self.cond.notify_all()
        return ticket

    def take(self, ticket: Ticket, gone: Callable[[], bool] | None = None) -> None:
        """Block until `ticket` runs: at the head of the line, once nothing else does."""
        with self.cond:
            while self.running is not ticket:
                if (self.running is None and not self.batch and self.waiting
                        and self.waiting[0] is ticket):
                    self.waiting.popleft()
                    self.running, ticket.started = ticket, time.monotonic()
                elif gone is not None and gone():
                    self.release(ticket)
                    raise Gone()
                else:
                    self.cond.wait(POLL_S)

    def withdraw(self, ticket: Ticket) -> bool:
        """Give up a place whose turn has not come; False once it has (or it was given up)."""
        with self.cond:
            if ticket not in self.waiting:
                return False
            self.release(ticket)
            return True

    def release(self, ticket: Ticket) -> None:
        """The one path by which a place is given back: a turn that ended (its length feeds
        Retry-After) or one given up before it came. Again for the same ticket: nothing."""
        with self.cond:
            if self.running is ticket or ticket in self.batch:
                assert ticket.started is not None
                if self.running is ticket:
                    self.running = None
                else:
                    self.batch.remove(ticket)
                self.recent_s = 0.8 * self.recent_s + 0.2 * (time.monotonic() - ticket.started)
            elif ticket in self.waiting:
                self.waiting.remove(ticket)
            self.cond.notify_all()

    def run(self) -> None:
        """Make submitted generations in arrival order until stop(); tickets still waiting then
        are answered 503."""
        try:
            if self.max_batch > 1:
                self._run_batched()
            while (ticket := self._next()) is not None:
                self._serve(ticket)
        finally:
            with self.cond:
                self.stopped.set()  # submit() takes no more
                refused = [t for t in self.waiting if t.submitted]
                for ticket in refused:
                    self.release(ticket)
            for ticket in refused:
                ticket.channel.put(stopping())

    def stop(self) -> None:
        """run() returns after the running generation, which is cancelled: it ends at its
        next round (a sharded world's ranks stay in step), and its client is told 503 instead
        of a finish that would pass for the model's."""
        with self.cond:
            self.stopped.set()
            if self.running is not None:
                self.running.cancelled = True
                self.cut = self.running
            for ticket in self.batch:
                ticket.cancelled = True
            self.cuts = list(self.batch)
            self.cond.notify_all()

    def _next(self) -> Ticket | None:
        with self.cond:
            while not self.stopped.is_set():
                head = self.waiting[0] if self.waiting and self.running is None else None
                if head is not None and head.submitted:
                    self.take(head)
                    return head
                self.cond.wait(POLL_S)
        return None

    def _serve(self, ticket: Ticket) -> None:
        try:
            for delta in ticket.deltas:
                cut = delta.result is not None and self.cut is ticket
                ticket.channel.put(stopping() if cut else delta)
            ticket.channel.put(END)
        except Exception as exc:  # the request thread answers it as it would its own
            ticket.channel.put(exc)
        except BaseException:  # a second Ctrl-C: its client is told, then the server stops
            ticket.channel.put(stopping())
            raise
        finally:
            ticket._end()

    # -- batched serving --------------------------------------------------------------------

    def _admit(self, busy: bool) -> list[Ticket] | None:
        """Submitted tickets at the head of the line that join the batch now (arrival order,
        while it has room); waits for one while nothing runs. None: stopped, nothing left."""
        with self.cond:
            while True:
                if self.stopped.is_set():
                    return [] if busy else None
                joining = []
                while (self.waiting and self.waiting[0].submitted and self.running is None
                       and len(self.batch) < self.max_batch):
                    ticket = self.waiting.popleft()
                    ticket.started = time.monotonic()
                    self.batch.append(ticket)
                    joining.append(ticket)
                if joining or busy:
                    return joining
                self.cond.wait(POLL_S)

    def _run_batched(self) -> None:
        """Decode the submitted generations together until stop() (decoder/rounds/scheduler.py): each
        round every running one commits its tokens, whose deltas go to its channel."""
        assert self.batcher is not None
        live: dict[int, tuple[Ticket, Shape]] = {}
        scheduler = self._scheduler(live)
        while (joining := self._admit(bool(live))) is not None:
            self._join(scheduler, live, joining)
            if not live:
                continue
            try:
                events = scheduler.step()
            except BaseException as exc:  # every generation in the batch hears of it
                for ticket, _ in live.values():
                    ticket.channel.put(exc if isinstance(exc, Exception) else stopping())
                    ticket._end()
                if not isinstance(exc, Exception):
                    raise
                live.clear()
                scheduler = self._scheduler(live)
                continue
            if scheduler.rows and self.on_pass is not None:
                self.on_pass(scheduler.rows)
            self._send(live, events)

    def _scheduler(self, live: dict[int, tuple[Ticket, Shape]]) -> Scheduler:
        """A fresh scheduler that takes arrivals mid-round too (between the stages of a
        synchronous round's pass: a CPU) and sends the first tokens it makes there at once."""
        assert self.batcher is not None
        scheduler = self.batcher()

        def arrivals() -> None:
            if joining := self._admit(True):
                self._join(scheduler, live, joining)
        scheduler.take_arrivals(arrivals, functools.partial(self._send, live))
        return scheduler

    def _join(self, scheduler: Scheduler, live: dict[int, tuple[Ticket, Shape]],
              joining: list[Ticket]) -> None:
        """Admitted tickets become the scheduler's requests (one that cannot is answered as
        its own request would answer it)."""
        for ticket in joining:
            try:
                assert ticket.join is not None
                request, shape = ticket.join()
            except Exception as exc:
                ticket.channel.put(exc)
                ticket._end()
                continue
            scheduler.add(request)
            live[id(request)] = (ticket, shape)

    def _send(self, live: dict[int, tuple[Ticket, Shape]], events: list[Event]) -> None:
        """Each event's deltas to its ticket's channel; a finished one's END."""
        for event in events:
            ticket, shape = live[id(event.request)]
            for delta in shape(event):
                cut = delta.result is not None and ticket in self.cuts
                ticket.channel.put(stopping() if cut else delta)
            if event.done:
                ticket.channel.put(END)
                ticket._end()
                del live[id(event.request)]
