"""`--depth auto`: each round's draft source and depth chosen by expected tokens per second.

A round at depth K yields 1 + a_1 + ... + a_K tokens on average, where a_i is the chance that the
first i drafts are all kept, and costs K head drafts plus a verify pass (`CostCurve.round_cost`). A
plain step yields one token per `plain` seconds. Both are asked of the curve at the session's
context (`context`, set by the controller before each choice: `CostCurve.at`), so a GPU whose
multi-row passes grow dear with the keys decodes plainly at 64K before paying for any round. The
a_i are learned online from the rounds of this generation (an exponentially decayed count, started
from a prior), so the depth follows the text: deep on boilerplate, shallow on prose, plain where
the head helps nothing. With context lookup drafting a round may instead take the tokens that
followed an earlier match of the text's suffix (decoder/lookup.py): free to draft, tracked apart.
With both sources a head round may go on with what followed the context's match of the text plus
the head's drafts ("chain": the head guesses where the text is, the context knows how it goes on),
tracked apart again, as the chance that each extension token is kept given that all head drafts
were. The depth and the extension depend only on past rounds and on drafts already made, never on
the verify pass, so each round is exact.

A measured curve is an estimate taken apart from decoding, and on a host-bound GPU a round as
decoding pays it (head drafts, bookkeeping, the host sync) can cost twice what the curve says. So
the session reports what each round and each plain stretch really took (`observe_round`,
`observe_plain`), and the policy scales the curve's costs at the context by the median ratio of
paid to predicted over the last WINDOW of each (robust to a one-off trace or a stalled host), rounds
once MIN_OBSERVED are in. The first round of each shape a runner runs is not counted (on a GPU
it may have paid a compile), nor is the first round after a plain stretch: it also pays for the
switch (the head catching up on the stretch). Until plain decoding has been timed, a
generation starts with a short calibrating plain stretch. These ratios are the machine's, not
the text's: the runner keeps them across its generations (acceptance starts afresh each
time). A curve given by hand (`estimate=False`: a what-if) is taken as it is.

When plain decoding wins, the session decodes plainly (pipelined, as fast as depth 0) for a
stretch, then probes one depth-1 round to see whether the head has become useful; a probe that
does not switch back doubles the stretch (up to MAX_STRETCH). What a probe pays beyond the
plain steps its tokens would have cost (`observe_probe`) is timed too, and a stretch is at least
long enough for that to be PROBE_SHARE of it: where a round costs three plain steps (a small
trunk on a host-bound GPU), probes come every few hundred tokens, not every 16. So a head that
drafts nothing useful costs about a percent.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from mtpkit.decoder.curve import CostCurve
from mtpkit.decoder.options import Source

DECAY = 0.97  # per round: about the last 30 rounds weigh in
PRIOR_WEIGHT = 2.0  # rounds' worth of belief in the prior
PRIOR = 0.5  # a_1 before anything is measured; a_i = PRIOR ** i
MIN_STRETCH = 16
MAX_STRETCH = 512
PROBE_SHARE = 0.01  # a probe's cost beyond plain decoding, as a share of the stretch before it
MARGIN = 1.02  # speculation must beat plain by this much to be chosen
WINDOW = 15  # paid/predicted cost ratios the policy takes the median of, per source and plain
MIN_OBSERVED = 3  # round ratios needed before they count (one odd round says little; one
# plain stretch averages its steps)
CALIBRATE = 8  # plain tokens decoded first while plain decoding has not been timed as paid
LONG_MATCH = 4  # lookups are tracked apart by match length 1, 2, 3, 4+: a rejected one-token
# match says little about an eight-token one, and one tracker let it starve the long ones


def tracker_key(source: Source, match: int = 0) -> str:
    """The tracker of a source; a lookup's by the length of the match it drafts from."""
    return f"lookup:{min(max(match, 1), LONG_MATCH)}" if source == Source.LOOKUP else str(source)


