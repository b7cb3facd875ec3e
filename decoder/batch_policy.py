"""`--depth auto` for a batch: one draft depth per round, where the batch's expected tokens per
second are highest.

A round's cost hangs on the batch's size and its deepest draft (every row is padded to the
widest), so the policy picks the depth K maximising the rows' expected committed tokens (each
row's 1 + a_1 + ... + a_K, from its own acceptance trackers) over what a round of B rows at
depth K costs; each row then drafts K from its best source, or takes a plain step. Round costs
are measured per (rows, key) (`Prices`; pipelined rounds under `piped(K)`, plain stretches
under PIPED): depths 0..EXPLORE are explored first, an untimed size borrows the nearest size's
prices, one depth beyond the deepest timed is priced by extension, a depth timed only
synchronously is scaled by what pipelining saved, and stale neighbouring prices are probed
again (`Prices.stale`). Where no depth beats plain steps by MARGIN the batch decodes a plain
stretch, then probes depth 1. Why each rule: docs/batching.md.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from mtpkit.decoder.batch import Ask
from mtpkit.decoder.curve import CostCurve
from mtpkit.decoder.options import Source
from mtpkit.decoder.policy import MARGIN, MAX_STRETCH, MIN_OBSERVED, MIN_STRETCH, WINDOW, DepthPolicy
from mtpkit.decoder.session import RoundOutcome, Session

EXPLORE = 3  # depths timed at each batch size before any is chosen (deeper ones extend them)


class Row(Protocol):
    """What the policy reads of a row (decoder/scheduler.py's Request, named by its parts: the
    scheduler imports this module): its session and, under auto, its own depth policy."""

    session: Session
    policy: DepthPolicy | None


def piped(depth: int) -> int:
    """The key pipelined rounds at `depth` are timed under (0: plain steps), beside the
    synchronous rounds' `depth`: a pipelined round overlaps its host work with the last one's
    pass and costs less."""
    return -1 - depth


PIPED = piped(0)  # what a plain stretch's pipelined steps cost
STALE_S = 60.0  # a neighbouring depth's pipelined price older than this is taken again,
PROBE_ROUNDS = 64 * 16  # once this many rounds of its size have run since: probes spend at
# most 1/64 of the rounds (a probe is a 16-round stretch), however bursty the traffic
FIRST_PROBE = 4 * 16  # a price never timed by this process (tune's, from disk) is taken again
# once this many rounds of its size have run: once per price, and tune's can be far off


def drafted(key: int) -> int:
    """The depth a price key stands for (synchronous or pipelined)."""
    return key if key >= 0 else -1 - key


def _extended(prices: dict[int, float], depth: int) -> float | None:
    """`depth`'s price extended linearly in K from the two deepest priced below it (never
    cheaper than the deeper one), where two are."""
    below = sorted(k for k in prices if k < depth)
    if len(below) < 2:
        return None
    a, b = below[-2], below[-1]
    return prices[b] + max((prices[b] - prices[a]) / (b - a), 0.0) * (depth - b)


class Prices(dict):
    """Round times by (rows, key) (deques of seconds; a runner's, shared by its batches), and
    when each key was last timed here (`seen`, monotonic seconds; `since`: when these prices
    began, for those taken elsewhere: tune's, from disk; `at`: how many rounds of its size
    had run by then, of `rounds` run at each size here)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[int, int], float] = {}
        self.since = time.monotonic()
        self.rounds: dict[int, int] = {}
        self.at: dict[tuple[int, int], int] = {}

    def timed(self, rows: int, key: int) -> None:
        """`key` was timed (or asked for) at `rows` rows now."""
        self.seen[(rows, key)] = time.monotonic()
        self.at[(rows, key)] = self.rounds.get(rows, 0)

    def stale(self, rows: int, key: int, now: float) -> float | None:
        """How long ago `key` was last timed at this size, where that is over STALE_S and
        PROBE_ROUNDS rounds of this size have run since, or where it is a stored price (tune's)
        that this process never timed and FIRST_PROBE rounds have (else None). A depth never
        timed anywhere (priced by extension) waits like any other: probing those early costs
        deep rounds that lose."""
        age = now - self.seen.get((rows, key), self.since)
        worked = self.rounds.get(rows, 0) - self.at.get((rows, key), 0)
        if (rows, key) not in self.seen and (rows, key) in self:
            return age if worked >= FIRST_PROBE else None
        return age if age > STALE_S and worked >= PROBE_ROUNDS else None


