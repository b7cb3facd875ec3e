"""OpenAI's answers (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) built from the
service's deltas, as serve/anthropic.py builds Anthropic's, so that the HTTP layer only writes
them. Requests are parsed in serve/protocol.py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from mtpkit.serve.channels import Delta
from mtpkit.serve.protocol import Request, completion_id, envelope
from mtpkit.serve.service import tool_calls, usage


def models(model_id: str) -> dict[str, Any]:
    """`GET /v1/models`: the one model this server runs."""
    return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "mtpkit"}]}


def completion(req: Request, model: str, deltas: Iterable[Delta]) -> dict[str, Any]:
    """The whole (non-streamed) answer, once the deltas are spent."""
    reasoning = content = ""
    last = None
    for delta in deltas:
        reasoning += delta.reasoning
        content += delta.content
        last = delta if delta.result is not None else last
    assert last is not None and last.result is not None
    result = last.result
    doc = envelope(completion_id(req.chat), model, req.chat, chunk=False)
    if req.chat:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = []
        if req.tools:
            message["content"], calls = tool_calls(content)
            if calls:
                message["tool_calls"] = calls
        choice = {"index": 0, "message": message,
                  "finish_reason": "tool_calls" if calls else result.finish_reason}
    else:
        choice = {"index": 0, "text": content, "finish_reason": result.finish_reason}
    return doc | {"choices": [choice], "usage": usage(result, last.draft, last.cached)}


def chunks(req: Request, model: str, deltas: Iterable[Delta]) -> Iterator[dict[str, Any] | str]:
    """The streamed answer, one SSE data item at a time: the role (chat), a chunk per delta
    (with tools, content is held back until the calls in it are known), the finish, the usage,
    and "[DONE]"."""
    cid = completion_id(req.chat)
    held = ""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        body = {"index": 0, "delta": delta, "finish_reason": finish} if req.chat else \
            {"index": 0, "text": delta.get("content", ""), "finish_reason": finish}
        return envelope(cid, model, req.chat, chunk=True) | {"choices": [body]}

    if req.chat:
        yield chunk({"role": "assistant", "content": ""})
    for d in deltas:
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if req.tools:
            held += d.content
        elif d.content:
            delta["content"] = d.content
        if delta:
            yield chunk(delta)
        if d.result is not None:
            finish = d.result.finish_reason
            if req.tools:
                content, calls = tool_calls(held)
                last: dict[str, Any] = {"content": content} if content else {}
                if calls:
                    last["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                    finish = "tool_calls"
                yield chunk(last, finish)
            else:
                yield chunk({}, finish)
            yield envelope(cid, model, req.chat, chunk=True) | {
                "choices": [], "usage": usage(d.result, d.draft, d.cached)}
    yield "[DONE]"
