"""`--depth auto` for a lone session: the depth policy (decoder/tuning/policy.py) decides each round.

Before each round it chooses the source and depth (priced at the session's context); the session
verifies and commits what it is given and returns a RoundOutcome; the controller then tells the
policy what the round kept and paid. Where plain decoding wins it runs pipelined plain steps for
as long as the policy, asked again after each, still prefers them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from mtpkit.decoder.cache.caches import extent
from mtpkit.decoder.drafters.drafts import Draft, chain
from mtpkit.decoder.options import Source
from mtpkit.decoder.rounds.session import RoundOutcome, Session
from mtpkit.decoder.stats import Stats
from mtpkit.decoder.tuning.costs import check_plain
from mtpkit.decoder.tuning.policy import DepthPolicy, memory

CHAIN_MIN_NGRAM = 2  # after the head's guess, a one-token match says little of what follows


class Controller:
    """Decides every round of one session under `policy`, and learns from their outcomes."""

    def __init__(self, session: Session, policy: DepthPolicy) -> None:
        self.session, self.policy = session, policy
        self.switched = True  # no round since the prefill or a plain stretch
        self.interrupt: Callable[[], bool] | None = None  # ends plain stretches early (a batch
        # wants the session: decoder/rounds/scheduler.py)

    def choose(self, most: int) -> tuple[Source | None, int, list[int], int]:
        """(source, or None for plain decoding; depth, context drafts, their match length) for
        the next round, up to `most` drafts (priced at the session's context)."""
        self.price()
        lookup = self.session.lookup
        drafts, match = lookup.propose(min(most, self.policy.max_depth)) if lookup else ([], 0)
        source, depth = self.policy.choose(len(drafts), match=match)
        return source, min(depth, most), drafts, match

    def price(self) -> None:
        """The policy asks the curve at the session's context from now on (a stretch's steps
        and a round's are predicted, and what they pay compared, there)."""
        self.policy.context = context(self.session)
        self.session.stats.plain_s = self.policy.cost(0)

    def extend(self, draft: Draft, most: int) -> Draft:
        """A head draft continued by context tokens (a chain round, at most `most` drafts in
        all): what followed an earlier match of the text ending in its drafts, as many as the
        policy finds worth their verify rows. Costs a host read of the drafts, so only where
        the policy would take some."""
        session, policy, depth = self.session, self.policy, draft.depth
        room = min(most, session.depth) - depth
        if session.lookup is None or room <= 0 or not policy.extension(depth, room):
            return draft
        more, _ = session.lookup.propose(room, CHAIN_MIN_NGRAM,
                                         after=draft.tokens.tolist()[0][1:])
        return chain(draft, more[:policy.extension(depth, len(more))])

    def draft(self, depth: int, most: int | None = None) -> Draft:
        """The head's `depth` drafts, continued from the context up to `most` in all."""
        return self.extend(self.session.head_draft(depth), depth if most is None else most)

    def proposed(self, source: Source | None, depth: int, drafts: list[int], match: int,
                 most: int) -> Draft:
        """The chosen round's draft: the context's `drafts` (from a `match`-token match), the
        draft model's, or the head's continued from the context up to `most` (depth 0: one
        plain step through the verify path)."""
        session = self.session
        if source == Source.LOOKUP and depth > 0 and drafts:
            return session.context_draft(drafts[:depth], match)
        if source == Source.MODEL and depth > 0 and session.model is not None:
            return session.model.propose(depth) or session.head_draft(0)
        return self.draft(max(depth, 0), most)

    def round(self, draft: Draft) -> RoundOutcome:
        outcome = self.session.round(draft, self.policy.priced.width(draft.depth + 1))
        self.update(outcome)
        return outcome

    def update(self, outcome: RoundOutcome) -> None:
        """What a verified round kept and paid, into the policy (the first head round after
        the prefill or a plain stretch also paid the switch, the head fed the pairs it was
        owed: its cost is left out; a context round feeds the head nothing and counts)."""
        if outcome.depth > 0:
            policy, o = self.policy, outcome
            policy.record(o.depth, o.kept, o.source, o.drafted, o.match)
            fed = o.source != Source.LOOKUP  # the head was fed the pairs owed (a context
            # round leaves them for the next head round)
            if not (fed and self.switched):
                # the shape a pass may have compiled: the caches as it left them
                session = self.session
                fresh = session.trunk.first_pass((o.source, o.width, o.owed if fed else 0,
                                                  extent(session.cache),
                                                  extent(session.mtp_cache)))
                policy.observe_round(o.paid_s, o.depth, o.source, o.drafted, fresh, o.width)
            else:
                policy.costs.tick(1)
            self.session.stats.predicted_s += policy.cost(o.depth, o.source, o.drafted)
        self.switched = False

    def rounds(self, left: Callable[[], int]) -> Iterator[list[int]]:
        """Committed token batches, round after round, as the policy chooses. `left()`: tokens
        still wanted."""
        while True:
            source, depth, drafts, match = self.choose(left() - 1)
            wanted = self.interrupt is not None and self.interrupt()  # a clean point owed
            if depth > 0 or left() <= 1 or wanted:
                yield self.round(self.proposed(source, depth, drafts, match, left() - 1)
                                 ).committed
                continue
            # timed every memory() steps, and before the generation's last token
            yield from self._stretch(min(left(), memory()),
                                     lambda: self.choose(left() - 1)[1] > 0, left)
            self.switched = True

    def _stretch(self, count: int, stop: Callable[[], bool],
                 left: Callable[[], int]) -> Iterator[list[int]]:
        """Pipelined plain steps until `stop()`, timed for the policy when they end or
        before the one that ends the generation (its consumer stops asking there)."""
        policy, session = self.policy, self.session
        if self.interrupt is not None:
            stop = _either(self.interrupt, stop)
        timed = False
        for token in session.plain_steps(count, stop):
            policy.plain()
            policy.costs.tick(1)
            session.stats.predicted_s += policy.cost(0)
            if left() <= 1:
                self._observe_plain()
                timed = True
            yield [token]
        if not timed:
            self._observe_plain()

    def _observe_plain(self) -> None:
        """What the plain steps paid, into the policy; the stored curve judged by it."""
        policy = self.policy
        policy.observe_plain(*self.session.plain_paid)
        if policy.costs.learn and (1, 1, True) in policy.costs.ratios:
            check_plain(policy.curve, policy.cost(0))

    def report(self, stats: Stats) -> None:
        """The depths chosen so far and the cost scales in use, into the statistics."""
        stats.depths = dict(sorted(self.policy.chosen.items()))
        stats.cost_scale = self.policy.costs.summary()


def context(session: Session) -> int:
    """The tokens the session's trunk cache holds (its longest attention cache's, through
    mlx-lm's `size`; recurrent caches say 0): the context the next round attends over."""
    return max((c.size() for c in session.cache), default=0)


def _either(first: Callable[[], bool], second: Callable[[], bool] | None) -> Callable[[], bool]:
    return lambda: first() or (second is not None and second())
