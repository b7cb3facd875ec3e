"""One answer as verify-run observed it, from an endpoint or a local bundle, and the honest
speed arithmetic over it: tokens from usage or ids, never chunks; decode tok/s over the
decode window; the steady window after the first tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Chunk:
    at: float  # seconds since the request was sent
    content: str = ""
    reasoning: str = ""
    tokens: int | None = None  # known locally; endpoints do not say


@dataclass
class Answer:
    content: str
    reasoning: str
    tokens: int | None  # completion tokens, from usage (endpoint) or ids (local)
    prompt_tokens: int | None
    finish_reason: str | None
    chunks: list[Chunk] = field(default_factory=list)  # streamed answers only
    mtp: dict[str, Any] | None = None  # acceptance etc., when the server reports it
    peak_memory_bytes: int | None = None
    ids: list[int] | None = None  # local bundles only
    cached_tokens: int | None = None  # prompt tokens read from a prefix cache, where reported

    @property
    def text_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.content or c.reasoning]

    @property
    def ttft_s(self) -> float | None:
        chunks = self.text_chunks
        return chunks[0].at if chunks else None

    def token_times(self) -> list[float]:
        """Arrival time of every completion token. Locally exact; for an endpoint the usage
        count is spread over the chunks in proportion to their text (a chunk carrying three
        tokens carries three times the text), the best an OpenAI stream allows."""
        if self.chunks and all(c.tokens is not None for c in self.chunks):
            return [c.at for c in self.chunks for _ in range(c.tokens or 0)]
        chunks = self.text_chunks
        if not chunks or not self.tokens:
            return []
        sizes = [len(c.content) + len(c.reasoning) for c in chunks]
        total = sum(sizes)
        times, seen = [], 0
        for chunk, size in zip(chunks, sizes, strict=True):
            seen += size
            while len(times) < round(self.tokens * seen / total):
                times.append(chunk.at)
        return times

    def decode_tps(self, drop: int = 0) -> float | None:
        """(n - 1) / (last - first) over the tokens after the first `drop` (all of them when
        fewer than drop + 8 arrived)."""
        times = self.token_times()
        window = times[drop:] if len(times) > drop + 8 else times
        if len(window) < 2 or window[-1] <= window[0]:
            return None
        return (len(window) - 1) / (window[-1] - window[0])

    @property
    def prefill_tps(self) -> float | None:
        ttft = self.ttft_s
        return self.prompt_tokens / ttft if self.prompt_tokens and ttft else None
