"""The cost curve as data: what a verify pass over T rows, a plain step and a head draft step
cost on this machine (decoder/tuning/costs.py measures it), at the contexts it was measured at, and the
pure arithmetic over it that the depth policy and `tune` read. Nothing here runs a model.

A round's cost grows with the context, and not alike for every T: on a GPU multi-row attention
leaves the fused kernel, so a depth that pays at 1K can lose at 64K; on a CPU or a Mac every T
grows about alike. So the curve is asked at the session's context (`CostCurve.at`): linear in the
context between measured ones (attention reads each key once per pass), the last segment's
slope beyond the longest (never negative), the shortest's costs below it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

from mtpkit.decoder.options import MAX_DEPTH

MAX_ROWS = MAX_DEPTH  # the widest verify pass measured: as deep as a forced depth goes
CONTEXT = 512  # cache length the curve is measured at first (a typical verify position)
GRAIN = 256  # contexts are priced in steps of this many tokens (rounded up): a round costs the
# same to a percent over 256 more keys, and the priced curve is reused by the rounds that follow
PAD_GAIN = 0.9  # pad a verify to a wider width only when that is 10% cheaper: a real kernel
# switch (MLX's quantized matmul from 8 rows on), not the noise between two medians. Also the
# sanity bound: a wider pass timed more than 10% cheaper is re-measured before it is believed.
MIN_REPEATS = 3  # timings whose median counts, at least: a median of fewer is one outlier away
# from wrong (decoder/tuning/costs.py's budget may force fewer)


@dataclass
class Point:
    """c(T) (16 rows, interpolated between the `timed` ones and smoothed as at the first
    context) and the plain step, measured at a longer `context` in `seconds`."""

    context: int
    verify: list[float]
    plain: float
    timed: list[int] = field(default_factory=list)
    smoothed: list[int] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class CostCurve:
    """Seconds: verify[T - 1] is one trunk pass over T rows (logits for all, synchronous);
    plain is one pipelined plain-decoding step; draft one chained head step (0: no head).
    How it was measured: at a `context`-token cache, `timed` the rows timed (the rest
    interpolated; [] given by hand), `remeasured` rows timed again because a wider pass came
    out cheaper, `smoothed` rows that still cost more than a wider pass and are priced and
    verified at that width, `seconds` the measurement's duration (all contexts'); `longer` the
    same measured at longer contexts, in order (none: priced alike at every context)."""

    verify: list[float]
    plain: float
    draft: float
    key: dict[str, Any] = field(default_factory=dict)
    estimate: bool = False  # timed on this machine: an estimate generations correct as they go
    # (decoder/tuning/policy.py); False: given by hand, a what-if taken as it is
    context: int = CONTEXT
    timed: list[int] = field(default_factory=list)
    remeasured: list[int] = field(default_factory=list)
    smoothed: list[int] = field(default_factory=list)
    seconds: float = 0.0
    # what judging the measurement needs, kept with it on disk (decoder/tuning/costs.py): the largest
    # median over fastest of one shape's repeats, when it began (epoch seconds), the 1-minute
    # load average per core then (None: unknown)
    spread: float = 1.0
    measured_at: float = 0.0
    load: float | None = None
    longer: list[Point] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._priced: dict[int, CostCurve] = {}  # by context: asked every round

    def at(self, length: int) -> CostCurve:
        """This curve priced at a `length`-token context (rounded up to GRAIN; see the
        module's doc): itself where it was measured at one context only."""
        if not self.longer:
            return self
        length = -(-max(length, 1) // GRAIN) * GRAIN
        if length not in self._priced:
            points = [(self.context, self.verify, self.plain),
                      *((p.context, p.verify, p.plain) for p in self.longer)]
            verify = [along([(c, v[t]) for c, v, _ in points], length)
                      for t in range(len(self.verify))]
            smoothed = sorted(set(self.smoothed).union(*(p.smoothed for p in self.longer)))
            self._priced[length] = replace(
                self, verify=verify, plain=along([(c, p) for c, _, p in points], length),
                context=length, smoothed=smoothed, longer=[])
        return self._priced[length]

    def contexts(self) -> list[int]:
        """The contexts measured, shortest first."""
        return [self.context, *(p.context for p in self.longer)]

    def width(self, rows: int) -> int:
        """The verify width to run `rows` rows at: the cheapest measured width >= rows where it
        is PAD_GAIN cheaper, else rows (extra rows are padding whose outputs are ignored)."""
        if rows > len(self.verify):
            return rows
        return self._widths[rows - 1]

    @cached_property
    def _widths(self) -> list[int]:  # asked for several times per round: computed once
        n, out = len(self.verify), []
        for rows in range(1, n + 1):
            if rows in self.smoothed:  # took a wider width's cost: verified at that width
                out.append(next((t for t in range(rows + 1, n + 1) if t not in self.smoothed
                                 and self.verify[t - 1] <= self.verify[rows - 1]), rows))
                continue
            wider = min(range(rows, n + 1), key=lambda t: (self.verify[t - 1], t))
            cheaper = self.verify[wider - 1] < PAD_GAIN * self.verify[rows - 1]
            out.append(wider if cheaper else rows)
        return out

    def round_cost(self, depth: int, drafted: int | None = None) -> float:
        """Seconds for one round of `depth` drafts, `drafted` of them by the head (default:
        all; context drafts are free) (0: one plain step)."""
        if depth == 0:
            return self.plain
        drafted = depth if drafted is None else drafted
        return drafted * self.draft + self.verify[self.width(depth + 1) - 1]

    def ratios(self) -> list[float]:
        """c(T) / c(1)."""
        return [c / self.verify[0] for c in self.verify]

    def to_dict(self) -> dict[str, Any]:
        """What `tune --json` prints (schemas/tune.schema.json)."""
        data = {k: v for k, v in asdict(self).items() if k not in ("estimate", *RECORD)}
        return {**data, "ratios": self.ratios(),
                "widths": [self.width(t) for t in range(1, len(self.verify) + 1)]}

    def stored(self) -> dict[str, Any]:
        """What the cache keeps (schemas/cache_curve.schema.json): to_dict and the record."""
        return {**self.to_dict(), **{k: getattr(self, k) for k in RECORD}}


RECORD = ("spread", "measured_at", "load")  # stored, not printed: how far to trust the timings


def along(points: list[tuple[int, float]], length: int) -> float:
    """The cost at `length` from (context, cost) points, shortest first: linear between two,
    the last segment's slope (at least 0) beyond the longest, the shortest's cost below it."""
    (first, cost), *rest = points
    if length <= first or not rest:
        return cost
    for (a, ca), (b, cb) in zip(points, rest, strict=False):
        if length <= b:  # (at a measured context: exactly what was measured there)
            return cb if length == b else ca + (cb - ca) * (length - a) / (b - a)
    (a, ca), (b, cb) = points[-2:]
    return cb + max((cb - ca) / (b - a), 0.0) * (length - b)


def breaks(verify: list[float]) -> list[int]:
    """Rows T whose pass was timed more than 1/PAD_GAIN dearer than some wider pass: noise
    (a loaded machine) until a second measurement agrees."""
    return [t for t in range(1, len(verify)) if min(verify[t:]) < PAD_GAIN * verify[t - 1]]


def smooth(verify: list[float]) -> tuple[list[float], list[int]]:
    """(curve, rows lowered): each breaking row takes the cost of the narrowest cheapest wider
    pass (what padding to it pays), so the curve is non-decreasing within PAD_GAIN."""
    out, lowered = list(verify), breaks(verify)
    for t in lowered:
        out[t - 1] = min(verify[t:])
    return out, lowered


def interpolate(timed: dict[int, float], rows: int = MAX_ROWS) -> list[float]:
    """c(1..rows) from the timed rows, linear between them (a pass's cost grows about
    linearly in its rows between two kernel switches)."""
    known = sorted(timed)
    out = []
    for t in range(1, rows + 1):
        if t in timed:
            out.append(timed[t])
            continue
        lo = max(k for k in known if k < t)
        hi = min(k for k in known if k > t)
        out.append(timed[lo] + (timed[hi] - timed[lo]) * (t - lo) / (hi - lo))
    return out
