"""One owner for turns at the decoder: requests wait in a bounded first-in first-out line, and
every generation a server runs happens on one thread, the one that called serve_forever.

One at a time, because one generation uses the whole machine and MLX state is not shared across
threads; in arrival order, because threads woken from a lock come in any order (and a full line
is refused at once, so the client hears 503 with Retry-After instead of waiting without a word).
On one thread, because MLX keeps compiled functions per thread (a request thread of its own
traced every verify shape again), and a thread that used them frees them as it ends: one ending
while the interpreter shut down (Ctrl-C right after an answer) aborted the process under Python
3.13 and older ("terminate called without an active exception").
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

from mtpkit.serve.protocol import RequestError

if TYPE_CHECKING:
    from mtpkit.serve.service import Delta

POLL_S = 0.1  # how often a waiting request looks at its client
END = object()  # on a ticket's channel: the generation is over, its last delta was sent


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Gone(Exception):
    """The client went away while its request waited."""


def stopping() -> RequestError:
    return RequestError(503, "the server is shutting down", kind="server_error")


class Ticket:
    """One admitted request: its place in the line, its arrival `number` (1 = the first the
    worker admitted) and its generation, `deltas`, which the service attaches. Iterate it for the
    deltas: once submitted, the serving thread makes them; otherwise the iterating thread waits
    for its turn and makes them itself (the Python API, verify-run). `cancelled`: its client went
    away (seen while it waited or between rounds), or the server is stopping."""

    def __init__(self, worker: Worker, number: int, gone: Callable[[], bool] | None) -> None:
        self.worker, self.number, self._gone = worker, number, gone
        self.deltas: Iterator[Delta] = iter(())
        self.submitted = False
        self.channel: queue.SimpleQueue[object] = queue.SimpleQueue()  # serving thread -> request
        self.started: float | None = None  # when its turn came
        self.cancelled = False
        self.finished = False  # its request read the end of the channel

    def gone(self) -> bool:
        if not self.cancelled and self._gone is not None:
            self.cancelled = self._gone()
        return self.cancelled

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
                return next(self.deltas)
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
            return cast("Delta", item)

    def _end(self) -> None:
        getattr(self.deltas, "close", lambda: None)()
        self.leave()


class Worker:
    """The line and the serving thread. enter() admits a request and hands out its Ticket
    (QueueFull when max_waiting already wait behind the running one; 0: none); run() makes the
    generations of submitted tickets in arrival order on the thread that calls it, until stop().
    A place is given back only in release()."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.cond = threading.Condition()  # reentrant: release() may be called holding it
        self.waiting: deque[Ticket] = deque()
        self.running: Ticket | None = None
        self.recent_s = 1.0  # a moving mean of turn lengths, for Retry-After
        self.admitted = 0  # tickets handed out: each request's arrival number
        self.cut: Ticket | None = None  # the generation stop() cancelled
        self.stopped = threading.Event()

    @property
    def depth(self) -> int:
        return len(self.waiting)

    def enter(self, gone: Callable[[], bool] | None = None) -> Ticket:
        """A place at the end of the line. gone(): its client went away (asked while it waits
        and, by its generation, after each round)."""
        with self.cond:
            busy = self.running is not None or self.waiting
            if busy and len(self.waiting) >= self.max_waiting:
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
                if self.running is None and self.waiting and self.waiting[0] is ticket:
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
            if self.running is ticket:
                assert ticket.started is not None
                self.running = None
                self.recent_s = 0.8 * self.recent_s + 0.2 * (time.monotonic() - ticket.started)
            elif ticket in self.waiting:
                self.waiting.remove(ticket)
            self.cond.notify_all()

    def run(self) -> None:
        """Make submitted generations in arrival order until stop(); tickets still waiting then
        are answered 503."""
        try:
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
