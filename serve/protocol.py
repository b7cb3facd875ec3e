"""The OpenAI-compatible request and response shapes `mtpkit serve` accepts and sends.

Requests are validated before any work: bounded sizes, known fields with the right types, a
max_tokens ceiling; every failure is a RequestError that becomes a JSON error body.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mtpkit.decoder.session import DRAFTS

MAX_BODY_BYTES = 1 << 20
MAX_MESSAGES = 256
MAX_STOPS, MAX_STOP_CHARS = 16, 256
ROLES = ("system", "user", "assistant", "tool")


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


@dataclass
class Request:
    """One chat or text completion request, validated."""

    chat: bool
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | list[int] = ""
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    enable_thinking: bool | None = None
    depth: int | str | None = None  # extension "mtp_depth": "auto" or 0-16 (0: MTP off)
    draft: str | None = None  # extension "mtp_draft": "head", "lookup" or "both"
    stop: list[str] | None = None  # stop sequences (the content ends before the first)
    prefix_cache: bool = True  # extension "prefix_cache": false prefills the whole prompt

    @property
    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p, "seed": self.seed}


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(400, f"{name} must be a number in [{low}, {high}]", name)
    return float(value)


def integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(400, f"{name} must be an integer in [{low}, {high}]", name)
    return value


def mtp_depth(body: dict) -> int | str | None:
    value = body.get("mtp_depth")
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 16:
        raise RequestError(400, 'mtp_depth must be "auto" or an integer in [0, 16]', "mtp_depth")
    return value


def mtp_draft(body: dict) -> str | None:
    value = body.get("mtp_draft")
    if value is None or (isinstance(value, str) and value in DRAFTS):
        return value
    raise RequestError(400, 'mtp_draft must be "head", "lookup" or "both"', "mtp_draft")


def prefix_cache(body: dict) -> bool:
    """The "prefix_cache" extension: false makes a request start cold (verify-run's reference
    for a cached answer), and keeps nothing of it."""
    value = body.get("prefix_cache", True)
    if not isinstance(value, bool):
        raise RequestError(400, "prefix_cache must be true or false", "prefix_cache")
    return value


def stops(value: Any, name: str) -> list[str] | None:
    """Stop sequences: a string or a list of non-empty, bounded strings."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in value):
        raise RequestError(400, f"{name} must be a string or a list of at most {MAX_STOPS} "
                           f"strings of 1 to {MAX_STOP_CHARS} characters", name)
    return value or None


def text(content: Any, where: str) -> str:
    """Content as text: a string, or a list of text parts / blocks (both APIs call them
    {"type": "text", "text": ...}; other types are refused); None is empty."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if content is None:
        return ""
    raise RequestError(400, f"{where}: must be a string or a list of text parts", where)


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise RequestError(400, f"messages must be a list of 1 to {MAX_MESSAGES} messages",
                           "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}",
                               f"messages[{i}]")
        message = {**m, "content": text(m.get("content"), f"messages[{i}]")}
        out.append(message)
    return out


def parse(body: Any, chat: bool, max_tokens_limit: int) -> Request:
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    limit = max_tokens_limit
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    req = Request(
        chat=chat,
        max_tokens=integer({"max_tokens": requested}, "max_tokens", min(256, limit), 1, limit),
        temperature=number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=integer(body, "top_k", 0, 0, 1 << 20) or 0,
        min_p=number(body, "min_p", 0.0, 0.0, 1.0),
        seed=integer(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        depth=mtp_depth(body),
        draft=mtp_draft(body),
        stop=stops(body.get("stop"), "stop"), prefix_cache=prefix_cache(body),
    )
    req.stream = body.get("stream", False)
    if not isinstance(req.stream, bool):
        raise RequestError(400, "stream must be true or false", "stream")
    if body.get("n", 1) != 1:
        raise RequestError(400, "only n=1 is supported", "n")
    if chat:
        req.messages = _messages(body)
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or
                                  not all(isinstance(t, dict) for t in tools)):
            raise RequestError(400, "tools must be a list of objects", "tools")
        req.tools = tools or None
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
        thinking = kwargs.get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise RequestError(400, "enable_thinking must be true or false", "chat_template_kwargs")
        req.enable_thinking = thinking
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) and not
                                                            isinstance(t, bool) for t in prompt)):
            raise RequestError(400, "prompt must be a non-empty string or list of token ids",
                               "prompt")
        req.prompt = prompt
    return req


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def envelope(cid: str, model: str, chat: bool, chunk: bool) -> dict[str, Any]:
    kind = "chat.completion" if chat else "text_completion"
    return {"id": cid, "object": kind + (".chunk" if chunk and chat else ""),
            "created": int(time.time()), "model": model}
