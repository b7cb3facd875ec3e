"""Requests take turns at the decoder first-in first-out, under a bound on how many may wait.

MLX state is not shared across threads and one generation uses the whole machine, so one runs at
a time. A lock would not do: threads woken from a lock come in any order, and a client would wait
without a word. Here each request holds a Ticket from admission (a full line is refused at once,
so the HTTP layer can answer 503 with Retry-After) to the end of its generation; a ticket whose
client went away while waiting leaves the line.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

POLL_S = 0.1  # how often a waiting request looks at its client


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Gone(Exception):
    """The client went away while its request waited."""


class FairQueue:
    """max_waiting: requests that may wait behind the one running (0: none)."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.cond = threading.Condition()
        self.waiting: deque[Ticket] = deque()
        self.running: Ticket | None = None
        self.recent_s = 1.0  # a moving mean of turn lengths, for Retry-After
        self.admitted = 0  # tickets handed out: each request's arrival number

    def enter(self) -> Ticket:
        with self.cond:
            busy = self.running is not None or self.waiting
            if busy and len(self.waiting) >= self.max_waiting:
                ahead = len(self.waiting) + 1
                raise QueueFull(max(1, min(600, math.ceil(ahead * self.recent_s))))
            self.admitted += 1
            ticket = Ticket(self, self.admitted)
            self.waiting.append(ticket)
            return ticket

    @property
    def depth(self) -> int:
        return len(self.waiting)


class Ticket:
    """One request's place: wait() until its turn, leave() when done (or given up).
    `number`: its arrival order (1 = the first request the server admitted)."""

    def __init__(self, queue: FairQueue, number: int) -> None:
        self.queue, self.number = queue, number
        self.started: float | None = None

    def wait(self, gone: Callable[[], bool] | None = None) -> None:
        q = self.queue
        with q.cond:
            while q.running is not None or q.waiting[0] is not self:
                if gone is not None and gone():
                    self._leave()
                    raise Gone()
                q.cond.wait(POLL_S)
            q.waiting.popleft()
            q.running, self.started = self, time.monotonic()

    def leave(self) -> None:
        with self.queue.cond:
            self._leave()

    def _leave(self) -> None:
        q = self.queue
        if q.running is self:
            q.running = None
            assert self.started is not None
            q.recent_s = 0.8 * q.recent_s + 0.2 * (time.monotonic() - self.started)
        elif self in q.waiting:
            q.waiting.remove(self)
        q.cond.notify_all()