def _offers(request: Row, width: int, headed: bool
            ) -> tuple[list[float], list[int], int, list[float]]:
    """What a row can draft now, up to `width`: its head's acceptance ([] where it has no head
    drafts: `headed` false or not a source), and its context's drafts, their match length and
    that match length's acceptance for as many drafts as the context offers."""
    session, policy = request.session, request.policy
    assert policy is not None
    head = policy.acceptance(Source.HEAD) if headed and Source.HEAD in policy.sources else []
    drafts, match = (session.lookup.propose(width)
                     if Source.LOOKUP in policy.sources and session.lookup is not None
                     else ([], 0))
    context = policy.acceptance(Source.LOOKUP, match)[:len(drafts)] if drafts else []
    return head, drafts, match, context


@dataclass
class BatchPolicy:
    """The batch's depth per round, from measured (B, K) round costs and every row's own
    acceptance. `paid`: the round times seen so far (shared through the runner)."""

    curve: CostCurve
    max_depth: int
    paid: dict[tuple[int, int], deque] = field(default_factory=Prices)  # (rows, depth) -> s
    stretch: int = MIN_STRETCH
    plain_left: int = 0
    chosen: dict[int, int] = field(default_factory=dict)  # depth -> rounds
    decided: bool = False  # the last depth was chosen on prices (not an exploration or probe)
    pipelines: bool = False  # a depth chosen now would run pipelined (set per round: scheduler)
    overlaps: bool = False  # rounds every row drafts from the head may (probes: set likewise)

    def cost(self, rows: int, depth: int, timed: dict[int, float] | None = None) -> float:
        """Seconds for a round of `rows` rows at `depth` drafts: the median paid where timed
        (pipelined where it ran so), else extended from the deepest timed depths, else the
        single-sequence curve (nothing timed yet). `timed`: _timed(rows), if already at hand."""
        timed = self._timed(rows) if timed is None else timed
        if piped(depth) in timed:  # as it runs: plain as a stretch, rounds pipelined
            return timed[piped(depth)]
        ran = {drafted(k): c for k, c in timed.items() if k < PIPED}  # pipelined rounds
        if depth not in timed and (cost := _extended(ran, depth)) is not None:
            return cost  # (a GPU after tune: extended as they run)
        if depth in timed:
            cost = timed[depth]
        elif (cost := _extended({k: c for k, c in timed.items() if k >= 0}, depth)) is None:
            return self._single(depth)
        # a synchronous price, scaled by what pipelining saved at the depths run both ways
        saved = [timed[piped(k)] / timed[k] for k in timed if k > 0 and piped(k) in timed]
        if not saved and self.pipelines and PIPED in timed and 0 in timed:
            saved = [timed[PIPED] / timed[0]]  # what it saved plain steps: docstring
        return cost * statistics.median(saved) if saved and depth > 0 else cost

    def _timed(self, rows: int) -> dict[int, float]:
        """Median round times at this size; a shape not yet timed here borrows the nearest
        size's (rows join and leave all the time: exploring every size anew would spend
        synchronous rounds at each, and the shape chosen is then timed here as it runs). A
        smaller batch lends no depth beyond EXPLORE deeper than a batch of at least this size
        has timed: its price would be too cheap here, and such a depth is priced by
        extending this size's own."""
        sizes: dict[int, dict[int, float]] = {}
        for (b, k), seen in self.paid.items():
            if len(seen) >= MIN_OBSERVED:
                sizes.setdefault(b, {})[k] = statistics.median(seen)
        reach = max([EXPLORE] + [drafted(k) for b, keys in sizes.items() if b >= rows
                                 for k in keys])
        timed: dict[int, float] = {}
        for b in sorted(sizes, key=lambda b: (abs(b - rows), -b)):  # this size, then nearest
            for k, c in sizes[b].items():
                if b >= rows or drafted(k) <= reach:
                    timed.setdefault(k, c)
        return timed

    def _single(self, depth: int) -> float:
        """One sequence's round at `depth` on the curve (depth 0: one step through the verify
        path, as a batch's plain rows take it)."""
        return self.curve.verify[0] if depth == 0 else self.curve.round_cost(depth)

    def _explore(self, timed: dict[int, float]) -> int | None:
        """A depth up to EXPLORE not yet timed MIN_OBSERVED times at this size or another
        (`timed`: _timed(rows)), if any."""
        for depth in range(min(EXPLORE, self.max_depth) + 1):
            if depth not in timed and piped(depth) not in timed:
                return depth
        return None

    def gains(self, request: Row) -> list[float]:
        """A row's expected kept drafts in a round at each depth 0..max_depth: its best
        source's, as `ask` picks it. A context's are those of the match it would draft from
        now (its tracker by match length) and only as many as it offers: the one-token
        matches' tracker understates copying rows."""
        out = [0.0] * (self.max_depth + 1)
        if request.policy is None:
            return out
        session = request.session
        headed = session.head is not None and session.depth > 0
        head, _, _, context = _offers(request, self.max_depth, headed)
        for k in range(1, self.max_depth + 1):
            out[k] = max(sum(head[:k]), sum(context[:k]))
        return out

    def depth(self, requests: list[Row], rows: int | None = None) -> int:
        """The depth of the next round for these requests (0: plain steps); `rows`: the
        batch's, where mates at fixed depths share the pass (its cost is that many rows')."""
        self.decided = False
        if self.plain_left > 0:
            self.plain_left -= 1
            return 1 if self.plain_left == 0 else 0  # the stretch's last round probes
        rows = len(requests) if rows is None else rows
        timed = self._timed(rows)
        if (explore := self._explore(timed)) is not None:
            if explore == 0:  # plain is timed as a stretch runs it: pipelined steps
                self.plain_left = MIN_OBSERVED + 2
            return explore
        gains = [self.gains(r) for r in requests]

        def expected(k: int) -> float:  # the batch's committed tokens in a round at depth k
            return sum(1.0 + g[k] for g in gains)

        plain = expected(0) / self.cost(rows, 0, timed)
        known = max(drafted(k) for k in timed)  # deepest timed, either way
        deepest = min(known + 1, self.max_depth)  # climb one untimed depth
        rate, depth = max((expected(k) / self.cost(rows, k, timed), k)
                          for k in range(1, deepest + 1))
        if rate < MARGIN * plain:
            self.plain_left, self.stretch = self.stretch, min(2 * self.stretch, MAX_STRETCH)
            return 0
        self.stretch, self.decided = MIN_STRETCH, True
        return self._probe(rows, depth, deepest)

    def _probe(self, rows: int, depth: int, deepest: int) -> int:
        """`depth`, or where rounds run pipelined, a neighbouring depth whose pipelined price
        at this size was last taken over STALE_S and PROBE_ROUNDS rounds ago (`Prices.stale`;
        the older of the two): it runs a
        stretch (decided, so pipelined: SPEC_ROUNDS rounds, more than the WINDOW its price is
        the median of), which prices it afresh. Only the chosen depth is timed as it runs, so
        a neighbour's price once taken too dear would never be taken again. Counting rounds as
        well as seconds bounds what probes cost to the decoding done, however bursty the
        traffic (the probes tried and dropped: docs/batching.md)."""
        if not self.overlaps or not isinstance(self.paid, Prices):
            return depth
        now = time.monotonic()
        ages = {k: age for k in (depth - 1, depth + 1) if 1 <= k <= deepest
                and (age := self.paid.stale(rows, piped(k), now)) is not None}
        if not ages:
            return depth
        probe = max(ages, key=lambda k: ages[k])
        self.paid.timed(rows, piped(probe))  # (asked once, even if cut short)
        return probe

    def ask(self, request: Row, depth: int, most: int, headed: bool) -> Ask:
        """A row's draft in a round at `depth` (at most `most` drafts): context drafts where
        they are expected to keep at least what the head's would, else the head's."""
        depth = min(depth, most)
        assert request.policy is not None
        if depth <= 0:
            return Ask()
        head, drafts, match, context = _offers(request, depth, headed)
        if drafts and sum(context) >= sum(head[:depth]):
            return Ask(context=tuple(drafts), match=match)
        return Ask(depth=depth if head else 0)

    def stretch_steps(self) -> int:
        """Plain steps the batch may take pipelined now (Batch.plain_steps): what is left of
        a plain stretch but its closing probe round, which the stretch then owes."""
        steps = max(self.plain_left - 1, 0)
        self.plain_left -= steps
        return steps

    def observe_plain(self, rows: int, paid_s: float) -> None:
        """What one pipelined plain step of `rows` rows paid: once timed, the price of plain
        decoding at this size (a depth-0 round through the verify path costs more)."""
        self.chosen[0] = self.chosen.get(0, 0) + 1
        self._paid(rows, PIPED, paid_s)

    def _paid(self, rows: int, key: int, paid_s: float) -> None:
        self.paid.setdefault((rows, key), deque(maxlen=WINDOW)).append(paid_s)
        if isinstance(self.paid, Prices):
            self.paid.rounds[rows] = self.paid.rounds.get(rows, 0) + 1
            self.paid.timed(rows, key)

    def observe(self, rows: int, outcomes: list[RoundOutcome], pipelined: bool = False) -> None:
        """What a round of `rows` rows paid, under its shape (the deepest draft) and whether
        it ran pipelined (Batch.spec_rounds)."""
        depth = max(o.depth for o in outcomes)
        self.chosen[depth] = self.chosen.get(depth, 0) + 1
        self._paid(rows, piped(depth) if pipelined else depth, outcomes[0].paid_s)
