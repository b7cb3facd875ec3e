"""Why depth-1 drafts missed: text the context already held, a token the head cannot draft, or
neither.

A one-layer head sees the trunk hidden at t and the token at t+1. To copy a span the text has
already shown it must find the earlier occurrence through keys built from the trunk's final
hidden, whose current-token signal is weak, so small trunks' greedy loops (the same line again
and again) are missed although a lookup in the context would draft them. Counting those misses
says how much of the gap is copying (docs/benchmarks-history.md, issue 5).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

LOOKUP_N = 3  # match the last three tokens, as prompt-lookup drafting does


def lookup_sources(seq: Sequence[int], n: int = LOOKUP_N) -> list[int]:
    """For every end in 0..len(seq): the index of the token that followed the latest earlier
    occurrence of seq[end - n:end] inside seq[:end], or -1 when those n tokens have not occurred
    before. One pass with a table of the n-grams seen so far."""
    latest: dict[tuple[int, ...], int] = {}
    out = [-1] * (len(seq) + 1)
    for end in range(n + 1, len(seq) + 1):
        latest[tuple(seq[end - n - 1:end - 1])] = end - n - 1  # its follower is seq[end - 1]
        start = latest.get(tuple(seq[end - n:end]), -1)
        out[end] = start + n if start >= 0 else -1
    return out


def classify(seq: Sequence[int], rounds: Sequence[tuple[int, bool]],
             draft_vocab: Collection[int] | None = None) -> Counter[str]:
    """Count depth-1 rounds by outcome. `rounds` holds (position in seq of the drafted token,
    accepted); a missed round is "copyable" when the lookup would have drafted seq[position],
    else "out_of_vocab" when that token is outside the draft vocabulary, else "other"."""
    counts: Counter[str] = Counter()
    sources = lookup_sources(seq)
    for position, accepted in rounds:
        copied = sources[position] >= 0 and seq[sources[position]] == seq[position]
        if accepted:
            counts["accepted_copyable" if copied else "accepted_other"] += 1
        elif copied:
            counts["missed_copyable"] += 1
        elif draft_vocab is not None and seq[position] not in draft_vocab:
            counts["missed_out_of_vocab"] += 1
        else:
            counts["missed_other"] += 1
    return counts
