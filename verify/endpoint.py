"""An OpenAI-compatible endpoint as verify-run sees it: plain HTTP (the standard library's
http.client), SSE read line by line with a stall timeout. Everything it returns is untrusted:
each request is read under bounds (text chunks, bytes, wall seconds: `Bounds`), and every
document is checked against the shapes verify-run reads (schemas/verify_run_endpoint.schema.json)
before a field is used, so a lying endpoint is a failed check, never a traceback or an
unbounded read. Where the endpoint has them, Anthropic's Messages API too, and the serving
checks beyond one request: the prefix cache over a second turn, and the Messages API against
the chat API (`serving_checks`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any
from urllib.parse import urlsplit

import jsonschema

from mtpkit.schemas import load_schema
from mtpkit.verify.answer import Answer, Chunk
from mtpkit.verify.checks import FAIL, INFO, Check, anthropic_check, prefix_cache_check
from mtpkit.verify.loads import real_loads

STALL_S = 60.0
MAX_LINE = 1 << 20
# A request's bounds, from the tokens it asks for: a token's SSE chunk is a few hundred bytes of
# JSON, so 4 KiB a token (and 64 KiB for usage and telemetry) only stops a liar; a second a
# token is slower than any model worth verifying decodes, after --timeout for the prefill.
BYTES_PER_TOKEN, BASE_BYTES = 4096, 64 << 10
SECONDS_PER_TOKEN = 1.0
LISTING_TOKENS = 16  # the bounds of GET /models: those of a 16-token answer


class EndpointError(Exception):
    """The endpoint failed in a way verify-run reports as evidence (one line)."""

    def __init__(self, message: str, unreachable: bool = False, status: int | None = None,
                 evidence: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.unreachable, self.status = unreachable, status
        self.evidence = evidence or {}


@dataclass(frozen=True)
class Bounds:
    """What one request may take before verify-run stops reading it: text chunks (each carries
    at least one token, so more than max_tokens of them is a lie), bytes and wall seconds. An
    endpoint streaming valid chunks forever is stopped here, not by the stall timeout (which
    only measures silence)."""

    max_tokens: int
    bytes: int
    seconds: float

    @classmethod
    def of(cls, max_tokens: int, stall_s: float, request_s: float | None = None) -> Bounds:
        """Bounds derived from max_tokens (request_s, when given, is the wall bound)."""
        seconds = request_s if request_s is not None else stall_s + max_tokens * SECONDS_PER_TOKEN
        return cls(max_tokens, BASE_BYTES + max_tokens * BYTES_PER_TOKEN, seconds)


class _Reader:
    """One response read under its Bounds; the first bound crossed is an EndpointError that
    says which bound, its limit, and how far the answer had got."""

    def __init__(self, bounds: Bounds, start: float) -> None:
        self.bounds, self.start = bounds, start
        self.sock: socket.socket | None = None  # once connected (a closing response keeps it)
        self.response: http.client.HTTPResponse | None = None  # once the headers came
        self.bytes = self.text_chunks = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _stop(self, bound: str, limit: str) -> EndpointError:
        b = self.bounds
        reached = {"tokens": f"{self.text_chunks} text chunks",
                   "bytes": f"{self.bytes:,} bytes", "seconds": f"{self.elapsed():.1f} s"}
        return EndpointError(
            f"stopped reading: the answer went past its {bound} bound ({limit} for max_tokens "
            f"{b.max_tokens}) at {reached[bound]}; "
            + ", ".join(v for k, v in reached.items() if k != bound),
            evidence={"bound": bound, "max_tokens": b.max_tokens, "max_bytes": b.bytes,
                      "max_seconds": round(b.seconds, 3), "text_chunks": self.text_chunks,
                      "bytes": self.bytes, "seconds": round(self.elapsed(), 3)})

    def check_time(self) -> None:
        if self.elapsed() > self.bounds.seconds:
            raise self._stop("seconds", f"{self.bounds.seconds:.1f} s")

    def _count(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.bounds.bytes:
            raise self._stop("bytes", f"{self.bounds.bytes:,} bytes")
        self.check_time()

    def readline(self) -> bytes:
        assert self.response is not None
        room = max(self.bounds.bytes - self.bytes, 0)
        line = self.response.readline(min(MAX_LINE, room) + 1)
        self._count(len(line))
        if len(line) > MAX_LINE:
            raise EndpointError("malformed SSE: a line over 1 MiB")
        return line

    def body(self) -> bytes:
        """A whole (non-streamed) body, within the byte bound."""
        assert self.response is not None
        parts = []
        while block := self.response.read1(1 << 16):
            self._count(len(block))
            parts.append(block)
        self.check_time()  # an end forced by the wall bound reads as an early EOF
        return b"".join(parts)

    def text_chunk(self) -> None:
        """One more chunk of text: past max_tokens of them, the stream is stopped."""
        self.text_chunks += 1
        if self.text_chunks > self.bounds.max_tokens:
            raise self._stop("tokens", f"{self.bounds.max_tokens} text chunks")


@cache
def _validator(name: str) -> jsonschema.protocols.Validator:
    schema = load_schema("verify_run_endpoint")
    return jsonschema.Draft202012Validator({**schema, "$ref": f"#/$defs/{name}"})


def _where(path: Any) -> str:
    """A field's path as code would write it (`choices[0].delta`); a key that is no name
    quoted, so whatever the endpoint sent stays on one line."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.isidentifier():
            out += f"[{json.dumps(part[:40])}]"
        else:
            out += f".{part}" if out else part
    return out or "the document"


