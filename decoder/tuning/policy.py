"""`--depth auto`: one policy chooses every round's depth, for a lone sequence and a batch alike.

A round over B rows at depth K runs one pass of shape (B rows, K+1 positions each, pipelined or
not) plus the drafting; each row then commits 1 + a_1 + ... + a_K tokens on average, where a_i is
the chance that its first i drafts are kept. The policy picks the K with the most expected
committed tokens per second across the rows (`decide`): a lone sequence is B = 1, and K = 0 is
plain decoding (pipelined steps where the rows can take them). Each row drafts from its best
source at that depth (the head, its context, a draft model), so rows get their own drafts.

The a_i are each row's own (`Tracker`: decayed counts from a prior, per source and, for context
drafts, per match length), so the depth follows the text: deep on boilerplate, shallow on prose,
plain where drafts help nothing. Evidence fades while a source drafts nothing (plain steps age
it), so a source written off long ago is tried again once its prior would pay.

What a round costs comes from one table (`CostTable`) keyed by its pass's shape: the cost curve
priced at the rows' context (decoder/tuning/curve.py) is its prior, and what rounds pay here corrects
it: per shape, the median of its last paid/prior ratios, weighed by their decayed count against
PRIOR_WEIGHT for what `tune` timed of that shape or, without, what the nearest shape timed alike
says. Ratios count in the context band they were paid in (`band`: octaves of context): a curve
measured at one context prices a 64K round as a 512-token one, and what such rounds pay must
not be averaged with what 16K rounds paid. Untried costs are explored by optimism: every shape
is priced cheaper by OPTIMISM / sqrt(1 + n), n the decayed count of its timings here, so a
shape nobody has timed lately gets tried where its price is near the best, and a price taken
too dear once is taken again as that timing fades. The choice depends only on past rounds and
on drafts already made, never on the verify pass, so every round stays exact.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from mtpkit.decoder.options import Source
from mtpkit.decoder.tuning.curve import CONTEXT, CostCurve

DECAY = 0.97  # evidence kept per round: about the last 30 rounds weigh in (acceptance and the
# confidence in a cost alike)
PRIOR = 0.5  # a_1 before anything is measured; a_i = PRIOR ** i
PRIOR_WEIGHT = 2.0  # rounds' worth of belief in a prior
OPTIMISM = 0.25  # an untimed shape is priced up to this share cheaper: within it of the best
# it gets tried; further off, what a try would cost outweighs what it could show
LONG_MATCH = 4  # lookups are tracked apart by match length 1, 2, 3, 4+: a rejected one-token
# match says little about an eight-token one, and one tracker let it starve the long ones

Shape = tuple[int, int, bool]  # a pass: (rows, positions per row, pipelined)


def tracker_key(source: Source, match: int = 0) -> str:
    """The tracker of a source; a lookup's by the length of the match it drafts from."""
    return f"lookup:{min(max(match, 1), LONG_MATCH)}" if source == Source.LOOKUP else str(source)


def band(context: int) -> int:
    """The context band a timing counts in: octaves above the curve's first context (a
    pass's attention grows with its keys, so a ratio holds for contexts near its own)."""
    return max(0, round(math.log2(max(context, 1) / CONTEXT)))


def memory() -> int:
    """Timings a shape's correction is the median of: as many as DECAY keeps in mind."""
    return round(1 / (1 - DECAY))


