"""The OpenAI-compatible request and response shapes `mtpkit serve` accepts and sends.

Requests are validated before any work: bounded sizes, bounded JSON (nesting, integer digits,
text that is Unicode), known fields with the right types, a max_tokens ceiling, fields this
server cannot honour refused rather than ignored; every failure is a RequestError that becomes
a JSON error body.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mtpkit.decoder.options import OptionError, depth_option, source_option

MAX_BODY_BYTES = 1 << 20
MAX_MESSAGES = 256
MAX_STOPS, MAX_STOP_CHARS = 16, 256
ROLES = ("system", "user", "assistant", "tool")
MAX_DEPTH = 64  # JSON nesting: tool schemas nest a dozen levels; the C parser recurses per level
MAX_INT_DIGITS = 64  # every integer the APIs take fits in 20 digits
MAX_SALT_CHARS = 256  # cache_salt: vLLM's field; a salt is a secret's digest, not a document
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")  # escaped, or as raw bytes


class RequestError(Exception):
    """A refusal: the HTTP status, a one-line message, the field to blame, the error type.
    `code` (a stable name such as "prompt.too_long") leads the message where given."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        message = f"{code}: {message}" if code else message
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code

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
    draft: str | None = None  # extension "mtp_draft": "head", "lookup", "both" or "model"
    stop: list[str] | None = None  # stop sequences (the content ends before the first)
    prefix_cache: bool = True  # extension "prefix_cache": false prefills the whole prompt
    cache_salt: str | None = None  # vLLM's field: only requests with the same salt share prefixes

    @property
    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p, "seed": self.seed}


