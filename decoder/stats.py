"""What a generation measured: speculation counters and honest timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


def shares(accepted: list[int], proposed: list[int]) -> list[float]:
    """Kept share per draft position, up to the deepest position ever drafted: a position
    never drafted has no acceptance (not 0%), so an answer decoded plain reports none."""
    drafted = [i for i, p in enumerate(proposed) if p]
    n = drafted[-1] + 1 if drafted else 0
    return [a / p if p else 0.0 for a, p in zip(accepted[:n], proposed[:n], strict=True)]


@dataclass
class Stats:
    """Counters are per generation. Decode tok/s is measured over the decode window (first
    committed token to last), so prefill and time-to-first-token never inflate it."""

    depth: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    verify_calls: int = 0
    proposed: list[int] = field(default_factory=list)  # per draft position
    accepted: list[int] = field(default_factory=list)
    bonus: int = 0  # rounds where every draft was kept
    corrections: int = 0  # rounds ended by a rejection
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_window_s: float = 0.0
    peak_memory_bytes: int = 0
    # --depth auto: rounds per chosen depth (0: plain steps), and the seconds the measured cost
    # curve predicts for them (plain_s: one plain step), for the predicted speedup
    depths: dict[int, int] = field(default_factory=dict)
    # per draft source ("head", "lookup"): rounds, and drafts proposed / kept per position
    sources: dict[str, dict[str, Any]] = field(default_factory=dict)
    predicted_s: float = 0.0
    plain_s: float = 0.0
    # --depth auto on a measured curve: paid / prior per pass shape, "rows x width" (+ " piped")
    # (decoder/tuning/policy.py's CostTable.summary)
    cost_scale: dict[str, float] = field(default_factory=dict)
    # per verified round: (perf_counter at its verdict, tokens committed before it, depth, kept),
    # so acceptance and tok/s can be drawn over the rounds of a generation
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.proposed = self.proposed or [0] * self.depth
        self.accepted = self.accepted or [0] * self.depth

    def count_round(self, source: str, depth: int, kept: int, bonus: bool) -> None:
        """One verified round of `depth` drafts from `source`, `kept` of them kept."""
        self.verify_calls += 1
        self.bonus += bonus
        self.corrections += not bonus
        self.timeline.append((time.perf_counter(), self.generated_tokens, depth, kept))
        mine = self.sources.setdefault(source, {"rounds": 0, "proposed": [0] * self.depth,
                                                 "accepted": [0] * self.depth})
        mine["rounds"] += 1
        for i in range(depth):
            self.proposed[i] += 1
            self.accepted[i] += i < kept
            mine["proposed"][i] += 1
            mine["accepted"][i] += i < kept

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Share of rounds proposing a draft at position i whose draft i was kept (positions
        never drafted left out)."""
        return shares(self.accepted, self.proposed)

    @property
    def drafted_depth(self) -> int:
        """The deepest draft position any round verified; 0: the answer was decoded plain
        (whatever depth was allowed)."""
        return len(self.acceptance_by_depth)

    def rounds(self) -> dict[str, list]:
        """The timeline as columns: seconds since the first round, tokens committed by the end
        of each round (plain steps between rounds included), depth and drafts kept."""
        t0 = self.timeline[0][0] if self.timeline else 0.0
        return {"t": [round(t - t0, 6) for t, *_ in self.timeline],
                "tokens": [n + k + 1 for _, n, _, k in self.timeline],
                "depth": [d for *_, d, _ in self.timeline], "kept": [k for *_, k in self.timeline]}

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / self.verify_calls if self.verify_calls else 0.0

    @property
    def predicted_speedup(self) -> float | None:
        """What the cost curve and this generation's acceptance predict over plain decoding
        (tokens after the first, each worth one plain step, over the predicted seconds)."""
        n = self.generated_tokens - 1
        if not self.depths or self.predicted_s <= 0 or n <= 0 or not self.verify_calls:
            return None  # nothing speculated: no speedup to predict
        return n * self.plain_s / self.predicted_s

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = self.generated_tokens - 1
        return n / self.decode_window_s if n > 0 and self.decode_window_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "depth": self.depth, "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens, "verify_calls": self.verify_calls,
            "drafted_depth": self.drafted_depth,
            "acceptance_by_depth": self.acceptance_by_depth, "mean_accepted": self.mean_accepted,
            "bonus": self.bonus, "corrections": self.corrections, "ttft_s": self.ttft_s,
            "prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps,
            "decode_window_s": self.decode_window_s, "peak_memory_bytes": self.peak_memory_bytes,
            "depths": {str(d): n for d, n in self.depths.items()},
            "sources": {s: {**v, "acceptance_by_depth": shares(v["accepted"], v["proposed"])}
                        for s, v in self.sources.items()},
            "predicted_speedup": self.predicted_speedup, "cost_scale": self.cost_scale,
        }
