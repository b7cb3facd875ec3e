"""One loaded bundle answering requests: chat rendering (thinking switch, tools), the reasoning
channel, tool calls, usage with MTP statistics. One generation at a time (MLX state is not
shared across threads)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mtpkit.decoder.runner import Depth, Result, Runner
from mtpkit.loaders.templates import RENDER_ERRORS, describe_failure
from mtpkit.serve.channels import OPEN, ChannelSplitter
from mtpkit.serve.protocol import Request, RequestError

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


@dataclass
class Delta:
    """Text committed by the decoder, split by channel; the last one carries the result."""

    reasoning: str = ""
    content: str = ""
    result: Result | None = None
    tokens: int = 0  # committed tokens behind this text
    draft: str | None = None  # with the result: the draft source used (None: plain decoding)


def tool_calls(content: str) -> tuple[str, list[dict[str, Any]]]:
    """Hermes/Qwen-style <tool_call>{"name", "arguments"}</tool_call> blocks -> OpenAI calls;
    malformed blocks stay in the content."""
    calls = []

    def take(match: re.Match[str]) -> str:
        try:
            call = json.loads(match[1])
        except json.JSONDecodeError:
            return match[0]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return match[0]
        calls.append({"id": f"call_{len(calls)}", "type": "function", "function": {
            "name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
        return ""

    return TOOL_CALL.sub(take, content).strip() if "<tool_call>" in content else content, calls


def usage(result: Result, draft: str | None = None) -> dict[str, Any]:
    """OpenAI usage, plus "mtp": the decoder's statistics, the draft source (None: plain
    decoding) and per source ("head", "lookup") its rounds and acceptance."""
    s = result.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": len(result.tokens),
            "total_tokens": s.prompt_tokens + len(result.tokens),
            "mtp": {"depth": s.depth, "acceptance_by_depth": s.acceptance_by_depth,
                    "mean_accepted": s.mean_accepted, "verify_calls": s.verify_calls,
                    "decode_tps": s.decode_tps, "ttft_s": s.ttft_s,
                    "prefill_tps": s.prefill_tps, "peak_memory_bytes": s.peak_memory_bytes,
                    "depths": {str(d): n for d, n in s.depths.items()},
                    "predicted_speedup": s.predicted_speedup, "draft": draft,
                    "sources": s.to_dict()["sources"]}}


class Service:
    """depth: the default of requests that name none: "auto" (chosen per round from this
    machine's measured costs, decoder/policy.py) or a number (0: plain decoding). draft: the
    default draft source, "head", "lookup" or "both" (None: as Runner.draft_source decides)."""

    def __init__(self, runner: Runner, model_id: str, depth: Depth, max_tokens: int,
                 draft: str | None = None) -> None:
        self.runner, self.model_id, self.depth, self.max_tokens = runner, model_id, depth, max_tokens
        self.draft = draft
        self.lock = threading.Lock()

    def _prompt(self, req: Request) -> tuple[list[int], bool]:
        """Token ids, and whether the rendered prompt leaves the model inside <think>. A request
        the bundle cannot take (ids off the vocabulary, messages its template refuses) is a 400:
        the template rendered doctor's standard conversation, so these messages are the cause."""
        if isinstance(req.prompt, list):
            vocab = self.runner.trunk.args.vocab_size
            bad = next((t for t in req.prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(400, f"prompt token id {bad} is outside the vocabulary "
                                   f"(size {vocab}: ids 0 to {vocab - 1})", "prompt")
        if not req.chat:
            return self.runner.encode(req.prompt), False
        if self.runner.template is None:
            raise RequestError(400, "this model has no usable chat template; use /v1/completions",
                               "messages")
        options: dict[str, Any] = {}
        if req.enable_thinking is not None:
            options["enable_thinking"] = req.enable_thinking
        if req.tools:
            options["tools"] = req.tools
        try:
            text = self.runner.render(req.messages, **options)
        except RENDER_ERRORS as exc:
            raise RequestError(400, describe_failure(exc), "messages") from None
        tokenizer = self.runner.tokenizer
        assert tokenizer is not None
        return list(tokenizer.encode(text, add_special_tokens=False)), text.rstrip().endswith(OPEN)

    def deltas(self, req: Request) -> Iterator[Delta]:
        """The prompt is prepared here, before the first delta is asked for, so that a request
        error is raised while the HTTP layer can still answer it with a status."""
        draft = req.draft or self.draft
        if draft == "head" and self.runner.head is None:
            raise RequestError(400, 'mtp_draft "head" drafts with an MTP head; this model has '
                               'none (use "lookup" or "both": context drafts)', "mtp_draft")
        ids, opened = self._prompt(req)
        depth = self.depth if req.depth is None else req.depth
        return self._generate(req, ids, opened, depth, draft)

    def _generate(self, req: Request, ids: list[int], opened: bool, depth: Depth,
                  draft: str | None) -> Iterator[Delta]:
        splitter = ChannelSplitter(opened) if req.chat else None
        used = self.runner.draft_source(depth, draft) if depth != 0 else None
        options = req.sampling | ({"draft": draft} if draft else {})
        with self.lock:
            for piece in self.runner.stream(ids, req.max_tokens, depth=depth, **options):
                if splitter is None:
                    delta = Delta(content=piece.text)
                else:
                    delta = Delta(*splitter.feed(piece.text))
                    if piece.result is not None:
                        reasoning, content = splitter.flush()
                        delta = Delta(delta.reasoning + reasoning, delta.content + content)
                delta.result, delta.tokens = piece.result, len(piece.tokens)
                delta.draft = used if piece.result is not None else None
                if delta.reasoning or delta.content or delta.tokens or delta.result is not None:
                    yield delta