def checked(doc: Any, shape: str, what: str) -> Any:
    """`doc` when it has the shape verify-run reads (schemas/verify_run_endpoint.schema.json's
    definition `shape`), else an EndpointError naming the field and what is wrong with it."""
    validator = _validator(shape)
    if validator.is_valid(doc):  # the fast path: a tenth of a millisecond a chunk
        return doc
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    assert error is not None
    raise EndpointError(f"malformed {what}: {_where(error.absolute_path)}: {_say(error)}",
                        evidence={"field": _where(error.absolute_path), "shape": shape})


JSON_TYPES = ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a number"),
              (list, "an array"), (dict, "an object"), (type(None), "null"))


def _say(error: jsonschema.ValidationError) -> str:
    """What is wrong, in a few words: a wrong type as what came and what was wanted (a
    scalar quoted, short), anything else as jsonschema says it (cut to 120 characters)."""
    if error.validator == "type":
        value = error.instance
        came = next(name for kind, name in JSON_TYPES if isinstance(value, kind))
        if not isinstance(value, dict | list) and value is not None:
            text = json.dumps(value)
            came += f" ({text if len(text) <= 40 else text[:37] + '...'})"
        wanted = error.validator_value
        return f"{came}, not {' or '.join(wanted) if isinstance(wanted, list) else wanted}"
    return error.message if len(error.message) <= 120 else error.message[:117] + "..."


