"""Hostile clients of `mtpkit serve` (issue 48): a connection whose descriptor is past 1,023,
a client that half-closes after its request, a generation cut for a client that seemed gone,
clients sharing a server (the prefix cache partitioned per API key and `cache_salt`), billing
at a stop sequence at any depth, request framing built for smuggling, and tool calls a model
wrote as JSON no parser should take. Each is answered for what it is, and /health and the
other clients are answered throughout."""

from __future__ import annotations

import http.client
import io
import itertools
import json
import os
import resource
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest
import test_serve_hostile as hostile

import mtpkit
from fixtures.fake_servers import in_thread
from fixtures.serving import Script, until
from mtpkit.decoder.cache.prefix import PrefixCache
from mtpkit.decoder.runner import Piece, Result, Runner
from mtpkit.serve.server import Handler, Server
from mtpkit.serve.service import Service, tool_calls

PROMPT = [5, 9, 14, 3, 22, 7, 8, 30, 11, 4] * 3
KEYS = ["key-a", "key-b"]


@pytest.fixture(scope="module")
def runner(built: Any) -> Runner:
    return mtpkit.load(built("qwen3_5"))


@contextmanager
def serving(runner: Runner, keys: list[str] | None = None, **service: Any) -> Iterator[str]:
    """Our server over `runner` on loopback; yields its root URL."""
    with in_thread(Server(Service(runner, "m", 0, 64, **service), "127.0.0.1", 0, keys)) as url:
        yield url.removesuffix("/v1")


def call(url: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, Any]:
    """One request on its own connection: (status, the JSON body or the raw text)."""
    return hostile.call(url, method, path, body, headers, timeout=120)


def events(text: str) -> list[Any]:
    """The data of an SSE stream's events ("[DONE]" as a string)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def healthy(url: str, key: str | None = None) -> None:
    headers = {"x-api-key": key} if key else {}
    assert call(url, "/health", None, headers, method="GET") == (200, {"status": "ok"})


def raw_exchange(url: str, request: bytes, half_close: bool = False) -> bytes:
    """`request` sent as is on a fresh connection (its writing side then shut, if asked),
    and everything the server sends until it closes."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=120) as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def post_bytes(path: str, body: Any, headers: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{headers}Connection: close\r\n\r\n").encode() + data


def parsed(raw: bytes) -> tuple[int, bytes]:
    """A raw answer read as a client library reads it (an interim 100 Continue skipped)."""
    sock = _Replay(raw)
    response = http.client.HTTPResponse(sock)  # type: ignore[arg-type]
    response.begin()
    return response.status, response.read()


class _Replay:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def makefile(self, mode: str) -> io.BytesIO:
        return io.BytesIO(self.raw)


ASKS = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 12}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "stream": True}),
        ("/v1/messages", {"max_tokens": 12, "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/messages", {"max_tokens": 12, "stream": True,
                          "messages": [{"role": "user", "content": "hi"}]})]


def answer(path: str, status: int, body: bytes) -> tuple[int, Any]:
    """What a client takes from an answer: the text and how it finished."""
    if not body.startswith(b"{"):  # a stream
        seen = events(body.decode())
        if path == "/v1/messages":
            text = "".join(e["delta"].get("text", "") for e in seen
                           if e["type"] == "content_block_delta")
            end = next(e for e in seen if e["type"] == "message_delta")
            return status, (text, end["delta"]["stop_reason"], end["usage"]["output_tokens"])
        assert seen[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in seen[:-1] if e["choices"])
        finish = [e["choices"][0]["finish_reason"] for e in seen[:-1] if e["choices"]][-1]
        return status, (text, finish, seen[-2]["usage"]["completion_tokens"])
    doc = json.loads(body)
    if path == "/v1/messages":
        return status, ("".join(b.get("text", "") for b in doc["content"]), doc["stop_reason"],
                        doc["usage"]["output_tokens"])
    return status, (doc["choices"][0]["text"], doc["choices"][0]["finish_reason"],
                    doc["usage"]["completion_tokens"])


