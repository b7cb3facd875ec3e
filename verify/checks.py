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


def counting_check(whole: Answer, streamed: Answer, source: str) -> Check:
    """Tokens come from usage or ids; chunks are not tokens. A count that cannot be trusted
    fails."""
    chunks = len(streamed.text_chunks)
    evidence = {"tokens": streamed.tokens, "source": source, "chunks": chunks,
                "tokens_non_streaming": whole.tokens}
    if streamed.tokens is None:
        return Check("counting", FAIL, "the stream reports no usage: its tokens cannot be "
                     f"counted (only {chunks} chunks, which are not tokens)", evidence)
    if chunks > streamed.tokens:
        return Check("counting", FAIL, f"{chunks} text chunks for {streamed.tokens} reported "
                     "tokens: the token count is wrong", evidence)
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
