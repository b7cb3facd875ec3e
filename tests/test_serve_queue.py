"""serve's queue: one generation at a time in arrival order, a bounded line (503 with
Retry-After beyond it), a client gone while waiting or generating frees its turn at the next
round, and the GET routes answer while a generation runs."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest

import mtpkit
from fixtures.fake_servers import in_thread
from fixtures.serving import Script, until
from mtpkit.serve.server import Server
from mtpkit.serve.service import Service
from mtpkit.serve.worker import Gone, QueueFull
from mtpkit.serve.worker import Worker as FairQueue


def test_tickets_take_turns_in_the_order_they_entered() -> None:
    q = FairQueue(2)
    first = q.enter()
    first.wait()
    second, third = q.enter(), q.enter()
    with pytest.raises(QueueFull) as full:
        q.enter()
    assert full.value.retry_after >= 1 and q.depth == 2
    order: list[str] = []

    def take(ticket: Any, name: str) -> None:
        ticket.wait()
        order.append(name)
        ticket.leave()

    late = threading.Thread(target=take, args=(third, "third"))
    late.start()  # waits first, but entered after `second`
    time.sleep(0.2)
    early = threading.Thread(target=take, args=(second, "second"))
    early.start()
    time.sleep(0.2)
    assert order == []
    first.leave()
    late.join(10)
    early.join(10)
    assert order == ["second", "third"] and q.depth == 0 and q.running is None

    gone = FairQueue(1)
    holder = gone.enter()
    holder.wait()
    waiting = gone.enter()
    with pytest.raises(Gone):
        waiting.wait(lambda: True)
    assert gone.depth == 0, "a client gone while waiting leaves the line"
    holder.leave()
    holder.leave()  # leaving twice is harmless
    lone = FairQueue(0)
    lone.enter().wait()
    with pytest.raises(QueueFull):
        lone.enter()


@pytest.fixture
def gated(built: Any) -> Any:
    """An in-process server (2 may wait) whose scripted model says one piece per permit."""
    runner = mtpkit.load(built("llama"), dtype="float32")
    gate = threading.Semaphore(0)
    script = Script(runner, [f"w{i} " for i in range(8)], gate)
    service = Service(runner, "m", 0, 64, max_queue=2)
    with in_thread(Server(service, "127.0.0.1", 0, None)) as url:
        try:
            yield url, service, script, gate
        finally:  # a generation still running ends at its next piece: let it have one
            for _ in range(64):
                gate.release()


def _send(url: str, path: str, body: dict) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return conn


def _get(url: str, path: str) -> tuple[int, bytes, float]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    start = time.monotonic()
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read(), time.monotonic() - start


def _prompt(name: str) -> dict:
    return {"prompt": name, "max_tokens": 32}


def test_requests_run_in_arrival_order_and_a_full_line_gets_503(gated: Any) -> None:
    url, service, script, gate = gated
    runner = service.runner
    conns = []
    for i, name in enumerate(["first", "second", "third"]):
        conns.append(_send(url, "/v1/completions", _prompt(name)))
        until(lambda i=i: len(script.started) == 1 and service.queue.depth == i,
               f"request {name} was not admitted")
    status, body, took = _get(url, "/v1/completions")
    assert status == 404
    for path in ("/health", "/v1/models", "/metrics"):  # answered beside the generation
        status, body, took = _get(url, path)
        assert status == 200 and took < 2, path
    text = body.decode()
    assert "mtpkit_queue_depth 2.0" in text and "mtpkit_requests_running 1.0" in text
    full = _send(url, "/v1/completions", _prompt("fourth")).getresponse()
    assert full.status == 503 and int(full.getheader("Retry-After")) >= 1
    assert json.loads(full.read())["error"]["code"] == 503
    overloaded = _send(url, "/v1/messages", {"max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}]}).getresponse()
    assert overloaded.status == 503 and json.loads(overloaded.read())["error"]["type"] == \
        "overloaded_error"
    for _ in range(3 * 8):
        gate.release()
    responses = [c.getresponse() for c in conns]
    assert [r.getheader("X-Mtpkit-Arrival") for r in responses] == ["1", "2", "3"]
    answers = [json.loads(r.read()) for r in responses]
    assert [a["choices"][0]["text"] for a in answers] == ["".join(script.pieces)] * 3
    assert script.started == [runner.encode(n) for n in ("first", "second", "third")]
    _counted(url, ['mtpkit_requests_total{api="completions",outcome="ok"} 3.0',
                   'mtpkit_requests_total{api="completions",outcome="rejected"} 1.0',
                   'mtpkit_requests_total{api="messages",outcome="rejected"} 1.0'])


def _counted(url: str, lines: list[str]) -> None:
    """/metrics comes to show every line: a request is counted just after its answer is
    written (whether the client took it decides the outcome)."""
    until(lambda: all(line in _get(url, "/metrics")[1].decode() for line in lines),
           f"/metrics never showed {lines}: {_get(url, '/metrics')[1].decode()}")


def _drop(sock: socket.socket | None) -> None:
    assert sock is not None
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def test_a_client_gone_frees_its_turn_at_the_next_round(gated: Any) -> None:
    url, service, script, gate = gated
    runner = service.runner
    streaming = _send(url, "/v1/completions", _prompt("dropped") | {"stream": True})
    stream_sock = streaming.sock  # the response takes it over
    until(lambda: len(script.started) == 1, "the stream did not start")
    waiting = _send(url, "/v1/completions", _prompt("impatient"))
    until(lambda: service.queue.depth == 1, "the second request did not queue")
    gate.release()
    response = streaming.getresponse()
    assert response.status == 200 and b"w0" in response.fp.readline()
    _drop(waiting.sock)  # gone while waiting: leaves the line
    until(lambda: service.queue.depth == 0, "the impatient client stayed in line", 5)
    after = _send(url, "/v1/completions", _prompt("after"))
    until(lambda: service.queue.depth == 1, "the next request did not queue")
    _drop(stream_sock)
    gate.release()  # one more round: the dropped stream ends there
    until(lambda: len(script.started) == 2, "the server was not freed within one round", 5)
    assert script.started == [runner.encode("dropped"), runner.encode("after")]
    assert script.stopped == [runner.encode("dropped")]
    for _ in range(8):
        gate.release()
    assert json.loads(after.getresponse().read())["usage"]["completion_tokens"] == 8
    # the impatient client and the dropped stream; the request after them was answered
    _counted(url, ['mtpkit_requests_total{api="completions",outcome="cancelled"} 2.0',
                   'mtpkit_requests_total{api="completions",outcome="ok"} 1.0'])


def test_closing_waits_a_bounded_time_for_request_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """server_close (Ctrl-C) waits for request threads still writing their answers; one that
    never ends holds it CLOSE_WAIT_S at most."""
    monkeypatch.setattr(Server, "CLOSE_WAIT_S", 1.5)
    server = Server(SimpleNamespace(queue=FairQueue(0)), "127.0.0.1", 0, None)  # type: ignore[arg-type]
    release = threading.Event()
    ending = threading.Thread(target=time.sleep, args=(0.5,), daemon=True)
    stuck = threading.Thread(target=release.wait, daemon=True)
    for thread in (ending, stuck):
        thread.start()
        server._requests.add(thread)
    start = time.monotonic()
    server.server_close()
    took = time.monotonic() - start
    release.set()
    assert not ending.is_alive()
    assert 1.4 < took < 3.0