class Endpoint:
    """A server at URL (`http://host:port[/v1]`) with an optional API key. stall_s: the
    silence a read may last; request_s: the wall seconds one request may take (None: derived
    from its max_tokens, `Bounds.of`)."""

    def __init__(self, url: str, api_key: str | None = None, stall_s: float = STALL_S,
                 request_s: float | None = None) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointError(f"not an http(s) URL: {url}")
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        base = parts.path.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.api_key, self.stall_s, self.request_s = api_key, stall_s, request_s
        self.url = f"{parts.scheme}://{parts.netloc}{self.base}"
        self._model: str | None = None
        self._listed = False

    # -- transport --------------------------------------------------------------------------

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.stall_s)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "anthropic-version": "2023-06-01"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
            headers["x-api-key"] = self.api_key
        return headers

    def _open(self, conn: http.client.HTTPConnection, method: str, path: str,
              body: dict | None, reader: _Reader) -> http.client.HTTPResponse:
        try:
            conn.connect()
        except OSError as exc:
            raise EndpointError(f"{method} {self.url}{path}: {_reason(exc)}",
                                unreachable=True) from None
        reader.sock = conn.sock  # getresponse drops the connection's own reference
        try:
            conn.request(method, self.base + path, json.dumps(body) if body else None,
                         self._headers())
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise EndpointError(f"{method} {self.url}{path}: {_reason(exc)}") from None
        if response.status != 200:
            detail = response.read(2000).decode("utf-8", "replace")
            raise EndpointError(f"{method} {path}: HTTP {response.status}: {_message(detail)}",
                                status=response.status)
        return response

    def _request(self, method: str, path: str, body: dict | None, max_tokens: int,
                 read: Callable[[_Reader], Any]) -> Any:
        """`read` the response to one request under its Bounds. A watchdog shuts the socket at
        the wall bound, so even a server dribbling a byte at a time inside one line is cut."""
        bounds = Bounds.of(max_tokens, self.stall_s, self.request_s)
        start = time.perf_counter()
        conn = self._connect()
        reader = _Reader(bounds, start)
        watchdog = threading.Timer(bounds.seconds, _cut, (reader,))
        watchdog.daemon = True
        watchdog.start()
        try:
            reader.response = self._open(conn, method, path, body, reader)
            return read(reader)
        except (OSError, http.client.HTTPException) as exc:
            reader.check_time()  # cut by the watchdog: say which bound
            raise EndpointError(f"{path}: {_reason(exc)}") from None
        except EndpointError:
            reader.check_time()  # an early EOF, a broken line or a stall after the cut
            raise
        finally:
            watchdog.cancel()
            conn.close()

    def _json(self, method: str, path: str, body: dict | None, max_tokens: int) -> Any:
        def read(reader: _Reader) -> Any:
            try:
                return json.loads(reader.body())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise EndpointError(f"{path}: the response is not JSON") from None

        return self._request(method, path, body, max_tokens, read)

    # -- API --------------------------------------------------------------------------------

    def model(self) -> str | None:
        """The first model the server lists (asked once); None when the listing is broken but
        the server answers (stock mlx_lm.server's /v1/models fails without a Hugging Face
        cache folder), and requests then name no model. Raises when nothing answers or the key
        is refused."""
        if not self._listed:
            try:
                doc = self._json("GET", "/models", None, LISTING_TOKENS)
            except EndpointError as exc:
                if exc.unreachable or exc.status in (401, 403):
                    raise
                doc = None
            data = doc.get("data") if isinstance(doc, dict) else None
            if isinstance(data, list) and data and isinstance(data[0], dict) \
                    and isinstance(data[0].get("id"), str):
                self._model = data[0]["id"]
            self._listed = True
        return self._model

    def _body(self, messages: list[dict] | None, prompt: str | None, max_tokens: int,
              stream: bool, depth: int | str | None, thinking: bool | None,
              draft: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
        if (model := self.model()) is not None:
            body["model"] = model
        if messages is not None:
            body["messages"] = messages
        else:
            body["prompt"] = prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        if depth is not None:
            body["mtp_depth"] = depth
        if draft is not None:
            body["mtp_draft"] = draft
        if thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": thinking}
        return body

    def ask(self, messages: list[dict] | None = None, prompt: str | None = None, *,
            max_tokens: int, stream: bool, depth: int | str | None = None,
            thinking: bool | None = None, draft: str | None = None,
            extra: dict[str, Any] | None = None) -> Answer:
        """One greedy request (chat when messages are given, text completion otherwise);
        `extra`: more body fields (extensions such as "prefix_cache")."""
        path = "/chat/completions" if messages is not None else "/completions"
        body = self._body(messages, prompt, max_tokens, stream, depth, thinking, draft)
        body |= extra or {}
        if not stream:
            return _answer(self._json("POST", path, body, max_tokens))
        return self._streamed(path, body, max_tokens, _read_stream)

    def _streamed(self, path: str, body: dict[str, Any], max_tokens: int,
                  read: Callable[[_Reader], Answer]) -> Answer:
        """A streamed answer, `read` under the request's bounds."""
        return self._request("POST", path, body, max_tokens, read)

    def ask_messages(self, messages: list[dict], *, max_tokens: int, stream: bool) -> Answer:
        """One greedy Anthropic Messages request: thinking blocks are the reasoning, text
        blocks the content; tokens are usage.output_tokens, prompt tokens the input ones
        prefilled and read from a cache."""
        body = {"model": self.model() or "default", "max_tokens": max_tokens,
                "messages": messages, "temperature": 0.0, "stream": stream}
        if not stream:
            return _message_answer(self._json("POST", "/messages", body, max_tokens))
        return self._streamed("/messages", body, max_tokens, _read_events)


def _cut(reader: _Reader) -> None:
    """The wall bound reached: end the read in flight (it raises or sees EOF)."""
    sock = reader.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "stalled: no data within the time limit"
    return str(exc) or type(exc).__name__


def _message(detail: str) -> str:
    """The message of an error body (either API's shape), on one line."""
    try:
        message = str(json.loads(detail)["error"]["message"])
    except (json.JSONDecodeError, KeyError, TypeError):
        message = detail.strip().splitlines()[0] if detail.strip() else "(empty body)"
    return " ".join(message.split())[:200]


def _usage(doc: dict) -> dict[str, Any] | None:
    return doc.get("usage") or None


def _cached(usage: dict[str, Any]) -> int | None:
    """Prompt tokens read from a prefix cache, where the endpoint says (OpenAI's
    prompt_tokens_details, else mtpkit serve's usage.mtp)."""
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return cached if cached is not None else (usage.get("mtp") or {}).get("cached_tokens")


def _from_usage(content: str, reasoning: str, usage: dict[str, Any], finish: str | None,
                chunks: list[Chunk]) -> Answer:
    return Answer(content, reasoning, usage.get("completion_tokens"), usage.get("prompt_tokens"),
                  finish, chunks, usage.get("mtp"), cached_tokens=_cached(usage))


def _answer(doc: Any) -> Answer:
    choice = checked(doc, "completion", "completion")["choices"][0]
    message = choice.get("message") or {}
    content = message.get("content") if "message" in choice else choice.get("text")
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    return _from_usage(content or "", reasoning, _usage(doc) or {}, choice.get("finish_reason"),
                       [])


def _data(reader: _Reader) -> Iterator[tuple[float, dict[str, Any] | str]]:
    """The data documents of an SSE stream, and "[DONE]" where it says so, each with the
    seconds since the request went out when its line arrived (before any parsing)."""
    while True:
        line = reader.readline()
        at = reader.elapsed()
        if not line:
            return
        text = line.decode("utf-8", "replace").strip()
        if not text or text.startswith(":") or not text.startswith("data:"):
            if text and not text.startswith(("event:", "id:", "retry:", ":")):
                raise EndpointError(f"malformed SSE: unexpected line {text[:60]!r}")
            continue
        data = text[len("data:"):].strip()
        if data == "[DONE]":
            yield at, data
            continue
        try:
            doc = json.loads(data)
        except json.JSONDecodeError:
            raise EndpointError(f"malformed SSE: data is not JSON: {data[:60]!r}") from None
        if not isinstance(doc, dict):
            raise EndpointError("malformed SSE: data is not a JSON object")
        yield at, doc


def _read_stream(reader: _Reader) -> Answer:
    chunks: list[Chunk] = []
    usage: dict[str, Any] = {}
    finish = None
    done = False
    for at, doc in _data(reader):
        if doc == "[DONE]":
            done = True
            break
        doc = checked(doc, "chunk", "stream chunk")
        usage = _usage(doc) or usage
        for choice in doc.get("choices") or []:
            delta = choice.get("delta") or {}
            content = delta.get("content") if "delta" in choice else choice.get("text")
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            chunk = Chunk(at, content or "", reasoning)
            if chunk.content or chunk.reasoning:
                reader.text_chunk()
            chunks.append(chunk)
            finish = choice.get("finish_reason") or finish
    if not done:
        raise EndpointError("malformed SSE: the stream ended without [DONE]")
    return _from_usage("".join(c.content for c in chunks), "".join(c.reasoning for c in chunks),
                       usage, finish, chunks)


def _message_usage(usage: dict[str, Any] | None) -> tuple[int | None, int | None, dict | None]:
    """(output tokens, prompt tokens, mtp) of an Anthropic usage object (checked)."""
    if not usage:
        return None, None, None
    counts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens",
                                      "cache_creation_input_tokens")]
    prompt = sum(c for c in counts if c is not None) if counts[0] is not None else None
    return usage.get("output_tokens"), prompt, usage.get("mtp")


