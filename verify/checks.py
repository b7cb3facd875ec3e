"""The verdicts verify-run gives, each from evidence it gathered: pure functions over Answers
so every rule is testable on its own."""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from mtpkit.verify.answer import Answer

PASS, FAIL, INFO = "pass", "fail", "info"
MIN_DISTINCT_TRIGRAMS = 0.5  # below this share of distinct word 3-grams, an answer loops


@dataclass
class Check:
    name: str
    status: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def distinct_trigrams(text: str) -> float | None:
    words = re.findall(r"\w+|[^\w\s]", text.lower())
    grams = list(zip(words, words[1:], words[2:], strict=False))
    return len(set(grams)) / len(grams) if len(grams) >= 10 else None


def answer_check(name: str, answer: Answer, what: str) -> Check:
    """Non-empty, in the content channel, not looping."""
    evidence = {"content_chars": len(answer.content), "reasoning_chars": len(answer.reasoning),
                "finish_reason": answer.finish_reason, "content_head": answer.content[:160]}
    if not answer.content.strip():
        where = ("the answer went only to the reasoning channel" if answer.reasoning.strip()
                 else "the answer is empty")
        return Check(name, FAIL, f"{what}: {where}", evidence)
    share = distinct_trigrams(answer.content)
    evidence["distinct_trigrams"] = share
    if share is not None and share < MIN_DISTINCT_TRIGRAMS:
        return Check(name, FAIL, f"{what}: degenerate, {100 * share:.0f}% distinct word "
                     "3-grams (the answer repeats itself)", evidence)
    return Check(name, PASS, f"{what}: {len(answer.content)} chars of content", evidence)


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def streaming_check(whole: Answer, streamed: Answer) -> Check:
    """The concatenated stream must equal the non-streaming answer to the same greedy request."""
    evidence = {"stream_chunks": len(streamed.text_chunks), "stream_chars": len(streamed.content),
                "whole_chars": len(whole.content), "stream_tokens": streamed.tokens,
                "whole_tokens": whole.tokens}
    for channel in ("content", "reasoning"):
        a, b = getattr(whole, channel), getattr(streamed, channel)
        if a != b:
            at = _first_difference(a, b)
            evidence |= {"channel": channel, "first_difference_at": at,
                         "whole_near": a[at:at + 40], "stream_near": b[at:at + 40]}
            lost = len(a) - len(b)
            more = f"; {lost} chars lost" if lost > 0 else ""
            return Check("streaming", FAIL, f"the stream's {channel} differs from the "
                         f"non-streaming answer at char {at}{more}", evidence)
    return Check("streaming", PASS, f"stream equals the non-streaming answer "
                 f"({len(streamed.text_chunks)} chunks)", evidence)


SPECIAL_TOKENS = 16  # tokens an answer may spend without text (think tags, end of turn)


def usage_doubt(answer: Answer, max_tokens: int) -> str | None:
    """Why an answer's reported token count cannot be true (None: it can): above the
    max_tokens asked, fewer tokens than text chunks (each chunk carries at least one), or more
    tokens than bytes of text streamed (each token's text is at least a byte, but for a few
    special tokens)."""
    tokens = answer.tokens
    if tokens is None:
        return None
    if tokens > max_tokens:
        return f"usage reports {tokens} tokens, above the max_tokens {max_tokens} asked"
    chunks = len(answer.text_chunks)
    if chunks > tokens:
        return f"{chunks} text chunks for {tokens} reported tokens"
    text = len((answer.content + answer.reasoning).encode())
    if tokens > text + SPECIAL_TOKENS:
        return f"usage reports {tokens} tokens for {text} bytes of text"
    return None


def counting_check(whole: Answer, streamed: Answer, source: str, max_tokens: int) -> Check:
    """Tokens come from usage or ids; chunks are not tokens. A count that cannot be trusted
    (missing, more chunks than tokens, or usage that disagrees with what was streamed or
    asked: `usage_doubt`) fails."""
    chunks = len(streamed.text_chunks)
    evidence = {"tokens": streamed.tokens, "source": source, "chunks": chunks,
                "tokens_non_streaming": whole.tokens, "max_tokens": max_tokens}
    if streamed.tokens is None:
        return Check("counting", FAIL, "the stream reports no usage: its tokens cannot be "
                     f"counted (only {chunks} chunks, which are not tokens)", evidence)
    if chunks > streamed.tokens:
        return Check("counting", FAIL, f"{chunks} text chunks for {streamed.tokens} reported "
                     "tokens: the token count is wrong", evidence)
    for what, answer in (("streamed", streamed), ("non-streaming", whole)):
        if source == "usage" and (doubt := usage_doubt(answer, max_tokens)) is not None:
            return Check("counting", FAIL, f"{what} answer: {doubt}: the token count is wrong",
                         evidence)
    if whole.tokens is not None and whole.tokens != streamed.tokens:
        return Check("counting", FAIL, f"usage differs: {whole.tokens} tokens non-streaming, "
                     f"{streamed.tokens} streaming", evidence)
    per = streamed.tokens / chunks if chunks else 0.0
    evidence["tokens_per_chunk"] = per
    return Check("counting", PASS, f"{streamed.tokens} tokens ({source}) in {chunks} chunks, "
                 f"{per:.2f} tokens/chunk; tok/s counts tokens", evidence)


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p95": p95, "n": len(ordered)}


