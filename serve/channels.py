"""Reasoning and content channels, as the chat template defines them, and stop sequences.

When the rendered prompt ends inside `<think>` (Qwen3.5-style templates with thinking on), the
model's text up to `</think>` is reasoning; a `<think>` block the model opens itself before any
content is reasoning too. Markers and stop sequences split across streamed pieces are held back
until resolved, so a stream never shows text a non-streamed answer would not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtpkit.decoder.runner import Result

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class Delta:
    """Text committed by the decoder, split by channel; the last one carries the result (here,
    below the service that makes them and the worker that carries them, so neither imports
    the other's module)."""

    reasoning: str = ""
    content: str = ""
    result: Result | None = None
    tokens: int = 0  # committed tokens behind this text
    draft: str | None = None  # with the result: the draft source used (None: plain decoding)
    stop_sequence: str | None = None  # with the result: the stop sequence that ended it
    cached: bool = False  # with the result: the prompt went through the prefix cache


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of text that could start `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ChannelSplitter:
    def __init__(self, prompt_opened_reasoning: bool) -> None:
        self.reasoning = prompt_opened_reasoning
        self.buffer = ""
        self.content_started = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) ready to send after `text`."""
        self.buffer += text
        reasoning, content = [], []
        while True:
            if not self.reasoning and not self.content_started:
                stripped = self.buffer.lstrip()
                if stripped.startswith(OPEN):
                    self.buffer, self.reasoning = stripped[len(OPEN):], True
                    continue
                if OPEN.startswith(stripped):  # could still become <think>
                    return "".join(reasoning), ""
            marker = CLOSE if self.reasoning else None
            if marker and (at := self.buffer.find(marker)) >= 0:
                reasoning.append(self.buffer[:at])
                self.buffer, self.reasoning = self.buffer[at + len(marker):].lstrip(), False
                continue
            keep = _held_back(self.buffer, marker) if marker else 0
            ready, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            (reasoning if self.reasoning else content).append(ready)
            break
        out = "".join(content)
        if not self.content_started:  # content never opens with the gap after </think>
            out = out.lstrip()
            self.content_started = bool(out)
        return "".join(reasoning), out

    def flush(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.reasoning:
            return rest, ""
        return "", rest if self.content_started else rest.lstrip()


class StopScanner:
    """Content up to the first of `stops`; `hit` is the stop sequence found (None: none)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.buffer, self.hit = stops, "", None

    def feed(self, text: str) -> str:
        if self.hit is not None:
            return ""
        self.buffer += text
        found = [(at, s) for s in self.stops if (at := self.buffer.find(s)) >= 0]
        if found:
            at, self.hit = min(found)
            out, self.buffer = self.buffer[:at], ""
            return out
        keep = max(_held_back(self.buffer, s) for s in self.stops)
        out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return out

    def flush(self) -> str:
        rest, self.buffer = self.buffer, ""
        return rest if self.hit is None else ""
