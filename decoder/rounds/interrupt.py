"""The first Ctrl-C asks a running decode to stop between rounds instead of interrupting it in
the middle of one: what was generated is kept, and a sharded world's ranks stay in step (a pass
cut after its message went out left the followers in collectives rank 0 never joined, and every
rank reported a lost peer). A second Ctrl-C interrupts as usual."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def first_ctrl_c(stop: Callable[[], None]) -> Iterator[None]:
    """Inside: the first Ctrl-C calls stop() and puts the handler before it back. Only the main
    thread can take signals, and an ignored SIGINT stays ignored: there, nothing changes."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return

    def first(_signum: int, _frame: object) -> None:
        signal.signal(signal.SIGINT, previous)
        stop()

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
