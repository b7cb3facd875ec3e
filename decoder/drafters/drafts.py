"""What a round verifies: a `Draft`, made by one of the drafters, never by the round itself.

Three drafters propose: the MTP head (`Session.head_draft`: it feeds the head the pairs it is
owed, then chains K draft steps on the device), the context (`Session.context_draft`, from
decoder/drafters/lookup.py's `ContextIndex.propose`), and a chain, which continues a head draft with the
context tokens that followed an earlier match of it (`chain`). `Session.round(draft)` verifies
any of them the same way, and what it learns goes back to the controller as a RoundOutcome.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx

from mtpkit.decoder.options import Source
from mtpkit.decoder.sampling import Candidates


@dataclass(frozen=True)
class Draft:
    """The last committed token and K drafts, with what the round needs to judge them."""

    tokens: mx.array  # (1, 1 + K): the last committed token, then the drafts
    q: Candidates | None  # sampled rounds: each draft's law (one-hot for context drafts)
    source: Source  # HEAD, LOOKUP or CHAIN
    drafted: int  # draft steps the head ran (context drafts cost none)
    match: int = 0  # the context match a context draft came from
    chained: tuple[int, ...] = ()  # per head block: cache entries the round trims afterwards
    rule: mx.array | None = None  # sampled rounds: the ratio tests' uniforms, then the token's

    @property
    def depth(self) -> int:
        return self.tokens.shape[1] - 1


def chain(draft: Draft, more: list[int]) -> Draft:
    """A head draft continued by context tokens `more` (whose q is one-hot)."""
    if not more:
        return draft
    q = None if draft.q is None else Candidates.concat([draft.q, Candidates.one_hot(more, draft.q)])
    return replace(draft, tokens=mx.concatenate([draft.tokens, mx.array([more])], axis=1), q=q,
                   source=Source.CHAIN)


def widened(tokens: mx.array, width: int) -> mx.array:
    """A draft's (1, n) tokens right-padded to `width` by repeating the last: padding rows are
    verified like rejected drafts and never kept."""
    extra = width - tokens.shape[1]
    return tokens if extra <= 0 else mx.concatenate([tokens] + [tokens[:, -1:]] * extra, axis=1)


def cut(draft: Draft, depth: int) -> Draft:
    """The draft's first `depth` drafts, judged as a draft of that depth (the round's uniforms
    keep their places): a verify pass that must end where the KV cache turns quantized."""
    if depth >= draft.depth:
        return draft
    return replace(draft, tokens=draft.tokens[:, :depth + 1],
                   q=None if draft.q is None else draft.q[:depth])