@dataclass
class Tracker:
    """One draft source's acceptance: decayed successes and trials per draft position."""

    size: int
    prior: float = PRIOR
    kept: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)
    priors: list[float] | None = None  # a_1..a_size before any round of its own: what the
    # runner's earlier rounds kept (None: PRIOR and onward)

    def __post_init__(self) -> None:
        self.kept = self.kept or [0.0] * self.size
        self.seen = self.seen or [0.0] * self.size

    def estimates(self) -> list[float]:
        """a_1..a_size: estimated chance that the first i drafts are kept (non-increasing; a
        position never tried extrapolates the last measured conditional rate)."""
        out: list[float] = []
        tried = -1  # the last position with a round's worth of evidence
        for i in range(self.size):
            if self.priors is not None and i < len(self.priors):  # the runner's rates on
                # from this request's own: what it kept of draft i + 1 once i were kept
                prior = self.priors[0] if not out else out[-1] * (
                    self.priors[i] / self.priors[i - 1] if self.priors[i - 1] > 0 else 0.0)
            else:
                prior = out[-1] * self.onward(tried, out) if out else self.prior
            rate = (self.kept[i] + PRIOR_WEIGHT * prior) / (self.seen[i] + PRIOR_WEIGHT)
            out.append(min(rate, out[-1]) if out else rate)
            tried = i if self.seen[i] >= 1 else tried
        return out

    def onward(self, tried: int, out: list[float]) -> float:
        """The chance the next draft is kept once those before it are: the conditional rate at
        position `tried` (the last with a round's worth of evidence), shrunk toward PRIOR by
        it (three rounds that kept all three drafts say little about an eighth); with none
        (-1), the last position's own, unshrunk."""
        m = tried if tried >= 0 else len(out) - 1
        rate = out[m] / out[m - 1] if m > 0 and out[m - 1] > 0 else out[m]
        if tried < 0:
            return rate
        return (self.seen[m] * rate + PRIOR_WEIGHT * PRIOR) / (self.seen[m] + PRIOR_WEIGHT)

    def age(self, rounds: int = 1) -> None:
        """Evidence fades by DECAY a round (a plain step counts as one)."""
        keep = DECAY ** rounds
        self.kept = [k * keep for k in self.kept]
        self.seen = [s * keep for s in self.seen]

    def record(self, depth: int, accepted: int) -> None:
        self.age()
        for i in range(min(depth, self.size)):
            self.seen[i] += 1.0
            self.kept[i] += i < accepted


