"""An OpenAI-compatible endpoint as verify-run sees it: plain HTTP (the standard library's
http.client), SSE read line by line with a stall timeout, malformed streams reported, never
raised as tracebacks. Where the endpoint has them, Anthropic's Messages API too, and the
serving checks beyond one request: the prefix cache over a second turn, and the Messages API
against the chat API (`serving_checks`)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from mtpkit.verify.answer import Answer, Chunk
from mtpkit.verify.checks import FAIL, INFO, Check, anthropic_check, prefix_cache_check
from mtpkit.verify.loads import real_loads

STALL_S = 60.0
MAX_LINE = 1 << 20


class EndpointError(Exception):
    """The endpoint failed in a way verify-run reports as evidence (one line)."""

    def __init__(self, message: str, unreachable: bool = False, status: int | None = None) -> None:
        super().__init__(message)
        self.unreachable, self.status = unreachable, status


class Endpoint:
    """A server at URL (`http://host:port[/v1]`) with an optional API key."""

    def __init__(self, url: str, api_key: str | None = None, stall_s: float = STALL_S) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointError(f"not an http(s) URL: {url}")
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        base = parts.path.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.api_key, self.stall_s = api_key, stall_s
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

    def _open(self, method: str, path: str, body: dict | None) -> tuple[
            http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connect()
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise EndpointError(f"{method} {self.url}{path}: {_reason(exc)}",
                                unreachable=True) from None
        try:
            conn.request(method, self.base + path, json.dumps(body) if body else None,
                         self._headers())
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise EndpointError(f"{method} {self.url}{path}: {_reason(exc)}") from None
        if response.status != 200:
            detail = response.read(2000).decode("utf-8", "replace")
            conn.close()
            raise EndpointError(f"{method} {path}: HTTP {response.status}: {_message(detail)}",
                                status=response.status)
        return conn, response

    def _json(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        conn, response = self._open(method, path, body)
        try:
            doc = json.loads(response.read())
        except (OSError, http.client.HTTPException) as exc:
            raise EndpointError(f"{path}: {_reason(exc)}") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise EndpointError(f"{path}: the response is not JSON") from None
        finally:
            conn.close()
        if not isinstance(doc, dict):
            raise EndpointError(f"{path}: the response is not a JSON object")
        return doc

    # -- API --------------------------------------------------------------------------------

    def model(self) -> str | None:
        """The first model the server lists (asked once); None when the listing is broken but
        the server answers (stock mlx_lm.server's /v1/models fails without a Hugging Face
        cache folder), and requests then name no model. Raises when nothing answers or the key
        is refused."""
        if not self._listed:
            try:
                data = self._json("GET", "/models").get("data")
            except EndpointError as exc:
                if exc.unreachable or exc.status in (401, 403):
                    raise
                data = None
            if isinstance(data, list) and data and isinstance(data[0], dict):
                self._model = str(data[0].get("id"))
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
            return _answer(self._json("POST", path, body))
        return self._streamed(path, body, _read_stream)

    def _streamed(self, path: str, body: dict[str, Any],
                  read: Callable[[http.client.HTTPResponse, float], Answer]) -> Answer:
        """A streamed answer, `read` from the response with the time the request went out."""
        start = time.perf_counter()
        conn, response = self._open("POST", path, body)
        try:
            return read(response, start)
        except (OSError, http.client.HTTPException) as exc:
            raise EndpointError(f"stream: {_reason(exc)}") from None
        finally:
            conn.close()


    def ask_messages(self, messages: list[dict], *, max_tokens: int, stream: bool) -> Answer:
        """One greedy Anthropic Messages request: thinking blocks are the reasoning, text
        blocks the content; tokens are usage.output_tokens, prompt tokens the input ones
        prefilled and read from a cache."""
        body = {"model": self.model() or "default", "max_tokens": max_tokens,
                "messages": messages, "temperature": 0.0, "stream": stream}
        if not stream:
            return _message_answer(self._json("POST", "/messages", body))
        return self._streamed("/messages", body, _read_events)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "stalled: no data within the time limit"
    return str(exc) or type(exc).__name__


def _message(detail: str) -> str:
    """The message of an error body (either API's shape)."""
    try:
        return str(json.loads(detail)["error"]["message"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return detail.strip().splitlines()[0][:200] if detail.strip() else "(empty body)"


def _usage(doc: dict) -> dict[str, Any] | None:
    usage = doc.get("usage")
    return usage if isinstance(usage, dict) else None


def _answer(doc: dict) -> Answer:
    try:
        choice = doc["choices"][0]
        message = choice.get("message") or {}
        content = message.get("content") if "message" in choice else choice.get("text")
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        raise EndpointError("the response has no choices[0]") from None
    usage = _usage(doc) or {}
    return Answer(content or "", reasoning, usage.get("completion_tokens"),
                  usage.get("prompt_tokens"), choice.get("finish_reason"), [], usage.get("mtp"))


def _data(response: http.client.HTTPResponse) -> Iterator[dict[str, Any] | str]:
    """The data documents of an SSE stream, and "[DONE]" where it says so."""
    while True:
        line = response.readline(MAX_LINE + 1)
        if not line:
            return
        if len(line) > MAX_LINE:
            raise EndpointError("malformed SSE: a line over 1 MiB")
        text = line.decode("utf-8", "replace").strip()
        if not text or text.startswith(":") or not text.startswith("data:"):
            if text and not text.startswith(("event:", "id:", "retry:", ":")):
                raise EndpointError(f"malformed SSE: unexpected line {text[:60]!r}")
            continue
        data = text[len("data:"):].strip()
        if data == "[DONE]":
            yield data
            continue
        try:
            doc = json.loads(data)
        except json.JSONDecodeError:
            raise EndpointError(f"malformed SSE: data is not JSON: {data[:60]!r}") from None
        if not isinstance(doc, dict):
            raise EndpointError("malformed SSE: data is not a JSON object")
        yield doc


def _read_stream(response: http.client.HTTPResponse, start: float) -> Answer:
    chunks: list[Chunk] = []
    usage: dict[str, Any] = {}
    finish = None
    done = False
    for doc in _data(response):
        if doc == "[DONE]":
            done = True
            break
        assert isinstance(doc, dict)
        usage = _usage(doc) or usage
        for choice in doc.get("choices") or []:
            delta = choice.get("delta") or {}
            content = delta.get("content") if "delta" in choice else choice.get("text")
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            chunks.append(Chunk(time.perf_counter() - start, content or "", reasoning))
            finish = choice.get("finish_reason") or finish
    if not done:
        raise EndpointError("malformed SSE: the stream ended without [DONE]")
    return Answer("".join(c.content for c in chunks), "".join(c.reasoning for c in chunks),
                  usage.get("completion_tokens"), usage.get("prompt_tokens"), finish, chunks,
                  usage.get("mtp"))


def _message_usage(usage: Any) -> tuple[int | None, int | None, dict | None]:
    """(output tokens, prompt tokens, mtp) of an Anthropic usage object."""
    if not isinstance(usage, dict):
        return None, None, None
    counts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens",
                                      "cache_creation_input_tokens")]
    prompt = sum(c for c in counts if isinstance(c, int)) if isinstance(counts[0], int) else None
    mtp = usage.get("mtp")
    return usage.get("output_tokens"), prompt, mtp if isinstance(mtp, dict) else None


class NoMessagesApi(EndpointError):
    """POST /v1/messages answered, but not with an Anthropic message."""


def _message_answer(doc: dict) -> Answer:
    if doc.get("type") != "message":
        raise NoMessagesApi("POST /v1/messages does not answer with a message")
    blocks = doc.get("content")
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise EndpointError("the message has no content blocks")
    text = "".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text")
    thinking = "".join(str(b.get("thinking", "")) for b in blocks if b.get("type") == "thinking")
    tokens, prompt, mtp = _message_usage(doc.get("usage"))
    return Answer(text, thinking, tokens, prompt, doc.get("stop_reason"), [], mtp)


def _read_events(response: http.client.HTTPResponse, start: float) -> Answer:
    """An Anthropic event stream: text and thinking deltas, usage from message_start and
    message_delta; it must end with message_stop."""
    chunks: list[Chunk] = []
    usage: dict[str, Any] = {}
    finish, done = None, False
    for doc in _data(response):
        kind = doc.get("type") if isinstance(doc, dict) else None
        assert isinstance(doc, dict)
        if kind == "error":
            raise EndpointError(f"stream error: {_message(json.dumps(doc))}")
        if kind == "message_start":
            usage |= (doc.get("message") or {}).get("usage") or {}
        elif kind == "content_block_delta":
            delta = doc.get("delta") or {}
            chunks.append(Chunk(time.perf_counter() - start, str(delta.get("text", "")),
                                str(delta.get("thinking", ""))))
        elif kind == "message_delta":
            usage |= {k: v for k, v in (doc.get("usage") or {}).items() if v is not None}
            finish = (doc.get("delta") or {}).get("stop_reason")
        elif kind == "message_stop":
            done = True
            break
    if not done:
        raise EndpointError("malformed event stream: it ended without message_stop")
    tokens, prompt, mtp = _message_usage(usage)
    return Answer("".join(c.content for c in chunks), "".join(c.reasoning for c in chunks),
                  tokens, prompt, finish, chunks, mtp)


def open_endpoint(url: str, api_key: str | None, stall_s: float = STALL_S) -> Endpoint:
    """An endpoint that answers (and accepts the key), or EndpointError."""
    endpoint = Endpoint(url, api_key, stall_s)
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