@dataclass
class Tracker:
    """One draft source's acceptance: decayed successes and trials per draft position."""

    size: int
    prior: float = PRIOR
    kept: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kept = self.kept or [0.0] * self.size
        self.seen = self.seen or [0.0] * self.size

    def estimates(self) -> list[float]:
        """a_1..a_size: estimated chance that the first i drafts are kept (non-increasing; a
        position never tried extrapolates the last measured conditional rate)."""
        out: list[float] = []
        for i in range(self.size):
            if not out:
                prior = self.prior
            else:  # the last measured conditional rate carries on
                prior = out[-1] * (out[-1] / out[-2] if len(out) > 1 and out[-2] > 0 else out[-1])
            rate = (self.kept[i] + PRIOR_WEIGHT * prior) / (self.seen[i] + PRIOR_WEIGHT)
            out.append(min(rate, out[-1]) if out else rate)
        return out

    def record(self, depth: int, accepted: int) -> None:
        for i in range(self.size):
            self.kept[i] *= DECAY
            self.seen[i] *= DECAY
        for i in range(min(depth, self.size)):
            self.seen[i] += 1.0
            self.kept[i] += i < accepted


@dataclass
class PaidCosts:
    """Ratios of what rounds (per source) and plain steps cost as decoding paid them to what the
    curve predicted: the median of the last WINDOW of each (1.0 before any), and per source and
    depth (`by_depth`): what the curve misses may grow with a round's width (attention over
    W x S scores), so one scale per source would price every shallow round by the deep ones
    and lock requests into plain steps (docs/benchmarks-history.md, 2026-11-27)."""

    ratios: dict[str, deque] = field(default_factory=dict)
    by_depth: dict[tuple[str, int], deque] = field(default_factory=dict)
    probes: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # plain steps' worth
    shapes: set[Hashable] = field(default_factory=set)  # of the rounds run here
    _scales: dict[tuple[str, int | None], float] = field(default_factory=dict)  # asked per
    # depth option: kept until the next ratio

    def first_of(self, shape: Hashable) -> bool:
        """Whether this is the first round of its shape here (and remember it)."""
        new = shape not in self.shapes
        self.shapes.add(shape)
        return new

    def probe_stretch(self) -> int:
        """The shortest plain stretch that the median probe's extra cost is PROBE_SHARE of."""
        return math.ceil(statistics.median(self.probes) / PROBE_SHARE) if self.probes else 0

    def add(self, kind: str, paid: float, predicted: float, depth: int | None = None) -> None:
        if predicted > 0 and paid > 0:
            ratio = paid / predicted
            self.ratios.setdefault(kind, deque(maxlen=WINDOW)).append(ratio)
            if depth is not None:
                self.by_depth.setdefault((kind, depth), deque(maxlen=WINDOW)).append(ratio)
            self._scales.clear()

    def scale(self, kind: str, depth: int | None = None) -> float:
        """The kind's median ratio; a source not yet seen takes the median of every round's;
        1.0 until MIN_OBSERVED ratios are in. With `depth`: that depth's (`_at`)."""
        key = (kind, depth)
        if key not in self._scales:
            self._scales[key] = self._median(kind) if depth is None else self._at(kind, depth)
        return self._scales[key]

    def _at(self, kind: str, depth: int) -> float:
        """A round of `depth` drafts from `kind`: the median of what rounds of that depth paid
        (MIN_OBSERVED of them); between two such depths, linear in depth; beyond the deepest,
        the deepest's; below the shallowest, linear toward plain steps' ratio at depth 0 where
        plain is timed (a narrow pass is nearly a plain step), else the shallowest's. A depth
        priced too cheap this way is chosen, paid and corrected; one priced too dear by a
        deeper one's ratio would never have been. No depth of the kind timed: its median."""
        points = {d: statistics.median(q) for (k, d), q in self.by_depth.items()
                  if k == kind and len(q) >= MIN_OBSERVED}
        if not points:
            return self._median(kind)
        if depth in points:
            return points[depth]
        if min(points) > depth and self.timed("plain"):
            points[0] = self._median("plain")
        lo = max((d for d in points if d < depth), default=None)
        hi = min((d for d in points if d > depth), default=None)
        if lo is None or hi is None:
            return points[hi if lo is None else lo]
        return points[lo] + (points[hi] - points[lo]) * (depth - lo) / (hi - lo)

    def _median(self, kind: str) -> float:
        seen = list(self.ratios.get(kind, ()))
        if kind == "plain":
            return statistics.median(seen) if seen else 1.0
        if len(seen) < MIN_OBSERVED:
            seen = [r for k, q in self.ratios.items() if k != "plain" for r in q]
        return statistics.median(seen) if len(seen) >= MIN_OBSERVED else 1.0

    def timed(self, kind: str) -> bool:
        return bool(self.ratios.get(kind))

    def summary(self) -> dict[str, float]:
        """kind -> the scale in use (for the generation's statistics)."""
        return {kind: self.scale(kind) for kind in self.ratios}