def _difference(a: Answer, b: Answer) -> dict[str, Any] | None:
    """Where two answers first differ (channel, char, the text near it); None: equal."""
    for channel in ("content", "reasoning"):
        x, y = getattr(a, channel), getattr(b, channel)
        if x != y:
            at = _first_difference(x, y)
            return {"channel": channel, "first_difference_at": at, "a_near": x[at:at + 40],
                    "b_near": y[at:at + 40]}
    return None


def prefix_cache_check(cold: Answer, warm: Answer, cached: int, cold_cached: Any) -> Check:
    """A second turn over a cached prefix: some of its prompt read from the cache, its first
    token sooner than the same turn prefilled cold, and the same text."""
    ttft_warm, ttft_cold = warm.ttft_s, cold.ttft_s
    evidence = {"cached_tokens": cached, "prompt_tokens": warm.prompt_tokens,
                "ttft_warm_s": ttft_warm, "ttft_cold_s": ttft_cold,
                "ttft_ratio": ttft_warm / ttft_cold if ttft_warm and ttft_cold else None}
    if not cached:
        return Check("prefix_cache", FAIL, "the second turn read nothing from the prefix cache",
                     evidence)
    if cold_cached:
        return Check("prefix_cache", FAIL, f"the cold reference still read {cold_cached} "
                     "cached tokens (\"prefix_cache\": false was not honoured)", evidence)
    if (differs := _difference(cold, warm)) is not None:
        evidence |= differs
        return Check("prefix_cache", FAIL, f"the cached turn's {differs['channel']} differs from "
                     f"the cold one at char {differs['first_difference_at']}", evidence)
    if ttft_warm is None or ttft_cold is None or ttft_warm >= ttft_cold:
        return Check("prefix_cache", FAIL, "the cached turn's first token came no sooner than "
                     "the cold one's", evidence)
    return Check("prefix_cache", PASS, f"second turn: {cached} of {warm.prompt_tokens} prompt "
                 f"tokens cached, TTFT {1000 * ttft_warm:.0f} ms vs {1000 * ttft_cold:.0f} ms "
                 f"cold ({ttft_warm / ttft_cold:.2f}x), same text", evidence)


def anthropic_check(whole: Answer, streamed: Answer, chat: Answer) -> Check:
    """The Messages API: its stream equals its whole answer, and both equal the chat API's
    answer to the same greedy conversation, with the same token counts in usage."""
    evidence = {"output_tokens": whole.tokens, "stream_output_tokens": streamed.tokens,
                "chat_completion_tokens": chat.tokens, "input_tokens": whole.prompt_tokens,
                "chat_prompt_tokens": chat.prompt_tokens, "stream_events": len(streamed.chunks)}
    for name, other in (("stream", streamed), ("chat API's answer", chat)):
        if (differs := _difference(whole, other)) is not None:
            evidence |= differs
            return Check("anthropic", FAIL, f"the Messages API's {differs['channel']} differs "
                         f"from the {name} at char {differs['first_difference_at']}", evidence)
    if whole.tokens is None or not whole.tokens == streamed.tokens == chat.tokens:
        return Check("anthropic", FAIL, "usage.output_tokens differs: "
                     f"{whole.tokens} whole, {streamed.tokens} streamed, {chat.tokens} in the "
                     "chat API's completion_tokens", evidence)
    if whole.prompt_tokens != chat.prompt_tokens:
        return Check("anthropic", FAIL, f"input tokens differ: {whole.prompt_tokens} (Messages) "
                     f"vs {chat.prompt_tokens} (chat)", evidence)
    return Check("anthropic", PASS, f"Messages API: stream equals the whole answer and the chat "
                 f"API's, {whole.tokens} output tokens in every usage", evidence)