def whole(url: str, path: str, body: Any) -> tuple[int, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return answer(path, response.status, data)


# -- item 1: liveness past 1,023 descriptors, a half-close, a cut never a stop -----------------


def test_a_connection_past_descriptor_1023_gets_its_whole_answer(runner: Runner) -> None:
    """select() refuses descriptors past 1,023: the liveness check read that as a client gone,
    so every answer was cut after its first round and sent as a 200 with finish "stop"."""
    with serving(runner) as url:
        want = {path: whole(url, path, body) for path, body in ASKS}
        assert all(a[1][2] == 12 and a[1][1] in ("length", "max_tokens")
                   for a in want.values()), want
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 1400:
            if hard != resource.RLIM_INFINITY and hard < 1400:
                pytest.skip(f"this machine caps open descriptors at {hard}, below the 1,100 the test needs")
            resource.setrlimit(resource.RLIMIT_NOFILE, (1400, hard))
        read, write = os.pipe()
        held = [read, write]
        try:
            while held[-1] < 1100:  # every lower descriptor is taken: the next ones are past
                held.append(os.dup(read))
            for path, body in ASKS:
                assert whole(url, path, body) == want[path], path
            healthy(url)
        finally:
            for fd in held:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_client_that_half_closes_after_its_request_is_answered(runner: Runner,
                                                                 batch: int) -> None:
    """A client may shut its writing side once the request is sent (shutdown(SHUT_WR)): the
    server sees EOF, but the client still reads. It was taken for gone and got one round."""
    with serving(runner, max_batch=batch) as url:
        for path, body in ASKS:
            want = whole(url, path, body)
            raw = raw_exchange(url, post_bytes(path, body), half_close=True)
            assert answer(path, *parsed(raw)) == want, path
        healthy(url)


def test_a_client_gone_still_frees_the_server(runner: Runner) -> None:
    """A client that closes its socket mid-generation (a FIN, as a half-close sends) is told
    apart by the reset its socket answers the server's ask with: the generation ends."""
    with serving(runner) as url:
        parts = urlsplit(url)
        for path, body in ASKS:
            sock = socket.create_connection((parts.hostname, parts.port))
            sock.sendall(post_bytes(path, body | {"max_tokens": 64}))
            sock.close()

        def cancelled() -> float:
            text = call(url, "/metrics", method="GET")[1]
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("mtpkit_requests_total") and "cancelled" in line)

        until(lambda: cancelled() == len(ASKS), "the closed clients' generations ran on", 60)
        healthy(url)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_cut_generation_is_never_sent_as_a_finished_one(runner: Runner, batch: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever made the server think the client was gone, the generation it cut is not
    answered as one the model finished (a 200 with finish "stop" and a truncated text)."""
    with serving(runner, max_batch=batch) as url:
        want = whole(url, *ASKS[0])
        asked = itertools.count()
        monkeypatch.setattr(Handler, "_gone", lambda self: next(asked) >= 3)
        for path, body in ASKS:
            asked = itertools.count()
            if not body.get("stream"):
                with pytest.raises(http.client.RemoteDisconnected):
                    whole(url, path, body)
                continue
            raw = raw_exchange(url, post_bytes(path, body))
            seen = events(raw.decode())
            assert "[DONE]" not in seen and not any(
                e.get("type") in ("message_delta", "message_stop") or
                any(c.get("finish_reason") for c in e.get("choices", [])) for e in seen), seen
        monkeypatch.undo()
        assert whole(url, *ASKS[0]) == want
        healthy(url)


# -- item 2: the prefix cache partitioned per API key and cache_salt ------------------------


def test_clients_with_other_keys_or_salts_share_no_cached_prefix(runner: Runner) -> None:
    """Client B, knowing only A's preamble, read how much of its prompt was cached (and the
    first token's time) to recover A's prompt: each key and each salt is a partition now."""
    with serving(runner, KEYS, cache_bytes=1 << 28) as url:
        def cached(key: str, prompt: list[int], salt: str | None = None) -> int:
            body = {"prompt": prompt, "max_tokens": 2} | ({"cache_salt": salt} if salt else {})
            status, doc = call(url, "/v1/completions", body, {"Authorization": f"Bearer {key}"})
            assert status == 200, doc
            return doc["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("key-a", PROMPT) == 0
        assert cached("key-a", PROMPT + [3, 3]) == len(PROMPT), "A reuses its own prefix"
        assert cached("key-b", PROMPT + [3, 3]) == 0, "B sees nothing of A's"
        assert cached("key-b", PROMPT + [3, 3, 4]) == len(PROMPT) + 2, "B reuses its own"
        assert cached("key-a", PROMPT + [3, 3, 5], "s1") == 0, "a salt is a partition"
        assert cached("key-a", PROMPT + [3, 3, 5, 6], "s1") == len(PROMPT) + 3
        assert cached("key-a", PROMPT + [3, 3, 5, 6, 7], "s2") == 0
        assert call(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2},
                    {"Authorization": "Bearer key-c"})[0] == 401

        def read(key: str) -> int:
            status, doc = call(url, "/v1/messages", {
                "max_tokens": 2, "messages": [{"role": "user", "content": "the preamble"}]},
                {"x-api-key": key})
            assert status == 200, doc
            return doc["usage"]["cache_read_input_tokens"]

        assert read("key-a") == 0 and read("key-a") > 0
        assert read("key-b") == 0
        healthy(url, "key-b")


def test_partitions_of_one_cache_share_its_bound_and_counters(runner: Runner) -> None:
    cache = PrefixCache(1 << 28)
    a, b = cache.partition(("key 0", None)), cache.partition(("key 1", None))
    runner.generate(PROMPT, 2, depth=0, prefix=a)
    assert runner.generate(PROMPT + [3], 2, depth=0, prefix=b).cached_tokens == 0
    assert runner.generate(PROMPT + [3], 2, depth=0, prefix=a).cached_tokens == len(PROMPT)
    assert runner.generate(PROMPT + [3], 2, depth=0, prefix=cache).cached_tokens == 0
    assert (cache.hits, cache.misses, len(cache)) == (1, 3, len(a))
    assert cache.nbytes == a.nbytes == b.nbytes > 0


@pytest.mark.parametrize("salt", [5, "", "x" * 257, ["s"]])
def test_a_bad_cache_salt_is_the_same_400_on_both_apis(runner: Runner, salt: Any) -> None:
    with serving(runner) as url:
        status, doc = call(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt})
        assert status == 400 and doc["error"]["param"] == "cache_salt"
        assert doc["error"]["message"].startswith("request.cache_salt: cache_salt must be")
        status, doc = call(url, "/v1/messages", {
            "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt})
        assert status == 400 and doc["error"]["type"] == "invalid_request_error"
        assert doc["error"]["message"].startswith("cache_salt: request.cache_salt: ")
        assert call(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                              "cache_salt": "fine"})[0] == 200


# -- item 4: billing at a stop sequence, max_tokens null, framing -----------------------------


def _stop_mid_round(runner: Runner) -> tuple[str, int]:
    """A stop sequence that a token in the middle of a depth-4 round completes (context
    drafts kept there), and how many tokens it takes."""
    tokens: list[int] = []
    for piece in runner.stream(PROMPT, 40, depth=4, draft="lookup"):
        if len(piece.tokens) > 1 and len(tokens) >= 4:
            upto = runner.tokenizer.decode(tokens + piece.tokens[:1])
            for n in range(1, len(upto)):
                stop = upto[-n:]
                if upto.find(stop) == len(upto) - n and stop.strip():
                    return stop, len(tokens) + 1
        tokens += piece.tokens
    raise AssertionError("no depth-4 round kept a draft")


def test_a_stop_sequence_bills_the_same_tokens_at_every_depth(runner: Runner) -> None:
    """The round that completes a stop sequence commits the drafts kept past it: they were
    billed, so the same text cost more at depth 4 than plain."""
    stop, billed = _stop_mid_round(runner)
    with serving(runner) as url:
        seen = {}
        for depth, draft in ((0, None), (4, "lookup"), ("auto", None), ("auto", "lookup")):
            body = {"prompt": PROMPT, "max_tokens": 40, "stop": stop, "mtp_depth": depth} | (
                {"mtp_draft": draft} if draft else {})
            for stream in (False, True):
                seen[depth, draft, stream] = whole(url, "/v1/completions", body | {"stream": stream})
            usage = call(url, "/v1/completions", body)[1]["usage"]
            assert usage["total_tokens"] == usage["prompt_tokens"] + billed
        plain = seen[0, None, False]
        assert plain[1][1:] == ("stop", billed) and not plain[1][0].endswith(stop)
        assert set(seen.values()) == {plain}, seen
        healthy(url)


def _rounds(runner: Runner, text: str, size: int, stats: Any) -> None:
    """The runner says `text` in rounds of `size` real tokens (as a round keeps size - 1
    drafts), ending where the service's stop() says so; `stats`: a real run's."""
    tokenizer = runner.tokenizer
    ids = list(tokenizer.encode(text, add_special_tokens=False))

    def stream(prompt: list[int], max_tokens: int, **options: Any) -> Iterator[Piece]:
        said: list[int] = []
        for at in range(0, len(ids), size):
            before = tokenizer.decode(said)
            said += ids[at:at + size]
            yield Piece(tokenizer.decode(said)[len(before):], ids[at:at + size])
            if options["stop"]():
                break
        yield Piece("", [], Result(said, tokenizer.decode(said), stats, "stop"))

    runner.stream = stream  # type: ignore[method-assign]


def test_stop_sequence_billing_does_not_depend_on_round_sizes(built: Any) -> None:
    scripted = mtpkit.load(built("qwen3_5"))
    text = "Hello world, and STOP here and more never ends"
    ids = scripted.tokenizer.encode(text, add_special_tokens=False)
    billed = next(n for n in range(len(ids) + 1) if "STOP" in scripted.tokenizer.decode(ids[:n]))
    assert billed < len(ids) - 3
    ask = {"max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
           "stop_sequences": ["STOP"], "thinking": {"type": "disabled"}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "stop": "STOP",
            "chat_template_kwargs": {"enable_thinking": False}}
    stats = scripted.generate([1, 2, 3], 2, depth=0).stats
    with serving(scripted) as url:
        for size in (1, 3, 5, 8):
            _rounds(scripted, text, size, stats)
            for stream in (False, True):
                status, said = whole(url, "/v1/messages", ask | {"stream": stream})
                assert (status, said) == (200, ("Hello world, and ", "stop_sequence", billed))
                status, doc = call(url, "/v1/chat/completions", chat | {"stream": stream})
                if stream:
                    doc = events(doc)[-2]
                    assert doc["usage"]["completion_tokens"] == billed
                else:
                    assert doc["choices"][0] == {"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": "Hello world, and "}}
                    assert doc["usage"]["completion_tokens"] == billed


def test_anthropic_max_tokens_null_is_refused_as_any_bad_max_tokens(runner: Runner) -> None:
    with serving(runner) as url:
        base = {"messages": [{"role": "user", "content": "hi"}]}
        zero = call(url, "/v1/messages", base | {"max_tokens": 0})
        null = call(url, "/v1/messages", base | {"max_tokens": None})
        assert zero[0] == null[0] == 400 and zero[1] == null[1]
        assert null[1]["error"] == {"type": "invalid_request_error",
                                    "message": "max_tokens must be an integer in [1, 64]"}
        healthy(url)


def test_a_body_framed_two_ways_is_refused_and_the_connection_closed(runner: Runner) -> None:
    """Content-Length with Transfer-Encoding: chunked (or two lengths) is how a request is
    smuggled past a proxy that reads the other framing: refused, and nothing after it is
    read as a request."""
    with serving(runner) as url:
        smuggled = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
        for framing in (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
                        b"Content-Length: 5\r\nContent-Length: 7\r\n"):
            raw = raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n" +
                               framing + b"\r\n0\r\n\r\n" + smuggled)
            assert raw.count(b"HTTP/1.1 ") == 1, raw
            status, body = parsed(raw)
            assert status == 400 and b"Connection: close" in raw
            assert json.loads(body)["error"]["message"].startswith("request.framing: ")
        for length in (b"+5", b"5_0", b" -1"):
            raw = raw_exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                               b"Content-Length: " + length + b"\r\n\r\n{}" + smuggled)
            assert raw.count(b"HTTP/1.1 ") == 1 and parsed(raw)[0] == 411, raw
        healthy(url)


# -- item 5: tool calls parsed strictly ---------------------------------------------------------


HOSTILE_CALLS = {
    "nan": '{"name": "f", "arguments": {"x": NaN}}',
    "infinity": '{"name": "f", "arguments": {"x": -Infinity}}',
    "overflow": '{"name": "f", "arguments": {"x": 1e999}}',
    "deep": '{"name": "f", "arguments": ' + "[" * 1100 + "]" * 1100 + "}",
    "huge": '{"name": "f", "arguments": {"x": 1' + "0" * 4400 + "}}",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_CALLS))
def test_a_tool_call_no_strict_parser_takes_stays_text(case: str) -> None:
    block = f"<tool_call>{HOSTILE_CALLS[case]}</tool_call>"
    assert tool_calls("Let me check." + block) == ("Let me check." + block, [])


def test_hostile_tool_calls_come_back_as_text_on_both_apis(built: Any) -> None:
    """A NaN went out as `input` / `arguments` (not JSON); deep nesting and a huge integer
    raised after the whole generation (a 500)."""
    scripted = mtpkit.load(built("qwen3_5"))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = {"messages": [{"role": "user", "content": "go"}], "tools": tools,
            "chat_template_kwargs": {"enable_thinking": False}}
    ask = {"max_tokens": 64, "messages": [{"role": "user", "content": "go"}],
           "thinking": {"type": "disabled"}, "tools": [{"name": "f", "input_schema": {}}]}
    with serving(scripted) as url:
        for case, call_json in sorted(HOSTILE_CALLS.items()):
            said = "Let me check.<tool_call>" + call_json + "</tool_call>"
            Script(scripted, [said[:40], said[40:]])
            status, doc = call(url, "/v1/chat/completions", chat)
            assert status == 200, (case, doc)
            assert doc["choices"][0]["finish_reason"] == "stop", case
            assert doc["choices"][0]["message"] == {"role": "assistant", "content": said}
            status, text = call(url, "/v1/chat/completions", chat | {"stream": True})
            streamed = events(text)
            assert status == 200 and streamed[-1] == "[DONE]", (case, text[-300:])
            assert "".join(e["choices"][0]["delta"].get("content", "") for e in streamed[:-1]
                           if e["choices"]) == said
            assert not any(e["choices"][0]["delta"].get("tool_calls") for e in streamed[:-1]
                           if e["choices"])
            status, doc = call(url, "/v1/messages", ask)
            assert status == 200, (case, doc)
            assert doc["content"] == [{"type": "text", "text": said}]
            assert doc["stop_reason"] == "end_turn"
            assert whole(url, "/v1/messages", ask | {"stream": True})[1][:2] == (said, "end_turn")
        healthy(url)