def _nesting(raw: bytes) -> int:
    """How deep the body's arrays and objects nest (brackets inside strings not counted; 0
    where too few open to pass MAX_DEPTH), in C-speed passes: 1 MiB takes well under a
    second, before the parser, which recurses per level, sees it."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0  # the common case costs two counts
    marks = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), np.uint8)
    steps = np.where((marks == ord("[")) | (marks == ord("{")), 1, -1)
    return int(np.cumsum(steps).max(initial=0))


def _integer(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise RequestError(400, f"an integer in the body has more than {MAX_INT_DIGITS} digits",
                           code="request.number")
    return int(digits)


def _constant(name: str) -> Any:
    raise RequestError(400, f"{name} is not JSON", code="request.invalid_json")


def _float(digits: str) -> float:
    """A JSON number with a fraction or exponent; one past float's range (1e999) would be
    read as infinity, which is not JSON either."""
    value = float(digits)
    if not math.isfinite(value):
        raise RequestError(400, f"the number {digits[:40]} is out of range", code="request.number")
    return value


def _unicode(doc: Any) -> None:
    """Every string (and key) must be Unicode text: a lone surrogate (an unpaired \\ud800
    escape) cannot be encoded, so a tokenizer or template would fail on it later."""
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(400, "a string in the body holds a lone UTF-16 surrogate",
                                   code="request.invalid_json") from None


def load_json(raw: bytes) -> Any:
    """A request body as JSON, bounded before the parser sees it, for both APIs: nesting at
    most MAX_DEPTH (deeper bodies made the parser recurse until it failed: a 500), integers
    of at most MAX_INT_DIGITS digits (longer ones cost quadratic time, and past 4,300 digits
    Python refuses them: a 500), no NaN or Infinity (spelled out, or a number past float's
    range), only encodable text. Tool calls in a model's output are parsed the same way
    (serve/service.py)."""
    if _nesting(raw) > MAX_DEPTH:
        raise RequestError(400, f"the body nests deeper than {MAX_DEPTH} levels",
                           code="request.too_deep")
    try:
        doc = json.loads(raw or b"null", parse_int=_integer, parse_float=_float,
                         parse_constant=_constant)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "the body is not valid JSON") from None
    except RecursionError:  # not reached under MAX_DEPTH; kept as a backstop
        raise RequestError(400, f"the body nests deeper than {MAX_DEPTH} levels",
                           code="request.too_deep") from None
    if _SURROGATE.search(raw):  # else no string can hold a surrogate: no walk
        _unicode(doc)
    return doc


# OpenAI fields this server cannot honour: asked for, they are refused rather than ignored
# (an ignored `logprobs` reads as a server with none to give, an ignored `echo` or penalty as a
# model that behaves oddly). For each, the values that ask for nothing (null always does; on
# /v1/completions `logprobs` is a count, and 0 asks for the chosen tokens' own).
NOT_ASKED: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "best_of": (1,),
    "suffix": ("",), "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,)}
WHY_NOT = {"logprobs": "this server returns no log probabilities",
           "top_logprobs": "this server returns no log probabilities",
           "echo": "the prompt is not echoed", "best_of": "one completion is generated",
           "suffix": "no insertion (fill-in-the-middle) mode",
           "logit_bias": "the sampler takes no logit bias",
           "presence_penalty": "the sampler applies no penalties",
           "frequency_penalty": "the sampler applies no penalties"}


def unsupported(body: dict, chat: bool) -> None:
    """Refuse the fields of NOT_ASKED that ask for something, and a response_format other
    than text (request.unsupported)."""
    for name, idle in NOT_ASKED.items():
        value = body.get(name)
        if name == "logprobs" and not chat:
            idle = ()
        if value is not None and value not in idle:
            raise RequestError(400, f"{name} is not supported ({WHY_NOT[name]})", name,
                               code="request.unsupported")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError(400, 'response_format is not supported (only {"type": "text"}: '
                           "the output is not constrained)", "response_format",
                           code="request.unsupported")


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(400, f"{name} must be a number in [{low}, {high}]", name)
    return float(value)


def integer(body: dict, name: str, default: int | None, low: int, high: int,
            required: bool = False) -> int | None:
    """An integer field in [low, high]; absent or null: `default`, or refused if `required`."""
    value = body.get(name, default)
    if value is None and not required:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(400, f"{name} must be an integer in [{low}, {high}]", name)
    return value


# the decoding options under the names these APIs give them
API_NAMES = {"depth": "mtp_depth", "draft": "mtp_draft"}


def refused(err: OptionError) -> RequestError:
    """A decoding option refused by decoder/options.py, as a 400 naming the API's field."""
    name = API_NAMES.get(err.option, err.option)
    return RequestError(400, err.say(name), name, code=err.code)


def mtp_depth(body: dict) -> int | str | None:
    try:
        return depth_option(body.get("mtp_depth"))
    except OptionError as err:
        raise refused(err) from None


def mtp_draft(body: dict) -> str | None:
    try:
        return source_option(body.get("mtp_draft"))
    except OptionError as err:
        raise refused(err) from None


def prefix_cache(body: dict) -> bool:
    """The "prefix_cache" extension: false makes a request start cold (verify-run's reference
    for a cached answer), and keeps nothing of it."""
    value = body.get("prefix_cache", True)
    if not isinstance(value, bool):
        raise RequestError(400, "prefix_cache must be true or false", "prefix_cache")
    return value


def cache_salt(body: dict) -> str | None:
    """vLLM's "cache_salt": requests share cached prefixes only with requests carrying the same
    salt (and the same API key), so a client that salts its prompts cannot be probed through
    cached_tokens or the first token's time. A non-empty, bounded string."""
    value = body.get("cache_salt")
    if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_SALT_CHARS):
        raise RequestError(400, f"cache_salt must be a string of 1 to {MAX_SALT_CHARS} "
                           "characters", "cache_salt", code="request.cache_salt")
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
        cache_salt=cache_salt(body),
    )
    req.stream = body.get("stream", False)
    if not isinstance(req.stream, bool):
        raise RequestError(400, "stream must be true or false", "stream")
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise RequestError(400, "only n=1 is supported", "n")
    unsupported(body, chat)
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
