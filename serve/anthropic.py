"""Anthropic's Messages API (`POST /v1/messages`) over the same service as the OpenAI API.

A request becomes the service's chat Request: the system prompt and the turns become template
messages (tool_use blocks become the assistant's tool_calls, tool_result blocks `tool` messages),
tools become function tools, `thinking` the template's thinking switch (absent: the template's
default). Sampling comes from the body: the current `anthropic` SDK has no temperature, top_p or
top_k arguments, so clients pass them as `extra_body`; absent, decoding is greedy (temperature
0), as on the OpenAI routes. Answers carry thinking, text and tool_use blocks; usage counts
input tokens prefilled, prompt tokens read from the prefix cache and output tokens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from mtpkit.decoder.runner import Result
from mtpkit.serve.channels import Delta
from mtpkit.serve.protocol import (
    MAX_MESSAGES,
    Request,
    RequestError,
    cache_salt,
    integer,
    mtp_depth,
    mtp_draft,
    number,
    prefix_cache,
    stops,
    text,
)
from mtpkit.serve.service import tool_calls, usage

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 411: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}
MAX_TOOLS = 128


def error_body(err: RequestError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(err.status, "api_error")
    where = f"{err.param}: " if err.param and not err.message.startswith(err.param) else ""
    return {"type": "error", "error": {"type": kind, "message": where + err.message}}


def _bad(message: str, param: str) -> RequestError:
    return RequestError(400, message, param)


def _turn(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as template messages."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        raise _bad("content must be a string or a non-empty list of blocks", where)
    texts, reasoning, calls, results = [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise _bad("a tool_use block needs a name and an input object", at)
            calls.append({"id": str(block.get("id", f"toolu_{len(calls)}")), "type": "function",
                          "function": {"name": block["name"], "arguments": block["input"]}})
        elif kind == "tool_result" and role == "user":
            body = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": text(body, at)})
        else:
            raise _bad(f"unsupported block {kind!r} in a {role} message (text, thinking, "
                       "tool_use and tool_result blocks are)", at)
    message: dict[str, Any] = {"role": role, "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return results + ([message] if texts or reasoning or calls or not results else [])


def _tools(body: dict) -> list[dict[str, Any]] | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and (not isinstance(choice, dict) or
                               choice.get("type") not in ("auto", "any", "tool", "none")):
        raise _bad('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or \
                not isinstance(tool.get("input_schema", {}), dict):
            raise _bad("a tool needs a name and an input_schema object", f"tools[{i}]")
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": str(tool.get("description", "")),
            "parameters": tool.get("input_schema", {"type": "object"})}})
    return None if (choice or {}).get("type") == "none" else out or None


def _thinking(body: dict) -> bool | None:
    value = body.get("thinking")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _bad('thinking must be {"type": "enabled" | "disabled" | "adaptive"}', "thinking")
    return {"enabled": True, "disabled": False}.get(kind)


def parse(body: Any, max_tokens_limit: int) -> Request:
    """A Messages API body as the service's Request (RequestError when malformed)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    if "max_tokens" not in body:
        raise _bad("max_tokens is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise _bad(f"messages must be a list of 1 to {MAX_MESSAGES} messages", "messages")
    system = body.get("system")
    turns = [{"role": "system", "content": text(system, "system")}] if system else []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad("role must be user or assistant", f"messages[{i}].role")
        turns += _turn(m["role"], m.get("content"), f"messages[{i}]")
    if not isinstance(body.get("metadata", {}), dict):
        raise _bad("metadata must be an object", "metadata")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    limit = max_tokens_limit
    max_tokens = integer(body, "max_tokens", None, 1, limit, required=True)  # null: a 400
    assert max_tokens is not None
    return Request(
        chat=True, messages=turns, stream=stream, max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 0.0, 1.0),
        top_p=number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=integer(body, "top_k", 0, 0, 1 << 20) or 0,
        seed=integer(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        tools=_tools(body), enable_thinking=_thinking(body), depth=mtp_depth(body),
        draft=mtp_draft(body), stop=stops(body.get("stop_sequences"), "stop_sequences"),
        prefix_cache=prefix_cache(body), cache_salt=cache_salt(body))


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _usage(last: Delta | None) -> dict[str, Any]:
    """Input tokens prefilled, prompt tokens read from the prefix cache, output tokens, and
    the decoder's MTP statistics (None: message_start, before the prefill)."""
    if last is None or last.result is None:
        return {"input_tokens": 0, "output_tokens": 0}
    result = last.result
    openai = usage(result, last.draft, last.cached)
    return {"input_tokens": result.stats.prompt_tokens, "output_tokens": len(result.tokens),
            "cache_read_input_tokens": result.cached_tokens, "cache_creation_input_tokens": 0,
            "mtp": openai["mtp"]}


def stop_reason(result: Result, stop_sequence: str | None, calls: bool) -> str:
    if calls:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if result.finish_reason == "length" else "end_turn"


def _tool_blocks(content: str) -> tuple[str, list[dict[str, Any]]]:
    """The text, and the tool_use blocks of the calls in it."""
    said, calls = tool_calls(content)
    blocks = []
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        blocks.append({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24],
                       "name": call["function"]["name"],
                       "input": arguments if isinstance(arguments, dict) else {"value": arguments}})
    return said, blocks


