"""Drafters behind one protocol: each proposes a `Draft`, and `Session.round` verifies any.

A proposer drafts after the last committed token (`propose`, None where it has nothing to
offer: no context match) and sees every committed token (`settle`: a drafter with state of its
own, a draft model's KV cache, keeps what the round kept and drops the rest). The MTP head's
state (the pairs it is owed, its caches) and the context index stay the session's, which every
path that commits feeds; their proposers only draft. At a fixed depth a session asks its
proposers in order and verifies the first draft offered (`Session.next_round`); under
`--depth auto` the controller chooses among them (decoder/rounds/controller.py).
"""

from __future__ import annotations

import weakref
from typing import Generic, Protocol, TypeVar

import mlx.core as mx

from mtpkit.decoder.drafters.drafts import Draft
from mtpkit.decoder.drafters.lookup import ContextIndex
from mtpkit.decoder.options import SamplingParams, Source


class Proposer(Protocol):
    """What a round's drafter does; `source` names its rounds (a Draft's source)."""

    source: Source

    def propose(self, depth: int) -> Draft | None: ...

    def settle(self, tokens: list[int]) -> None: ...


class Drafting(Protocol):
    """The parts of a session its proposers draft from (decoder/rounds/session.py's Session)."""

    last: int
    params: SamplingParams
    lookup: ContextIndex | None

    def round_noise(self, head_steps: int, drafts: int = 0
                    ) -> tuple[mx.array | None, mx.array | None]: ...

    def head_draft(self, depth: int) -> Draft: ...

    def context_draft(self, drafts: list[int], match: int) -> Draft: ...


S = TypeVar("S")


class SessionBound(Generic[S]):
    """A proposer of one session, which holds it: a weak reference back, so a finished
    generation's caches go when the session does (a reference cycle kept a 64K prompt's keys
    alive until Python's cyclic collector ran: gigabytes counted in the next request's
    memory)."""

    def __init__(self, session: S) -> None:
        self._session = weakref.ref(session)

    @property
    def session(self) -> S:
        session = self._session()
        assert session is not None, "a proposer outlived its session"
        return session


class HeadProposer(SessionBound[Drafting]):
    """The MTP head's drafts (Session.head_draft: fed the pairs it is owed, chained on the
    device). Its state is the session's, fed by every commit: nothing to settle."""

    source = Source.HEAD

    def propose(self, depth: int) -> Draft:
        return self.session.head_draft(depth)

    def settle(self, tokens: list[int]) -> None:
        pass


class ContextProposer(SessionBound[Drafting]):
    """What followed the longest earlier match of the text's end (decoder/drafters/lookup.py), up to
    `depth` tokens; None where the text offers no match. The session's index is extended by
    every commit: nothing to settle."""

    source = Source.LOOKUP

    def propose(self, depth: int) -> Draft | None:
        lookup = self.session.lookup
        if lookup is None or depth <= 0:
            return None
        drafts, match = lookup.propose(depth)
        return self.session.context_draft(drafts, match) if drafts else None

    def settle(self, tokens: list[int]) -> None:
        pass
