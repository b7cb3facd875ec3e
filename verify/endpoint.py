"""An OpenAI-compatible endpoint as verify-run sees it: plain HTTP (the standard library's
http.client), SSE read line by line with a stall timeout, malformed streams reported, never
raised as tracebacks."""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from mtpkit.verify.answer import Answer, Chunk

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
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
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
            thinking: bool | None = None, draft: str | None = None) -> Answer:
        """One greedy request (chat when messages are given, text completion otherwise)."""
        path = "/chat/completions" if messages is not None else "/completions"
        body = self._body(messages, prompt, max_tokens, stream, depth, thinking, draft)
        if not stream:
            return _answer(self._json("POST", path, body))
        start = time.perf_counter()
        conn, response = self._open("POST", path, body)
        try:
            return _read_stream(response, start)
        except (OSError, http.client.HTTPException) as exc:
            raise EndpointError(f"stream: {_reason(exc)}") from None
        finally:
            conn.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "stalled: no data within the time limit"
    return str(exc) or type(exc).__name__


def _message(detail: str) -> str:
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


def _read_stream(response: http.client.HTTPResponse, start: float) -> Answer:
    chunks: list[Chunk] = []
    usage: dict[str, Any] = {}
    finish = None
    done = False
    while True:
        line = response.readline(MAX_LINE + 1)
        if not line:
            break
        if len(line) > MAX_LINE:
            raise EndpointError("malformed SSE: a line over 1 MiB")
        text = line.decode("utf-8", "replace").strip()
        if not text or text.startswith(":") or not text.startswith("data:"):
            if text and not text.startswith(("event:", "id:", "retry:", ":")):
                raise EndpointError(f"malformed SSE: unexpected line {text[:60]!r}")
            continue
        data = text[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            doc = json.loads(data)
        except json.JSONDecodeError:
            raise EndpointError(f"malformed SSE: data is not JSON: {data[:60]!r}") from None
        if not isinstance(doc, dict):
            raise EndpointError("malformed SSE: data is not a JSON object")
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


def open_endpoint(url: str, api_key: str | None, stall_s: float = STALL_S) -> Endpoint:
    """An endpoint that answers (and accepts the key), or EndpointError."""
    endpoint = Endpoint(url, api_key, stall_s)
    endpoint.model()
    return endpoint