class NoMessagesApi(EndpointError):
    """POST /v1/messages answered, but not with an Anthropic message."""


def _message_answer(doc: Any) -> Answer:
    if not isinstance(doc, dict) or doc.get("type") != "message":
        raise NoMessagesApi("POST /v1/messages does not answer with a message")
    blocks = checked(doc, "message", "message")["content"]
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
    thinking = "".join(b.get("thinking", "") for b in blocks if b.get("type") == "thinking")
    tokens, prompt, mtp = _message_usage(doc.get("usage"))
    return Answer(text, thinking, tokens, prompt, doc.get("stop_reason"), [], mtp)


def _read_events(reader: _Reader) -> Answer:
    """An Anthropic event stream: text and thinking deltas, usage from message_start and
    message_delta; it must end with message_stop."""
    chunks: list[Chunk] = []
    usage: dict[str, Any] = {}
    finish, done = None, False
    for at, doc in _data(reader):
        if doc == "[DONE]":
            continue
        kind = checked(doc, "event", "stream event")["type"]
        assert isinstance(doc, dict)
        if kind == "error":
            raise EndpointError(f"stream error: {_message(json.dumps(doc))}")
        if kind == "message_start":
            usage |= doc["message"].get("usage") or {}
        elif kind == "content_block_delta":
            delta = doc["delta"]
            chunk = Chunk(at, delta.get("text", ""), delta.get("thinking", ""))
            if chunk.content or chunk.reasoning:
                reader.text_chunk()
            chunks.append(chunk)
        elif kind == "message_delta":
            usage |= {k: v for k, v in (doc.get("usage") or {}).items() if v is not None}
            finish = (doc.get("delta") or {}).get("stop_reason")
        elif kind == "message_stop":
            done = True
            break
    if not done:
        raise EndpointError("malformed event stream: it ended without message_stop")
    tokens, prompt, mtp = _message_usage(checked(usage, "message_usage", "usage"))
    return Answer("".join(c.content for c in chunks), "".join(c.reasoning for c in chunks),
                  tokens, prompt, finish, chunks, mtp)


