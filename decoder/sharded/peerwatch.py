"""Ends a sharded rank whose peer is gone, even while MLX waits on that peer forever.

MLX's ring backend fails the collective that first meets a closed connection, but a pass queues
many collectives: the rest go to socket threads that have already quit, and the process waits on
them forever (a killed rank 0 left its follower hanging). So, beside every world, a daemon thread
peeks at the world's own sockets a few times a second; when one reports its peer closed, the
rank prints one line and exits PEER_LOST. MLX releases the GIL while it waits, so the thread
runs. Closing is how a rank normally ends too: once a rank knows the world is ending (rank 0
sent, a follower read, the last message) it disarms the watch, and a closed peer is checked
again after a grace period, to let a last message that just arrived disarm it first.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import sys
import threading
import time

PEER_LOST = 3  # exit code of a rank whose world lost a member (killed: one that never joined)
POLL_S = 0.25
GRACE_S = 2.0
RDHUP = getattr(select, "POLLRDHUP", 0)  # Linux: the peer's close, even with data unread
HINT = "another rank exited or its machine is unreachable; its own output says why"

_armed = threading.Event()
_reported = threading.Lock()  # whoever takes it first (a thread, or the watch) says it once


def socket_fds() -> set[int]:
    """This process's open socket descriptors (/dev/fd lists them on Linux and macOS)."""
    fds = set()
    for name in os.listdir("/dev/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                fds.add(int(name))
        except OSError:  # the descriptor listdir itself used, already closed
            continue
    return fds


def connections(fds: set[int]) -> list[socket.socket]:
    """Copies of the connected TCP sockets among `fds` (a world's links to its peers)."""
    links = []
    for fd in sorted(fds):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and \
                    sock.type == socket.SOCK_STREAM and sock.getpeername():
                links.append(sock)
                continue
        except OSError:  # not connected: a listening socket
            pass
        sock.close()
    return links


def closed(sock: socket.socket) -> bool:
    """Whether the peer closed `sock`; the data stays for MLX to read. Without POLLRDHUP
    (macOS) a close shows once the data before it was read: MLX reads it (a rank waits)."""
    if RDHUP:
        poll = select.poll()
        poll.register(sock, RDHUP)  # POLLHUP and POLLERR come unasked
        return bool(poll.poll(0))
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset by the peer
        return True


def report(detail: str) -> bool:
    """Print the peer-lost line, once per process: False if it was already printed."""
    if not _reported.acquire(blocking=False):
        return False
    os.write(sys.stderr.fileno(), f"error [distributed.peer_lost]: {detail}\n  hint: {HINT}\n"
             .encode())
    return True


def watch(links: list[socket.socket]) -> None:
    """Start the watch over `links` (armed) in a daemon thread; none without links (a backend
    that does not talk over TCP)."""
    if not links:
        return
    _armed.set()
    threading.Thread(target=_run, args=(links,), name="mtpkit-peerwatch", daemon=True).start()


def disarm() -> None:
    """The world is ending by design: a peer that closes now is not lost."""
    _armed.clear()


def _run(links: list[socket.socket]) -> None:
    while _armed.is_set():
        gone = [s for s in links if closed(s)]
        if gone:
            time.sleep(GRACE_S)
            if not _armed.is_set():
                return
            if not report(f"the rank at {_peer(gone[0])} closed its connection"):
                time.sleep(GRACE_S)  # a thread said it and is exiting: unless it hangs there
            os._exit(PEER_LOST)
        time.sleep(POLL_S)


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "an unknown address"
    return f"{host}:{port}"