@dataclass
class CostTable:
    """Seconds of a pass by its shape: the curve's prior corrected by what passes paid here
    (a runner's: its generations and batches share it). `draft`: one head draft step;
    `learn`: false for a curve given by hand (a what-if taken as it is)."""

    curve: CostCurve
    ratios: dict[Shape, deque] = field(default_factory=dict)  # paid / prior, the last memory()
    bands: dict[Shape, deque] = field(default_factory=dict)  # the context band of each ratio
    times: dict[Shape, deque] = field(default_factory=dict)  # paid seconds, as timed
    confidence: dict[Shape, tuple[float, int]] = field(default_factory=dict)  # (n, clock then)
    clock: dict[int, int] = field(default_factory=dict)  # passes run, by rows
    seeded: dict[Shape, float] = field(default_factory=dict)  # corrections timed elsewhere
    restarts: dict[int, deque] = field(default_factory=dict)  # seconds building a pipelined
    # stretch's first pass took (the device idle), by rows: what switching stretches pays
    _medians: dict[tuple[Shape, int], float] = field(default_factory=dict)  # by band asked
    _nearest: dict[Shape, Shape | None] = field(default_factory=dict)  # until a new shape

    @property
    def learn(self) -> bool:
        return self.curve.estimate

    @property
    def draft(self) -> float:
        return self.curve.draft

    def prior(self, shape: Shape, context: int = 0) -> float:
        """The curve's price of a pass at `context`: a pipelined plain step for (1, 1, True),
        else the verify pass over rows x width tokens (one row pads to a cheaper width),
        pipelined passes by what pipelining saves a plain step. A pipelined step is never
        priced over the synchronous pass of as many tokens (the same work, its host part
        overlapped): a curve that says so was timed busy. Pipelining hides the host's part
        of a pass, which the context does not grow: verify passes (several query rows) are
        saved the share a plain step saves at the curve's first context. At a long context a
        one-row verify pass costs more than a plain step for its attention, which pipelining
        does not hide: saved that ratio, a round was priced at half what it paid
        (docs/decoding.md, "Choosing the depth")."""
        rows, width, piped = shape
        curve = self.curve.at(context)
        saved = curve if width == 1 else self.curve
        saving = min(saved.plain / saved.verify[0], 1.0)
        if rows == 1 and width == 1 and piped:
            return curve.verify[0] * saving
        tokens = curve.width(width) if rows == 1 else rows * width
        verify = curve.verify
        if tokens <= len(verify):
            seconds = verify[tokens - 1]
        else:  # beyond the curve: its mean slope (attention and matmuls grow with the tokens)
            seconds = verify[-1] + (verify[-1] - verify[0]) / max(len(verify) - 1, 1) * (
                tokens - len(verify))
        return seconds * (saving if piped else 1.0)

    def correction(self, shape: Shape, context: int = 0) -> float:
        """paid / prior at `context`: the median of the shape's own timings in its band,
        weighed by their decayed count against PRIOR_WEIGHT for what `tune` timed of it or,
        without, what the shape paid in the nearest band timed or, never timed, what the nearest
        shape timed alike (pipelined or not, plain steps or verify passes; the fewest rows, then
        positions, apart) says, else 1: a timing long past, or one alone, gives way to what its
        neighbours pay now. Plain steps and verify passes never price each other: one query
        row per sequence runs other kernels (a GPU's vector attention, matrix-vector products)
        than several, whose cost grows otherwise with the context (docs/decoding.md)."""
        at = band(context)
        bands = self.bands.get(shape, ())
        own = bands.count(at)
        n = self.timings(shape) * own / len(bands) if own else 0.0
        base = self.seeded.get(shape)
        if base is None and bands and not own:
            base = self._median(shape, at)
        elif base is None:
            if shape not in self._nearest:
                rows, width, piped = shape
                self._nearest[shape] = min(
                    (s for s in (*self.ratios, *self.seeded)
                     if s[2] == piped and (s[1] == 1) == (width == 1) and s != shape),
                    default=None, key=lambda s: (abs(s[0] - rows), abs(s[1] - width), s))
            near = self._nearest[shape]
            base = 1.0 if near is None else self._median(near, at)
        return (n * self._median(shape, at) + PRIOR_WEIGHT * base) / (n + PRIOR_WEIGHT) if n \
            else base

    def _median(self, shape: Shape, at: int) -> float:
        """The median of the shape's ratios in band `at`, else in the nearest band timed (the
        longer on a tie), else what `tune` timed of it."""
        if shape not in self.ratios:
            return self.seeded[shape]
        if (shape, at) not in self._medians:  # (a shape's bands change only when it is timed)
            bands = self.bands[shape]
            nearest = min(bands, key=lambda b: (abs(b - at), -b))
            self._medians[(shape, at)] = statistics.median(
                r for r, b in zip(self.ratios[shape], bands, strict=True) if b == nearest)
        return self._medians[(shape, at)]

    def seconds(self, shape: Shape, context: int = 0, drafting: float = 0.0) -> float:
        """What a round of this pass `shape` is expected to cost at `context`, its drafts
        priced at `drafting` seconds by the prior (corrected with the pass: both are paid
        as one round's time)."""
        return (self.prior(shape, context) + drafting) * self.correction(shape, context)

    def timings(self, shape: Shape) -> float:
        """The decayed count of this shape's timings here."""
        n, then = self.confidence.get(shape, (0.0, 0))
        return n * DECAY ** (self.clock.get(shape[0], 0) - then)

    def pricer(self, shape: Shape, context: int, optimism: bool) -> Callable[[float], float]:
        """`seconds` of `shape` as a function of the drafting (with `optimism`: cheaper by
        OPTIMISM / sqrt(1 + n), the price the policy compares), its terms computed once (the
        policy asks several plans of one shape)."""
        prior, factor = self.prior(shape, context), self.correction(shape, context)
        if optimism:
            factor /= 1 + OPTIMISM / math.sqrt(1 + self.timings(shape))
        return lambda drafting: (prior + drafting) * factor

    def observe_restart(self, rows: int, seconds: float) -> None:
        """A pipelined stretch of `rows` rows started: building its first pass took `seconds`
        (not kept for a curve given by hand: a what-if is taken as it is)."""
        if self.learn:
            self.restarts.setdefault(rows, deque(maxlen=memory())).append(seconds)

    def restart(self, rows: int) -> float:
        """What starting a pipelined stretch of `rows` rows costs here (0: never seen one)."""
        seen = self.restarts.get(rows)
        return statistics.median(seen) if seen else 0.0

    def tick(self, rows: int) -> None:
        """A pass of `rows` rows ran (every shape's confidence at that size fades)."""
        self.clock[rows] = self.clock.get(rows, 0) + 1

    def observe(self, shape: Shape, seconds: float, context: int = 0, count: int = 1,
                drafting: float = 0.0) -> None:
        """`count` rounds of pass `shape` (ticked apart) paid `seconds` each, drafts the prior
        prices at `drafting` seconds included."""
        self.confidence[shape] = (self.timings(shape) + count, self.clock.get(shape[0], 0))
        self.times.setdefault(shape, deque(maxlen=memory())).append(seconds)
        if self.learn and seconds > 0:
            if shape not in self.ratios:
                self._nearest.clear()
            self.ratios.setdefault(shape, deque(maxlen=memory())).append(
                seconds / (self.prior(shape, context) + drafting))
            self.bands.setdefault(shape, deque(maxlen=memory())).append(band(context))
            self._medians = {k: v for k, v in self._medians.items() if k[0] != shape}

    def seed(self, shape: Shape, times: Iterable[float], drafting: float = 0.0) -> None:
        """Timings taken elsewhere (`tune`'s, from disk), at the curve's own context: what the
        shape's own timings here are weighed against (they count for nothing in confidence:
        the shape is still tried as untimed)."""
        prior = self.prior(shape, self.curve.context) + drafting
        ratios = [t / prior for t in times if t > 0]
        if ratios:
            self.seeded[shape] = statistics.median(ratios)
            self._nearest.clear()

    def unseed(self) -> None:
        """Forget every timing taken elsewhere (a store judged stale): passes are priced by
        the curve and what they pay here."""
        self.seeded.clear()
        self._nearest.clear()

    def summary(self) -> dict[str, float]:
        """Each timed shape's correction where it was last timed, named "rows x width"
        (+ " piped"), for statistics."""
        return {f"{r}x{w}{' piped' if p else ''}": self.correction(
            (r, w, p), CONTEXT << self.bands[(r, w, p)][-1] if (r, w, p) in self.bands else 0)
            for r, w, p in sorted({*self.ratios, *self.seeded})}


