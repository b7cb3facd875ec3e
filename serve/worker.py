"""Every generation a server runs happens on one thread: the one that called
Server.serve_forever (the main thread under `mtpkit serve`). Request threads parse, admit and
write; they read their generation's deltas from a Handoff.

Why one thread: MLX keeps compiled functions per thread, so a generation on a fresh request
thread traced every verify shape again; and a thread that used them frees them as it ends,
taking the GIL. One ending while the interpreter shut down (Ctrl-C right after an answer) was
ended by Python (3.13 and older) with pthread_exit, from inside that C++ destructor, and the
process aborted ("terminate called without an active exception").
"""

from __future__ import annotations

import queue
import threading

from mtpkit.serve.protocol import RequestError
from mtpkit.serve.queue import POLL_S, FairQueue, Gone
from mtpkit.serve.service import Delta, Job

END = object()  # the generation is over: its last delta was sent


def stopping() -> RequestError:
    return RequestError(503, "the server is shutting down", kind="server_error")


class Handoff:
    """A Job seen from its request thread: iterate for the deltas the worker makes. close()
    gives up a turn not yet started, or cancels a running generation (it ends at the next
    round). Once the worker took it (it left `Worker.handed`), only the worker ends it."""

    def __init__(self, job: Job, worker: Worker) -> None:
        self.job, self.ticket, self.worker = job, job.ticket, worker
        self.channel: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.finished = False

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled

    def __iter__(self) -> Handoff:
        return self

    def __next__(self) -> Delta:
        while True:
            try:
                item = self.channel.get(timeout=POLL_S)
            except queue.Empty:
                if self.job.gone() and self.worker.withdraw(self):
                    raise Gone() from None  # gone while waiting: it left the line
                continue
            if item is END:
                self.finished = True
                raise StopIteration
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            assert isinstance(item, Delta)
            return item

    def close(self) -> None:
        if not self.worker.withdraw(self) and not self.finished:
            self.job.cancelled = True  # its request ended first: stop at the next round


class Worker:
    """Runs admitted generations in arrival order (the FairQueue's) on the thread that calls
    run(), until stop(); turns still waiting then are answered 503."""

    def __init__(self, fair: FairQueue) -> None:
        self.fair = fair
        self.handed: dict[int, Handoff] = {}  # by ticket number: admitted, not yet started
        self.running: Handoff | None = None
        self.cut: Handoff | None = None  # the generation stop() cancelled
        self.stopped = threading.Event()

    def submit(self, job: Job) -> Handoff:
        handoff = Handoff(job, self)
        with self.fair.cond:
            if self.stopped.is_set():
                job.close()
                raise stopping()
            self.handed[job.ticket.number] = handoff
            self.fair.cond.notify_all()
        return handoff

    def withdraw(self, handoff: Handoff) -> bool:
        """Take a turn that has not started out of the line; False if the worker has it."""
        with self.fair.cond:
            if self.handed.pop(handoff.ticket.number, None) is None:
                return False
            handoff.job.close()
            return True

    def run(self) -> None:
        try:
            while (handoff := self._next()) is not None:
                self._generate(handoff)
        finally:
            with self.fair.cond:
                self.stopped.set()  # submit() takes no more
                waiting = list(self.handed.values())
            for handoff in waiting:
                if self.withdraw(handoff):
                    handoff.channel.put(stopping())

    def stop(self) -> None:
        """run() returns after the running generation, which is cancelled: it ends at its
        next round (a sharded world's ranks stay in step), and its client is told 503 instead
        of a finish that would pass for the model's."""
        with self.fair.cond:
            self.stopped.set()
            if self.running is not None:
                self.running.job.cancelled = True
                self.cut = self.running
            self.fair.cond.notify_all()

    def _next(self) -> Handoff | None:
        fair = self.fair
        with fair.cond:
            while not self.stopped.is_set():
                head = fair.waiting[0].number if fair.waiting and fair.running is None else None
                if head in self.handed:
                    self.running = self.handed.pop(head)
                    return self.running
                fair.cond.wait(POLL_S)
        return None

    def _generate(self, handoff: Handoff) -> None:
        try:
            for delta in handoff.job:
                cut = delta.result is not None and self.cut is handoff
                handoff.channel.put(stopping() if cut else delta)
            handoff.channel.put(END)
        except Exception as exc:  # the request thread answers it as it would its own
            handoff.channel.put(exc)
        except BaseException:  # a second Ctrl-C: its client is told, then the server stops
            handoff.channel.put(stopping())
            raise
        finally:
            handoff.job.close()
            with self.fair.cond:
                self.running = None