@dataclass
class DepthPolicy:
    """Per round: which source drafts ("head", "lookup") and how deep, or plain decoding; and
    how far a head round's drafts are extended from the context (`extension`)."""

    curve: CostCurve
    max_depth: int
    prior: float = PRIOR
    sources: tuple[Source, ...] = (Source.HEAD,)
    context: int = 0  # tokens the next round attends over: the curve is asked there
    trackers: dict[str, Tracker] = field(default_factory=dict)
    stretch: int = MIN_STRETCH
    chosen: dict[int, int] = field(default_factory=dict)  # depth -> rounds (0: plain steps)
    paid: PaidCosts = field(default_factory=PaidCosts)
    model_step: float = 0.0  # seconds of one draft model step (a draft model's rounds)

    def __post_init__(self) -> None:
        self.sources = tuple(Source(s) for s in self.sources)
        keys = [tracker_key(s, n) for s in self.sources
                for n in (range(1, LONG_MATCH + 1) if s == Source.LOOKUP else (0,))]
        keys += [tracker_key(Source.CHAIN)] if {Source.HEAD, Source.LOOKUP} <= set(self.sources) \
            else []
        self.trackers = self.trackers or {k: Tracker(self.max_depth, self.prior) for k in keys}

    @property
    def priced(self) -> CostCurve:
        """The curve at the session's context (the curve keeps each context's: asked often)."""
        return self.curve.at(self.context)

    def acceptance(self, source: Source = Source.HEAD, match: int = 0) -> list[float]:
        """a_1..a_max_depth of a source (a lookup's: of matches `match` tokens long)."""
        return self.trackers[tracker_key(source, match)].estimates()

    def cost(self, depth: int, source: Source = Source.HEAD, drafted: int | None = None) -> float:
        """Seconds for a round of `depth` drafts, `drafted` of them by the head (default: all
        for "head", none for "lookup"): a lookup drafts on the host, for free; a draft model
        pays `model_step` per draft."""
        if source == Source.MODEL:
            return self.priced.round_cost(depth, 0) + depth * self.model_step
        if drafted is None:
            drafted = depth if source == Source.HEAD else 0
        return self.priced.round_cost(depth, drafted)

    def rate(self, depth: int, acceptance: list[float] | None = None,
             source: Source = Source.HEAD) -> float:
        """Expected tokens per second at `depth` from `source` (0: plain decoding)."""
        if depth == 0:
            return 1.0 / (self.priced.plain * self.paid.scale("plain"))
        a = self.acceptance(source) if acceptance is None else acceptance
        return (1.0 + sum(a[:depth])) / (self.cost(depth, source)
                                        * self.paid.scale(source, depth))

    def choose(self, lookup_width: int = 0, sources: tuple[Source, ...] | None = None,
               match: int = 0) -> tuple[Source | None, int]:
        """The (source, depth) with the highest expected rate; (None, 0), plain, unless speculation
        beats plain by MARGIN. A lookup can draft at most `lookup_width` tokens this round,
        from a match `match` tokens long."""
        options = []
        for source in self.sources if sources is None else sources:
            most = (min(lookup_width, self.max_depth) if source == Source.LOOKUP
                    else self.max_depth)
            a = self.acceptance(source, match)
            options += [(self.rate(d, a, source), source, d) for d in range(1, most + 1)]
        if not options:
            return None, 0
        rate, source, depth = max(options)
        return (source, depth) if rate >= MARGIN * self.rate(0) else (None, 0)

    def extension(self, depth: int, available: int) -> int:
        """How many of `available` context tokens to append to `depth` head drafts: the count
        with the highest expected rate (0: the head's drafts alone)."""
        if Source.CHAIN not in self.trackers or depth <= 0:
            return 0
        head, chain = self.acceptance(Source.HEAD), self.acceptance(Source.CHAIN)
        base = 1.0 + sum(head[:depth])

        def rate(more: int) -> float:
            kept = base + head[depth - 1] * sum(chain[:more])
            return kept / self.cost(depth + more, Source.CHAIN, depth)

        most = min(available, self.max_depth - depth)
        return max(range(most + 1), key=lambda more: (rate(more), -more))

    def best(self) -> int:
        """The head's best depth, 0 unless it beats plain decoding by MARGIN."""
        return self.choose(sources=(Source.HEAD,))[1]

    def predicted_speedup(self, depth: int | None = None,
                          source: Source = Source.HEAD) -> float:
        """Expected rate at `depth` (default: the head's best) over plain decoding's."""
        depth = self.best() if depth is None else depth
        return self.rate(depth, source=source) / self.rate(0)

    def record(self, depth: int, accepted: int, source: Source = Source.HEAD,
               drafted: int | None = None, match: int = 0) -> None:
        """One verified round: drafts 1..accepted kept out of `depth` (a lookup's drafted
        from a `match`-token match). A "chain" round's first `drafted` were the head's: they
        count for the head, and the rest for the chain only when every head draft was kept
        (else they were never put to the test)."""
        if source == Source.CHAIN:
            assert drafted is not None
            self.trackers[Source.HEAD].record(drafted, min(accepted, drafted))
            if accepted >= drafted:
                self.trackers[Source.CHAIN].record(depth - drafted, accepted - drafted)
        else:
            self.trackers[tracker_key(source, match)].record(depth, accepted)
        self.chosen[depth] = self.chosen.get(depth, 0) + 1

    def observe_round(self, seconds: float, depth: int, source: Source = Source.HEAD,
                      drafted: int | None = None, shape: Hashable | None = None) -> None:
        """What a round of `depth` drafts really took (a measured curve only), unless it is
        the first of its `shape` (the verify width and the cache buffers): that one may have
        compiled."""
        if self.curve.estimate and (shape is None or not self.paid.first_of(shape)):
            self.paid.add(source, seconds, self.cost(depth, source, drafted), depth)

    def observe_probe(self, seconds: float, tokens: int) -> None:
        """What a probe after a plain stretch took, committing `tokens` (a measured curve
        only): its cost beyond that many plain steps sets the shortest stretch."""
        if self.curve.estimate:
            step = self.priced.plain * self.paid.scale("plain")
            self.paid.probes.append(max(seconds / step - tokens, 0.0))

    def observe_plain(self, seconds: float, tokens: int) -> None:
        """What `tokens` plain steps really took (a measured curve only)."""
        if self.curve.estimate and tokens > 0:
            self.paid.add("plain", seconds / tokens, self.priced.plain)

    def calibration(self) -> int:
        """Plain tokens to decode before the first choice: CALIBRATE while plain decoding has
        not been timed as paid (a measured plain step is as much an estimate as a round, and
        a policy that never goes plain would never learn it), else none."""
        return CALIBRATE if self.curve.estimate and not self.paid.timed("plain") else 0

    def plain_stretch(self) -> int:
        """Tokens to decode plainly before the next probe; each call doubles the next one, and
        none is shorter than what probes have cost allows (up to MAX_STRETCH). Called only
        when `best` chose plain; `reset_stretch` after speculation wins again."""
        n, self.stretch = self.stretch, min(2 * self.stretch, MAX_STRETCH)
        return max(n, min(self.paid.probe_stretch(), MAX_STRETCH))

    def reset_stretch(self) -> None:
        self.stretch = MIN_STRETCH
