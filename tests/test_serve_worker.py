"""serve's worker (serve/worker.py): every generation runs on the thread that serves, never on a
request thread, so compiled passes are traced once for all requests and no thread holding
MLX state ends while the interpreter shuts down; shutdown cancels the running generation and
answers the waiting ones 503; Ctrl-C ends `mtpkit serve` with 0, mid-generation or just after
an answer."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import mlx.core as mx

import mtpkit
from fixtures.serving import Script, interruptible, until
from mtpkit.serve.server import Server
from mtpkit.serve.service import Service


@contextmanager
def serving(server: Server) -> Iterator[tuple[str, threading.Thread]]:
    """serve_forever on a thread of the test's own (named "serving"); its /v1 URL."""
    thread = threading.Thread(target=server.serve_forever, name="serving", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", thread
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        assert not thread.is_alive()


def _post(url: str, path: str, body: dict) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", f"/v1{path}", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    return conn


def test_every_generation_runs_on_the_serving_thread(built: Any) -> None:
    """Completions, streamed chat and Anthropic messages, each from its own connection: the
    decoder ran on the thread that called serve_forever for all of them."""
    runner = mtpkit.load(built("llama"), dtype="float32")
    script = Script(runner, ["a ", "b ", "c"])
    ran_on: list[str] = []
    stream = script.stream

    def recorded(ids: list[int], max_tokens: int, **options: Any) -> Any:
        ran_on.append(threading.current_thread().name)
        return stream(ids, max_tokens, **options)

    runner.stream = recorded
    server = Server(Service(runner, "m", 0, 64), "127.0.0.1", 0, None)
    with serving(server) as (url, _):
        answers = [
            _post(url, "/completions", {"prompt": "one", "max_tokens": 8}),
            _post(url, "/chat/completions", {"messages": [{"role": "user", "content": "two"}],
                                             "max_tokens": 8, "stream": True}),
            _post(url, "/messages", {"messages": [{"role": "user", "content": "three"}],
                                     "max_tokens": 8}),
        ]
        responses = [conn.getresponse() for conn in answers]
        bodies = [r.read().decode() for r in responses]
    assert [r.status for r in responses] == [200, 200, 200], bodies
    assert json.loads(bodies[0])["choices"][0]["text"] == "a b c"
    assert "data: [DONE]" in bodies[1]
    assert json.loads(bodies[2])["content"][0]["text"] == "a b c"
    assert ran_on == ["serving"] * 3


def test_compiled_passes_are_traced_once_for_all_requests(built: Any) -> None:
    """MLX keeps compiled functions per thread: two equal requests through the server trace
    the verify pass's shapes once, in the first (a request thread of its own would trace
    them all again)."""
    runner = mtpkit.load(built("mimo"), dtype="float32")
    runner.trunk.use_traced()
    traces: list[int] = []
    forward = runner.trunk.forward

    def counted(tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        traces.append(tokens.shape[1])
        return forward(tokens, cache)

    runner.trunk.forward = counted
    body = {"prompt": [5, 9, 14, 3, 7, 11], "max_tokens": 24, "temperature": 0}
    server = Server(Service(runner, "m", 2, 64), "127.0.0.1", 0, None)
    counts, texts = [], []
    with serving(server) as (url, _):
        for _ in range(2):
            conn = _post(url, "/completions", body)
            texts.append(json.loads(conn.getresponse().read())["choices"][0]["text"])
            counts.append(len(traces))
    assert counts[0] > 0, "the passes were not traced: the test would prove nothing"
    assert counts[1] == counts[0], traces
    assert texts[0] == texts[1]


def test_shutdown_cancels_the_running_and_refuses_the_waiting(built: Any) -> None:
    runner = mtpkit.load(built("llama"), dtype="float32")
    gate = threading.Semaphore(0)
    script = Script(runner, [f"w{i} " for i in range(8)], gate)
    service = Service(runner, "m", 0, 64, max_queue=2)
    server = Server(service, "127.0.0.1", 0, None)
    thread = threading.Thread(target=server.serve_forever, name="serving", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    running = _post(url, "/completions", {"prompt": "running", "max_tokens": 32,
                                          "stream": True})
    until(lambda: len(script.started) == 1, "the generation did not start")
    waiting = _post(url, "/completions", {"prompt": "waiting", "max_tokens": 32})
    until(lambda: service.queue.depth == 1, "the second request did not queue")
    gate.release()  # one piece out
    cut = running.getresponse()
    assert json.loads(cut.fp.readline()[6:])["choices"][0]["text"] == "w0 "
    stopper = threading.Thread(target=server.shutdown)
    stopper.start()
    until(lambda: server.worker.stopped.is_set(), "shutdown did not stop the worker")
    for _ in range(8):  # the generation sees the cancel after its next piece at the latest
        gate.release()
    stopper.join(10)
    thread.join(10)
    assert not stopper.is_alive() and not thread.is_alive()
    server.server_close()
    refused = waiting.getresponse()
    assert refused.status == 503
    assert json.loads(refused.read())["error"]["message"] == "the server is shutting down"
    events = [json.loads(line[6:]) for line in cut.read().decode().splitlines()
              if line.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events[:-1]] in ([], ["w1 "])
    assert events[-1]["error"]["message"] == "the server is shutting down"  # not a finish
    assert script.started == [runner.encode("running")]  # the waiting one never ran
    assert script.stopped == [runner.encode("running")]


def test_a_client_that_resets_its_connection_prints_nothing(built: Any, capfd: Any) -> None:
    """A keep-alive client that resets its connection (RST, not FIN) while the server waits for
    its next request line is not a server error: no traceback on stderr, and the next client is
    answered. A request that does fail in our code still leaves its traceback."""
    runner = mtpkit.load(built("llama"), dtype="float32")
    Script(runner, ["a"])
    server = Server(Service(runner, "m", 0, 64), "127.0.0.1", 0, None)
    with serving(server) as (url, _):
        answered = _post(url, "/completions", {"prompt": "one", "max_tokens": 4})
        assert answered.getresponse().read() and answered.sock is not None
        answered.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        answered.sock.close()  # RST while the server's thread reads the next request line
        raw = socket.create_connection(server.server_address[:2])
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers cut by the reset
        raw.close()
        again = _post(url, "/completions", {"prompt": "two", "max_tokens": 4})
        assert again.getresponse().status == 200
    err = capfd.readouterr().err  # server_close waited for the request threads
    assert "Traceback" not in err and "ConnectionResetError" not in err, err
    try:
        raise ValueError("ours")
    except ValueError:
        server.handle_error(None, ("127.0.0.1", 1))
    assert "ValueError: ours" in capfd.readouterr().err


@contextmanager
def serve_interruptible(bundle: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """`mtpkit serve BUNDLE` as Ctrl-C would reach it from a terminal; its /v1 URL."""
    proc = subprocess.Popen([sys.executable, "-m", "mtpkit.cli", "serve", str(bundle), "--port",
                             "0", "--depth", "2", "--dtype", "float32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=interruptible)
    try:
        assert proc.stderr is not None
        while not (m := re.search(r"on (http://127\.0\.0\.1:\d+/v1)", proc.stderr.readline())):
            assert proc.poll() is None, "serve exited before it listened"
        yield proc, m[1]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def test_ctrl_c_mid_generation_and_after_answers_exits_0(built: Any) -> None:
    bundle = built("mimo")
    with serve_interruptible(bundle) as (proc, url):
        for _ in range(2):
            done = _post(url, "/completions", {"prompt": "hello", "max_tokens": 12})
            assert done.getresponse().status == 200
        proc.send_signal(signal.SIGINT)  # right after an answer
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "terminate called" not in err
    with serve_interruptible(bundle) as (proc, url):
        stream = _post(url, "/completions", {"prompt": "hello", "max_tokens": 4096,
                                             "stream": True})  # no EOS: 11 s on 2 CPU cores
        response = stream.getresponse()
        assert response.status == 200 and response.fp.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGINT)  # mid-generation
        rest = response.read().decode()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "the server is shutting down" in rest  # the stream's last event says why it ended