def open_endpoint(url: str, api_key: str | None, stall_s: float = STALL_S,
                  request_s: float | None = None) -> Endpoint:
    """An endpoint that answers (and accepts the key), or EndpointError. request_s: the wall
    seconds one request may take (None: --timeout plus a second per token it asks for)."""
    endpoint = Endpoint(url, api_key, stall_s, request_s)
    endpoint.model()
    return endpoint


FOLLOW_UP = "Summarise that in one sentence."
TURN_TOKENS = 24


def serving_checks(endpoint: Endpoint, progress: Callable[[str], None]) -> list[Check]:
    """What a serving endpoint does across requests: a second turn over a cached prefix (when
    the endpoint reports cached tokens), and the Anthropic Messages API (when it has one)."""
    checks = []
    for name, check in (("prefix_cache", _prefix_check), ("anthropic", _anthropic_check)):
        progress(name.replace("_", " "))
        try:
            checks.append(check(endpoint))
        except EndpointError as exc:
            checks.append(Check(name, FAIL, str(exc)))
    return checks


def _prefix_check(endpoint: Endpoint) -> Check:
    """Turn 1 behind a fresh nonce, turn 2 extending it (the prefix cache's case), then turn 2
    again with the cache off ("prefix_cache": false, an mtpkit serve extension) as the cold
    reference for its text and TTFT."""
    document = real_loads(["memo"])["memo"].fresh()
    turn1 = [{"role": "system", "content": document},
             {"role": "user", "content": "What is this memo about?"}]
    first = endpoint.ask(turn1, max_tokens=TURN_TOKENS, stream=True)
    turn2 = [*turn1, {"role": "assistant", "content": first.content or first.reasoning},
             {"role": "user", "content": FOLLOW_UP}]
    warm = endpoint.ask(turn2, max_tokens=TURN_TOKENS, stream=True)
    cached = (warm.mtp or {}).get("cached_tokens")
    if not isinstance(cached, int):
        return Check("prefix_cache", INFO, "not checked: the endpoint reports no cached tokens")
    cold = endpoint.ask(turn2, max_tokens=TURN_TOKENS, stream=True,
                        extra={"prefix_cache": False})
    return prefix_cache_check(cold, warm, cached, (cold.mtp or {}).get("cached_tokens"))


def _anthropic_check(endpoint: Endpoint) -> Check:
    messages = [{"role": "user", "content": "Name three uses of a hash table."}]
    try:
        whole = endpoint.ask_messages(messages, max_tokens=TURN_TOKENS, stream=False)
    except EndpointError as exc:
        if isinstance(exc, NoMessagesApi) or exc.status in (404, 405):
            return Check("anthropic", INFO, "not checked: the endpoint has no Messages API "
                         f"(POST /v1/messages: {exc})")
        raise
    streamed = endpoint.ask_messages(messages, max_tokens=TURN_TOKENS, stream=True)
    chat = endpoint.ask(messages, max_tokens=TURN_TOKENS, stream=False)
    return anthropic_check(whole, streamed, chat)
