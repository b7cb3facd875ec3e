"""The peer watch: a rank whose peer closes its connection exits PEER_LOST with one line, even
while its main thread waits forever (as MLX's ring backend does once a socket thread quit);
data from a live peer is not a closure, and a disarmed watch lets the world end quietly."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time

import pytest

from mtpkit.decoder.sharded import peerwatch
from mtpkit.decoder.sharded.peerwatch import PEER_LOST

# A rank stand-in: connects to argv[1], watches that link, then waits forever in C (GIL
# released, like mx.eval) -- or, given a line on stdin, disarms and ends by itself.
RANK = """import socket, sys, threading, time
from mtpkit.decoder.sharded import peerwatch
before = peerwatch.socket_fds()
link = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
peerwatch.watch(peerwatch.connections(peerwatch.socket_fds() - before))
print("watching", flush=True)
if sys.argv[2] == "disarm":
    sys.stdin.readline()
    peerwatch.disarm()
    print("disarmed", flush=True)
    time.sleep(2 * peerwatch.GRACE_S + 1)
    sys.exit(0)
threading.Event().wait()
"""


@pytest.fixture
def listener() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def _rank(listener: socket.socket, mode: str) -> tuple[subprocess.Popen, socket.socket]:
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(listener.getsockname()[1]), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    conn, _ = listener.accept()
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and proc.stdout.readline() == "watching\n", proc.stderr.read()
    return proc, conn


def test_a_closed_peer_ends_a_hung_rank(listener: socket.socket) -> None:
    proc, conn = _rank(listener, "hang")
    try:
        conn.sendall(b"x" * 64)  # a live peer's data, unread: not a closure
        time.sleep(peerwatch.POLL_S * 4)
        assert proc.poll() is None
        conn.close()
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == PEER_LOST, err
    assert time.monotonic() - start < peerwatch.GRACE_S + 5
    assert err.startswith("error [distributed.peer_lost]: the rank at 127.0.0.1:")
    assert "closed its connection" in err and "hint:" in err and "Traceback" not in err
    assert err.count("error [") == 1


def test_a_disarmed_watch_lets_the_world_end(listener: socket.socket) -> None:
    proc, conn = _rank(listener, "disarm")
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("end\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "disarmed\n"
        conn.close()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert "peer_lost" not in err


@pytest.mark.parametrize("rdhup", [peerwatch.RDHUP, 0], ids=["poll", "peek"])
def test_only_connected_tcp_sockets_are_links(rdhup: int, listener: socket.socket,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peerwatch, "RDHUP", rdhup)  # 0: how macOS (no POLLRDHUP) sees it
    before = peerwatch.socket_fds()
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    pair = socket.socketpair()  # a local (AF_UNIX) pair: not a link to a peer
    idle = socket.create_server(("127.0.0.1", 0))  # listening: no peer
    try:
        links = peerwatch.connections(peerwatch.socket_fds() - before)
        ends = sorted(s.getsockname() for s in links)
        assert ends == sorted([client.getsockname(), server_side.getsockname()])
        assert not any(peerwatch.closed(s) for s in links)
        client.shutdown(socket.SHUT_WR)  # a close, though our copies hold it open
        time.sleep(0.1)
        assert [peerwatch.closed(s) for s in links] == [
            s.getsockname() == server_side.getsockname() for s in links]
        for s in links:
            s.close()
    finally:
        for s in (client, server_side, *pair, idle):
            s.close()