@dataclass(frozen=True)
class Offer:
    """What one row can draft this round, as chances that its first i drafts are kept, per
    source: `head` (the head's or a draft model's: `paid` says which steps it pays; [] for
    none) and `context` (as many as its context offers, drafted for free)."""

    head: Sequence[float] = ()
    context: Sequence[float] = ()
    paid: Source = Source.HEAD
    sums: tuple[list[float], list[float]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:  # expected kept drafts by depth, per source
        object.__setattr__(self, "sums", (list(accumulate(self.head, initial=0.0)),
                                          list(accumulate(self.context, initial=0.0))))

    def source(self, depth: int) -> Source | None:
        """The source that keeps more at `depth` (the context on a tie: it drafts for free)."""
        if depth <= 0 or not (self.head or self.context):
            return None
        if self.context and self.kept(depth, True) >= self.kept(depth, head_only=True):
            return Source.LOOKUP
        return self.paid if self.head else Source.LOOKUP

    def kept(self, depth: int, free_only: bool = False, head_only: bool = False) -> float:
        """Expected kept drafts at `depth`: from its best source (or the free one, the head)."""
        head, context = self.sums
        free = context[min(depth, len(context) - 1)]
        if free_only:
            return free
        paid = head[min(depth, len(head) - 1)]
        return paid if head_only else max(paid, free)


@dataclass(frozen=True)
class Plan:
    """A round as decided: its depth (0: plain), each row's source, and the expected rate."""

    depth: int
    sources: tuple[Source | None, ...]
    rate: float


def decide(offers: Sequence[Offer], table: CostTable, max_depth: int, context: int = 0,
           pipelined: bool = False, plain: Shape | None = None, model_step: float = 0.0,
           running: Shape | None = None, horizon: int = 1) -> Plan:
    """The depth with the most expected committed tokens per second for these rows (see the
    module's doc). `pipelined`: whether a round would run pipelined; `plain`: the shape plain
    decoding takes (default: pipelined steps); `model_step`: a draft model's step.
    `running`: the shape of the pipelined stretch running now, which goes on for free; any
    other pipelined shape first pays a restart (`CostTable.restart`), spread over `horizon`
    rounds (the scheduler's: a settled stretch is asked again after that many), so a switch
    must gain more than the restart costs, while an untried shape is still explored by
    optimism (charged the whole restart on its first round, none would ever be tried once a
    stretch ran)."""
    rows = len(offers)
    optimism = table.learn  # a curve given by hand is taken as it is
    plain = plain or (rows, 1, True)

    restart = table.restart(rows) / horizon if running is not None else 0.0

    def switch(shape: Shape) -> float:
        return restart if shape != running and shape[2] else 0.0

    best = Plan(0, (None,) * rows,
                rows / (table.pricer(plain, context, optimism)(0.0) + switch(plain)))
    headed = any(o.head for o in offers)
    step = model_step if any(o.paid == Source.MODEL for o in offers) else table.draft
    plans = (False, True) if headed and any(o.context for o in offers) else (not headed,)
    deepest = max_depth if headed else min(max((len(o.context) for o in offers), default=0),
                                           max_depth)
    for depth in range(1, deepest + 1):
        shape = (rows, depth + 1, pipelined)
        price, extra = table.pricer(shape, context, optimism), switch(shape)
        for free in plans:
            kept = rows + sum(o.kept(depth, free) for o in offers)
            rate = kept / (price(0.0 if free else depth * step) + extra)
            if rate > best.rate:
                sources = tuple(o.source(depth) if not free else
                                (Source.LOOKUP if o.context else None) for o in offers)
                best = Plan(depth, sources, rate)
    return best


@dataclass
class DepthPolicy:
    """One request's view of the policy: its acceptance trackers (per source), the runner's
    cost table (`table`), the context it decodes at; `choose` is `decide` for this one row."""

    curve: CostCurve
    max_depth: int
    prior: float = PRIOR
    sources: tuple[Source, ...] = (Source.HEAD,)
    context: int = 0  # tokens the next round attends over: priced there
    trackers: dict[str, Tracker] = field(default_factory=dict)
    chosen: dict[int, int] = field(default_factory=dict)  # depth -> rounds (0: plain steps)
    table: CostTable | None = None
    model_step: float = 0.0  # seconds of one draft model step (a draft model's rounds)
    memory: dict[str, Tracker] | None = None  # the runner's: every auto request's rounds,
    # whose estimates are the next request's priors (a request need not learn its model anew)

    def __post_init__(self) -> None:
        self.sources = tuple(Source(s) for s in self.sources)
        self.table = self.table if self.table is not None else CostTable(self.curve)
        keys = [tracker_key(s, n) for s in self.sources
                for n in (range(1, LONG_MATCH + 1) if s == Source.LOOKUP else (0,))]
        keys += [tracker_key(Source.CHAIN)] if {Source.HEAD, Source.LOOKUP} <= set(self.sources) \
            else []
        self.trackers = self.trackers or {
            k: Tracker(self.max_depth, self.prior, priors=self.remembered(k)) for k in keys}

    def remembered(self, key: str) -> list[float] | None:
        """What the runner's earlier rounds kept of a source (None: it has not drafted)."""
        earlier = self.memory.get(key) if self.memory is not None else None
        return earlier.estimates() if earlier is not None and earlier.seen[0] > 0 else None

    @property
    def costs(self) -> CostTable:
        assert self.table is not None
        return self.table

    @property
    def priced(self) -> CostCurve:
        """The curve at the session's context."""
        return self.curve.at(self.context)

    def acceptance(self, source: Source = Source.HEAD, match: int = 0) -> list[float]:
        """a_1..a_max_depth of a source (a lookup's: of matches `match` tokens long)."""
        return self.trackers[tracker_key(source, match)].estimates()

    def shape(self, depth: int) -> Shape:
        """A lone round's pass at `depth` (0: a pipelined plain step)."""
        return (1, 1, True) if depth == 0 else (1, self.priced.width(depth + 1), False)

    def cost(self, depth: int, source: Source = Source.HEAD, drafted: int | None = None) -> float:
        """Seconds for a lone round of `depth` drafts, `drafted` of them by the head (default:
        all for "head", none for "lookup"; a draft model pays `model_step` per draft)."""
        return self.costs.seconds(self.shape(depth), self.context,
                                  self.drafting(depth, source, drafted))

    def drafting(self, depth: int, source: Source = Source.HEAD,
                 drafted: int | None = None) -> float:
        """What the prior prices a lone round's drafts at (see `cost`)."""
        if depth == 0:
            return 0.0
        if source == Source.MODEL:
            return depth * self.model_step
        drafted = (depth if source == Source.HEAD else 0) if drafted is None else drafted
        return drafted * self.costs.draft

    def offer(self, lookup_width: int = 0, match: int = 0,
              sources: tuple[Source, ...] | None = None) -> Offer:
        """This row's offer: its paid source's acceptance, and `lookup_width` context drafts
        from a `match`-token match."""
        sources = self.sources if sources is None else sources
        paid = next((s for s in sources if s in (Source.HEAD, Source.MODEL)), None)
        context = (self.acceptance(Source.LOOKUP, match)[:lookup_width]
                   if Source.LOOKUP in sources and lookup_width > 0 else [])
        return Offer(self.acceptance(paid) if paid is not None else [], context,
                     paid or Source.HEAD)

    def choose(self, lookup_width: int = 0, sources: tuple[Source, ...] | None = None,
               match: int = 0) -> tuple[Source | None, int]:
        """(source, depth) with the highest expected rate for this row alone ((None, 0):
        plain). A lookup drafts at most `lookup_width` tokens, from a `match`-token match."""
        plan = decide([self.offer(lookup_width, match, sources)], self.costs, self.max_depth,
                      self.context, model_step=self.model_step)
        source = plan.sources[0]
        if plan.depth == 0 or source is None:
            return None, 0
        return source, min(plan.depth, lookup_width) if source == Source.LOOKUP else plan.depth

    def rate(self, depth: int, acceptance: list[float] | None = None,
             source: Source = Source.HEAD) -> float:
        """Expected tokens per second at `depth` from `source` (0: plain decoding)."""
        if depth == 0:
            return 1.0 / self.cost(0)
        a = self.acceptance(source) if acceptance is None else acceptance
        return (1.0 + sum(a[:depth])) / self.cost(depth, source)

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
        """The head's best depth, 0 where plain decoding is faster."""
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
            self._track(tracker_key(Source.HEAD), drafted, min(accepted, drafted))
            if accepted >= drafted:
                self._track(tracker_key(Source.CHAIN), depth - drafted, accepted - drafted)
        else:
            self._track(tracker_key(source, match), depth, accepted)
        self.chosen[depth] = self.chosen.get(depth, 0) + 1

    def _track(self, key: str, depth: int, accepted: int) -> None:
        """A round's verdict in the request's tracker and in the runner's memory."""
        self.trackers[key].record(depth, accepted)
        if self.memory is not None:
            if key not in self.memory:  # (not built every round)
                self.memory[key] = Tracker(self.max_depth)
            self.memory[key].record(depth, accepted)

    def plain(self, steps: int = 1) -> None:
        """`steps` plain steps decoded: counted, and every source's evidence ages by them."""
        self.chosen[0] = self.chosen.get(0, 0) + steps
        for tracker in [*self.trackers.values(), *(self.memory or {}).values()]:
            tracker.age(steps)

    def observe_round(self, seconds: float, depth: int, source: Source = Source.HEAD,
                      drafted: int | None = None, fresh: bool = False,
                      width: int | None = None) -> None:
        """What a lone round of `depth` drafts took (its pass ran `width` positions), unless
        its pass was `fresh` (the first of its shape here, Trunk.first_pass: it may have
        compiled)."""
        self.costs.tick(1)
        if fresh:
            return
        pass_shape = (1, width, False) if width else self.shape(depth)
        self.costs.observe(pass_shape, seconds, self.context,
                           drafting=self.drafting(depth, source, drafted))

    def observe_plain(self, seconds: float, tokens: int) -> None:
        """What `tokens` pipelined plain steps took."""
        if tokens > 0:  # (the clock ticked step by step: the controller)
            self.costs.observe((1, 1, True), seconds / tokens, self.context, tokens)

