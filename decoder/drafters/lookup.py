"""Drafts from the context: what followed the longest earlier match of the text's last tokens.

Agents re-emit files with one edit, quote tool output and reuse identifiers: the continuation is
often already in the prompt or the output. The index maps every n-gram (n = 1..MAX_NGRAM) of the
committed tokens to where its latest earlier occurrence ended, updated as tokens are committed
(MAX_NGRAM dictionary writes per token), so a lookup tries the longest suffix first and proposes
the tokens that followed it. A lookup draft is deterministic given the text, so its q is one-hot
and the usual acceptance rule keeps decoding exact.
"""

from __future__ import annotations

MAX_NGRAM = 8
MIN_NGRAM = 1


class ContextIndex:
    """The committed tokens and, per n-gram length, the continuation start of its latest
    occurrence (n-grams are indexed one token late, so a lookup never matches itself)."""

    def __init__(self, max_ngram: int = MAX_NGRAM) -> None:
        self.tokens: list[int] = []
        self.max_ngram = max_ngram
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            last = len(self.tokens) - 2  # the n-grams ending one token back now have a follower
            for n in range(1, min(self.max_ngram, last + 1) + 1):
                self.ends[n][tuple(self.tokens[last - n + 1:last + 1])] = last + 1

    def propose(self, width: int, min_ngram: int = MIN_NGRAM,
                after: list[int] | None = None) -> tuple[list[int], int]:
        """(`width` tokens that followed the longest earlier match of the text's suffix, the
        match length); ([], 0) when no suffix of min_ngram tokens or more occurred before.
        `after`: tokens not committed yet (a head's drafts) that end the text for this lookup."""
        text = self.tokens + after if after else self.tokens
        size = len(text)
        for n in range(min(self.max_ngram, size), min_ngram - 1, -1):
            start = self.ends[n].get(tuple(text[size - n:]))
            if start is not None:  # running past the end continues with the proposal
                out: list[int] = []  # itself: a text repeating with period p goes on so
                for j in range(start, start + width):
                    out.append(text[j] if j < size else out[j - size])
                return out, n
        return [], 0
