"""One loaded bundle answering requests: chat rendering (thinking switch, tools), the reasoning
channel, stop sequences, tool calls, usage with MTP statistics, the prefix cache and metrics.
One generation at a time (MLX state is not shared across threads), in arrival order
(serve/worker.py); a generation whose client went away ends at the next round."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from mtpkit.decoder.cache.caches import exportable, trimmable
from mtpkit.decoder.cache.prefix import FOLLOW_UP, PrefixCache, turn_end
from mtpkit.decoder.options import DecodeOptions, OptionError, batch_option
from mtpkit.decoder.rounds.scheduler import Event
from mtpkit.decoder.rounds.scheduler import Request as Batched
from mtpkit.decoder.runner import NO_TEMPLATE, Depth, Piece, Result, Runner
from mtpkit.loaders.findings import UserError
from mtpkit.loaders.templates import RENDER_ERRORS, describe_failure
from mtpkit.serve.channels import OPEN, ChannelSplitter, Delta, StopScanner
from mtpkit.serve.metrics import Metrics
from mtpkit.serve.protocol import Request, RequestError, load_json, refused
from mtpkit.serve.worker import Ticket, Worker

MAX_QUEUE = 16  # requests that may wait behind the running one by default

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def tool_calls(content: str) -> tuple[str, list[dict[str, Any]]]:
    """Hermes/Qwen-style <tool_call>{"name", "arguments"}</tool_call> blocks -> OpenAI calls;
    malformed blocks stay in the content. A model writes what it likes, so a block is parsed
    as strictly as a request body (serve/protocol.py's load_json: no NaN or Infinity, bounded
    nesting and integers, checked before the parser can recurse or convert), and the calls go
    out as strict JSON."""
    calls = []

    def take(match: re.Match[str]) -> str:
        try:
            call = load_json(match[1].encode("utf-8", "surrogatepass"))
        except RequestError:
            return match[0]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return match[0]
        calls.append({"id": f"call_{len(calls)}", "type": "function", "function": {
            "name": call["name"],
            "arguments": json.dumps(call.get("arguments", {}), allow_nan=False)}})
        return ""

    return TOOL_CALL.sub(take, content).strip() if "<tool_call>" in content else content, calls


def usage(result: Result, draft: str | None = None, cached: bool = False) -> dict[str, Any]:
    """OpenAI usage, plus "mtp": the decoder's statistics, the draft source (None: plain
    decoding), per source ("head", "lookup") its rounds and acceptance, and the prompt tokens
    prefilled and read from the prefix cache (None: the request went without one)."""
    s = result.stats
    prompt = s.prompt_tokens + result.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": len(result.tokens),
            "total_tokens": prompt + len(result.tokens),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            "mtp": {"depth": s.depth, "drafted_depth": s.drafted_depth,
                    "acceptance_by_depth": s.acceptance_by_depth,
                    "mean_accepted": s.mean_accepted, "verify_calls": s.verify_calls,
                    "decode_tps": s.decode_tps, "ttft_s": s.ttft_s,
                    "prefill_tps": s.prefill_tps, "peak_memory_bytes": s.peak_memory_bytes,
                    "prefill_tokens": s.prompt_tokens,
                    "cached_tokens": result.cached_tokens if cached else None,
                    "depths": {str(d): n for d, n in s.depths.items()},
                    "predicted_speedup": s.predicted_speedup, "draft": draft,
                    "sources": s.to_dict()["sources"]}}


class Service:
    """depth: the default of requests that name none: "auto" (chosen per round from this
    machine's measured costs, decoder/tuning/policy.py) or a number (0: plain decoding). draft: the
    default draft source, "head", "lookup", "both" or "model" (None: as Runner.draft_source decides).
    cache_bytes: the prefix cache's bound (0: no cache); max_queue: requests that may wait."""

    def __init__(self, runner: Runner, model_id: str, depth: Depth, max_tokens: int,
                 draft: str | None = None, cache_bytes: int = 0,
                 max_queue: int = MAX_QUEUE, max_batch: int = 1) -> None:
        self.runner, self.model_id, self.depth, self.max_tokens = runner, model_id, depth, max_tokens
        self.draft = draft
        caches = runner.trunk.make_cache()
        self.prefix = PrefixCache(cache_bytes) if cache_bytes > 0 and exportable(caches) else None
        self.trimmable = trimmable(caches)
        self.max_batch = (batch_option(max_batch, runner.kv, runner.unbatchable)
                          if "shard" not in runner.load_options else 1)
        prefix = self.prefix
        self.metrics = Metrics(lambda: self.queue.depth, lambda: self.queue.busy,
                               lambda: prefix.nbytes if prefix else 0,
                               lambda: len(prefix) if prefix else 0,
                               lambda: len(self.queue.batch))
        batcher = (lambda: runner.scheduler(self.max_batch)) if self.max_batch > 1 else None
        # the line of requests, and the worker serving it
        self.queue = Worker(max_queue, self.max_batch, batcher, self.metrics.rows_per_pass.observe)

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
        if self.runner.template is None:  # Runner.render's rule, as a 400 before any work
            raise RequestError(400, f"{NO_TEMPLATE}; use /v1/completions", "messages",
                               code=self.runner.template_code)
        try:
            text = self._render(req, req.messages)
        except RENDER_ERRORS as exc:
            raise RequestError(400, describe_failure(exc), "messages") from None
        return self._encode(text), text.rstrip().endswith(OPEN)

    def _render(self, req: Request, messages: list[dict[str, Any]]) -> str:
        """`messages` through the bundle's template with the request's template options."""
        options: dict[str, Any] = {}
        if req.enable_thinking is not None:
            options["enable_thinking"] = req.enable_thinking
        if req.tools:
            options["tools"] = req.tools
        return self.runner.render(messages, **options)

    def _encode(self, text: str) -> list[int]:
        assert self.runner.tokenizer is not None
        return list(self.runner.tokenizer.encode(text, add_special_tokens=False))

    def _turn_end(self, req: Request, ids: list[int]) -> list[int]:
        """The prefix cache's checkpoint for this chat turn (decoder/cache/prefix.py's turn_end),
        where recurrent states cannot be trimmed back to it."""
        if self.prefix is None or not req.chat or self.trimmable:
            return []
        try:
            return turn_end(ids, self._encode(self._render(req, [*req.messages, *FOLLOW_UP])))
        except RENDER_ERRORS:
            return []

    def deltas(self, req: Request, gone: Callable[[], bool] | None = None,
               tenant: str = "") -> Ticket:
        """The prompt is prepared and the request admitted to the queue here, before the first
        delta is asked for, so that a request error or a full queue (QueueFull) is raised
        while the HTTP layer can still answer it with a status. gone(): the client went away
        (asked while waiting and after each round). tenant: the client's partition of the
        prefix cache (serve: its API key), split further by the request's cache_salt."""
        draft = req.draft or self.draft
        try:  # as every entry checks them (decoder/options.py)
            DecodeOptions.of(self.depth if req.depth is None else req.depth, draft,
                             **req.sampling).source(self.runner.head is not None,
                                                    self.runner.unsupported)
        except OptionError as err:
            raise refused(err) from None
        ids, opened = self._prompt(req)
        try:  # before the queue: an over-long prompt costs no model work and no turn
            self.runner.check_prompt(len(ids))
        except UserError as err:
            raise RequestError(400, str(err), "messages" if req.chat else "prompt",
                               code=err.code) from None
        depth = self.depth if req.depth is None else req.depth
        marks = self._turn_end(req, ids)
        scope = (tenant, req.cache_salt)
        ticket = self.queue.enter(gone)
        ticket.deltas = self._generate(req, ids, opened, depth, draft, marks, scope, ticket.gone)
        if self.queue.max_batch > 1:
            ticket.join = lambda: self._join(req, ids, opened, depth, draft, marks, scope,
                                             ticket.gone)
        return ticket

    def _join(self, req: Request, ids: list[int], opened: bool, depth: Depth,
              draft: str | None, marks: list[int], scope: tuple[str, str | None],
              gone: Callable[[], bool]) -> tuple[Batched, Callable[[Event], list[Delta]]]:
        """A generation for the batch (serve/worker.py): its prepared request, and how its
        events become deltas (as _generate makes them from a lone stream)."""
        shaper = Shaper(self, req, opened, depth, draft, scope)
        request = self.runner.prepare(ids, req.max_tokens, depth=depth, prefix=shaper.prefix,
                                      stop=lambda: shaper.stopped() or gone(),
                                      checkpoints=marks, **shaper.options)
        pieces = self.runner.texts(request)

        def shape(event: Event) -> list[Delta]:
            return [d for p in pieces(event) if (d := shaper.feed(p)) is not None]

        return request, shape

    def _generate(self, req: Request, ids: list[int], opened: bool, depth: Depth,
                  draft: str | None, marks: list[int], scope: tuple[str, str | None],
                  gone: Callable[[], bool]) -> Iterator[Delta]:
        """The deltas of one generation (the ticket has its turn before the first is asked
        for, and the worker gives its place back after the last: serve/worker.py)."""
        shaper = Shaper(self, req, opened, depth, draft, scope)
        try:
            for piece in self.runner.stream(ids, req.max_tokens, depth=depth,
                                            prefix=shaper.prefix,
                                            stop=lambda: shaper.stopped() or gone(),
                                            checkpoints=marks, **shaper.options):
                delta = shaper.feed(piece)
                if delta is not None:
                    yield delta
        finally:
            shaper.close()


class Shaper:
    """One generation's pieces as deltas: the reasoning channel split off, stop sequences
    cut (and the tokens past them not billed), the draft source and prefix cache noted, and
    its metrics counted. scope: its partition of the prefix cache."""

    def __init__(self, service: Service, req: Request, opened: bool, depth: Depth,
                 draft: str | None, scope: tuple[str, str | None] = ("", None)) -> None:
        self.metrics = service.metrics
        self.tokenizer = service.runner.tokenizer
        self.opened = opened
        self.splitter = ChannelSplitter(opened) if req.chat else None
        self.stops = StopScanner(req.stop) if req.stop else None
        self.used = service.runner.draft_source(depth, draft) if depth != 0 else None
        self.options = req.sampling | ({"draft": draft} if draft else {})
        prefix = service.prefix if req.prefix_cache else None
        self.prefix = prefix.partition(scope) if prefix is not None else None
        self.sent = 0  # tokens sent and not yet counted

    def stopped(self) -> bool:
        """A stop sequence was seen: the generation ends there."""
        return self.stops is not None and self.stops.hit is not None

    def feed(self, piece: Piece) -> Delta | None:
        splitter, stops = self.splitter, self.stops
        delta = Delta(content=piece.text) if splitter is None else \
            Delta(*splitter.feed(piece.text))
        if piece.result is not None and splitter is not None:
            reasoning, content = splitter.flush()
            delta = Delta(delta.reasoning + reasoning, delta.content + content)
        result = piece.result
        if stops is not None:
            delta.content = stops.feed(delta.content)
            if result is not None:
                delta.content += stops.flush()
                delta.stop_sequence = stops.hit
                if stops.hit is not None:
                    result = self._billed(result)
        delta.result, delta.tokens = result, len(piece.tokens)
        delta.draft = self.used if result is not None else None
        delta.cached = result is not None and self.prefix is not None
        self.sent += delta.tokens
        if result is not None:
            self.metrics.generation(result, self.prefix is not None)
            self.sent = 0
        if delta.reasoning or delta.content or delta.tokens or delta.result is not None:
            return delta
        return None

    def _hit(self, tokens: list[int]) -> bool:
        """Whether the content of `tokens` holds a stop sequence, read as feed reads it."""
        assert self.tokenizer is not None and self.stops is not None
        text = self.tokenizer.decode(tokens)
        content = ChannelSplitter(self.opened).feed(text)[1] if self.splitter else text
        scanner = StopScanner(self.stops.stops)
        scanner.feed(content)
        return scanner.hit is not None

    def _billed(self, result: Result) -> Result:
        """A result a stop sequence ended, as billed: its tokens up to the one that completed
        the stop sequence, at any depth. The round that completed it committed the drafts
        kept past it too (and a detokenizer may show a token's text a token late), so the
        decoder's count depends on the depth; this one does not. The shortest such prefix
        (bisected: a hit stays a hit as tokens are added); usage.mtp still describes every
        round the decoder ran. Where decoding the tokens does not find the stop the streamed
        text found, the result is left as it is."""
        tokens = result.tokens
        if self.tokenizer is None or not self._hit(tokens):
            return result
        miss, hit = 0, len(tokens)
        while hit - miss > 1:
            mid = (miss + hit) // 2
            miss, hit = (miss, mid) if self._hit(tokens[:mid]) else (mid, hit)
        return replace(result, tokens=tokens[:hit], finish_reason="stop")

    def close(self) -> None:
        """A generation given up: count what it made."""
        self.metrics.completion_tokens.inc(self.sent)
        self.sent = 0
