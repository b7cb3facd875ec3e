"""`--depth auto`: each round's depth chosen by expected tokens per second.

A round at depth K yields 1 + a_1 + ... + a_K tokens on average, where a_i is the chance that the
first i drafts are all kept, and costs K head drafts plus a verify pass (`CostCurve.round_cost`).
A plain step yields one token per `plain` seconds. The a_i are learned online from the rounds of
this generation (an exponentially decayed count, started from a prior), so the depth follows the
text: deep on boilerplate, shallow on prose, plain where the head helps nothing. Choosing the
depth from past rounds only keeps decoding exact (each round is exact for any depth fixed before
its drafts are seen).

When plain decoding wins, the session decodes plainly (pipelined, as fast as depth 0) for a
stretch, then probes one depth-1 round to see whether the head has become useful; a probe that
does not switch back doubles the stretch (up to MAX_STRETCH), so a head that drafts nothing
useful costs a fraction of a percent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtpkit.decoder.costs import CostCurve

DECAY = 0.97  # per round: about the last 30 rounds weigh in
PRIOR_WEIGHT = 2.0  # rounds' worth of belief in the prior
PRIOR = 0.5  # a_1 before anything is measured; a_i = PRIOR ** i
MIN_STRETCH = 16
MAX_STRETCH = 512
MARGIN = 1.02  # speculation must beat plain by this much to be chosen


@dataclass
class DepthPolicy:
    curve: CostCurve
    max_depth: int
    prior: float = PRIOR
    kept: list[float] = field(default_factory=list)  # decayed successes per position
    seen: list[float] = field(default_factory=list)  # decayed trials per position
    stretch: int = MIN_STRETCH
    chosen: dict[int, int] = field(default_factory=dict)  # depth -> rounds (0: plain steps)

    def __post_init__(self) -> None:
        self.kept = self.kept or [0.0] * self.max_depth
        self.seen = self.seen or [0.0] * self.max_depth

    def acceptance(self) -> list[float]:
        """a_1..a_max: estimated chance that the first i drafts are kept (non-increasing; a
        position never tried extrapolates the last measured conditional rate)."""
        out: list[float] = []
        for i in range(self.max_depth):
            if not out:
                prior = self.prior
            else:  # the last measured conditional rate carries on
                prior = out[-1] * (out[-1] / out[-2] if len(out) > 1 and out[-2] > 0 else out[-1])
            rate = (self.kept[i] + PRIOR_WEIGHT * prior) / (self.seen[i] + PRIOR_WEIGHT)
            out.append(min(rate, out[-1]) if out else rate)
        return out

    def rate(self, depth: int, acceptance: list[float] | None = None) -> float:
        """Expected tokens per second at `depth` (0: plain decoding)."""
        a = self.acceptance() if acceptance is None else acceptance
        return (1.0 + sum(a[:depth])) / self.curve.round_cost(depth)

    def best(self) -> int:
        """The depth with the highest expected rate; 0 unless speculation beats plain by
        MARGIN."""
        a = self.acceptance()
        depth = max(range(1, self.max_depth + 1), key=lambda d: self.rate(d, a), default=0)
        if depth == 0 or self.rate(depth, a) < MARGIN * self.rate(0, a):
            return 0
        return depth

    def predicted_speedup(self, depth: int | None = None) -> float:
        """Expected rate at `depth` (default: the best) over plain decoding's."""
        depth = self.best() if depth is None else depth
        return self.rate(depth) / self.rate(0)

    def record(self, depth: int, accepted: int) -> None:
        """One verified round: drafts 1..accepted kept out of `depth`."""
        for i in range(self.max_depth):
            self.kept[i] *= DECAY
            self.seen[i] *= DECAY
        for i in range(min(depth, self.max_depth)):
            self.seen[i] += 1.0
            self.kept[i] += i < accepted
        self.chosen[depth] = self.chosen.get(depth, 0) + 1

    def plain_stretch(self) -> int:
        """Tokens to decode plainly before the next probe; each call doubles the next one.
        Called only when `best` chose plain; `reset_stretch` after speculation wins again."""
        n, self.stretch = self.stretch, min(2 * self.stretch, MAX_STRETCH)
        return n

    def reset_stretch(self) -> None:
        self.stretch = MIN_STRETCH