def message(mid: str, model: str, req: Request, reasoning: str, content: str,
            last: Delta) -> dict[str, Any]:
    """The whole (non-streamed) answer; `last`: the delta with the result."""
    assert last.result is not None
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    said, calls = _tool_blocks(content) if req.tools else (content, [])
    if said:
        blocks.append({"type": "text", "text": said})
    blocks += calls
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop_reason(last.result, last.stop_sequence, bool(calls)),
            "stop_sequence": last.stop_sequence, "usage": _usage(last)}


class Events:
    """The streamed answer as Anthropic's events: message_start, a content block per channel
    (thinking, text, then tool_use blocks; with tools the text is held back until the calls in
    it are known), message_delta with the stop reason and usage, message_stop."""

    def __init__(self, send: Callable[[str, dict[str, Any]], None], mid: str, model: str,
                 req: Request) -> None:
        self.send, self.req = send, req
        self.index, self.open = -1, None  # the open block's index and type
        self.held = ""
        send("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": _usage(None)}})

    def _block(self, kind: str, start: dict[str, Any]) -> None:
        self._close()
        self.index += 1
        self.open = kind
        self.send("content_block_start", {"type": "content_block_start", "index": self.index,
                                          "content_block": start})

    def _close(self) -> None:
        if self.open is not None:
            self.send("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open = None

    def _delta(self, kind: str, delta: dict[str, Any]) -> None:
        if self.open != kind:
            self._block(kind, {"type": "thinking", "thinking": "", "signature": ""}
                        if kind == "thinking" else {"type": "text", "text": ""})
        self.send("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                          "delta": delta})

    def feed(self, reasoning: str, content: str) -> None:
        if reasoning:
            self._delta("thinking", {"type": "thinking_delta", "thinking": reasoning})
        if self.req.tools:
            self.held += content
        elif content:
            self._delta("text", {"type": "text_delta", "text": content})

    def finish(self, last: Delta) -> None:
        """The held text and tool calls, the block's end, the stop reason and usage."""
        assert last.result is not None
        calls: list[dict[str, Any]] = []
        if self.req.tools:
            said, calls = _tool_blocks(self.held)
            if said:
                self._delta("text", {"type": "text_delta", "text": said})
            for call in calls:
                self._block("tool_use", {**call, "input": {}})
                self.send("content_block_delta", {
                    "type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(call["input"])}})
        self._close()
        self.send("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": stop_reason(last.result, last.stop_sequence, bool(calls)),
            "stop_sequence": last.stop_sequence}, "usage": _usage(last)})
        self.send("message_stop", {"type": "message_stop"})
