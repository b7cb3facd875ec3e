"""Which RMSNorm convention an MTP head's gains are stored in, decided once per head.

Trained gains sit far from 0 and 1 (published zero-centred Qwen3.5/3.6 heads: layer norms
0.30-0.39, q/k norms ~0.74, final norm ~2.6), so a vector's own mean cannot tell "zero-centred"
from "+1 applied". The trunk's gains of the same role can: their convention is known from the
checkpoint kind (Hugging Face stores them zero-centred, mlx-lm's sanitize adds +1), and a head
trained beside them has gains of the same size. Each role votes for the offset (-1, 0 or +1)
that puts the head's mean inside the trunk's range for that role; roles that cannot tell
(several offsets fit, or none) abstain.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mtpkit.loaders.families import NORM_TWINS, is_shifted_norm, norm_role

ABSOLUTE = 1  # the level of gains stored with +1 applied, as mlx-lm stores trunk norms
LEVEL_NAMES = {0: "delta", 1: "absolute", 2: "shifted_twice"}
DESCRIPTIONS = {0: "zero-centred", 1: "shifted (+1)", 2: "shifted twice (+2)"}
FIT = 0.25  # an offset fits when the re-encoded head mean lies this close to the trunk's range
GAP = 0.5  # ... and every other offset lies at least this much further away


@dataclass(frozen=True)
class RoleEvidence:
    """One role's comparison: the head's mean gain against the trunk's gains of its twin roles."""

    role: str
    head_mean: float
    trunk_low: float
    trunk_high: float
    offset: int | None  # head level minus trunk level this role shows; None: it cannot tell

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "head_mean": round(self.head_mean, 4),
                "trunk_mean": [round(self.trunk_low, 4), round(self.trunk_high, 4)],
                "offset": self.offset}

    def describe(self) -> str:
        trunk = (f"{self.trunk_low:.2f}" if self.trunk_high - self.trunk_low < 0.005
                 else f"{self.trunk_low:.2f}..{self.trunk_high:.2f}")
        verdict = "?" if self.offset is None else f"{self.offset:+d}"
        return f"{self.role} {self.head_mean:.2f} vs {trunk} ({verdict})"


@dataclass
class NormDecision:
    """The head's encoding relative to the trunk's, with the evidence it was decided from."""

    trunk_level: int  # 0 zero-centred (Hugging Face), 1 absolute (MLX)
    evidence: list[RoleEvidence] = field(default_factory=list)
    offsets: dict[str, int | None] = field(default_factory=dict)  # head gain -> its offset

    @property
    def _decided(self) -> set[int]:
        return {o for o in self.offsets.values() if o is not None}

    @property
    def consistent(self) -> bool:
        """Every decided gain shares one offset (the head uses one convention throughout)."""
        return len(self._decided) <= 1

    @property
    def offset(self) -> int | None:
        """The head's single offset from the trunk, or None when undecided or mixed."""
        found = self._decided
        return found.pop() if len(found) == 1 and None not in self.offsets.values() else None

    @property
    def encoding(self) -> str | None:
        """delta | absolute | shifted_twice | mixed, or None when no role could tell."""
        if not self.consistent:
            return "mixed"
        found = self._decided
        return LEVEL_NAMES[self.trunk_level + found.pop()] if found else None

    def shifts(self, target: int) -> dict[str, float] | None:
        """Per-gain additions that bring the head to `target`'s level, or None when some gain's
        encoding is unknown (re-encoding it would be a guess)."""
        if None in self.offsets.values():
            return None
        return {name: float(target - self.trunk_level - o) for name, o in self.offsets.items()
                if target != self.trunk_level + o}

    def describe(self) -> str:
        return "; ".join(e.describe() for e in self.evidence)


def role_offset(head_mean: float, trunk_means: list[float], trunk_level: int) -> int | None:
    """The offset (head level - trunk level) that fits the trunk's range, or None if not one."""
    low, high = min(trunk_means), max(trunk_means)
    dist = {}
    for offset in range(-trunk_level, 3 - trunk_level):
        x = head_mean - offset
        dist[offset] = max(0.0, low - x, x - high)
    best = min(dist, key=dist.__getitem__)
    others = [d for o, d in dist.items() if o != best]
    return best if dist[best] <= FIT and all(d - dist[best] >= GAP for d in others) else None


def decide(head: dict[str, float], trunk: dict[str, float], trunk_level: int) -> NormDecision:
    """Decide from the mean gains of the head (canonical name -> mean) and the trunk (name ->
    mean). Roles that tell agree: every gain takes that offset. Roles that disagree (a head
    mixed by a converter that shifted some gains only): each gain keeps its own role's offset,
    and a gain whose role cannot tell takes the offset most roles show (none on a tie)."""
    by_role: dict[str, list[float]] = {}
    for name, mean in trunk.items():
        if (role := norm_role(name)) is not None:
            by_role.setdefault(role, []).append(mean)
    decision = NormDecision(trunk_level)
    role_offsets: dict[str, int | None] = {}
    for name, mean in sorted(head.items()):
        role = norm_role(name)
        if role is None:
            continue
        twins = [m for r in NORM_TWINS.get(role, (role,)) for m in by_role.get(r, [])]
        offset = role_offset(mean, twins, trunk_level) if twins else None
        if twins:
            decision.evidence.append(RoleEvidence(role, mean, min(twins), max(twins), offset))
        role_offsets[name] = offset
    votes = Counter(o for o in role_offsets.values() if o is not None).most_common()
    fallback = votes[0][0] if votes and (len(votes) == 1 or votes[0][1] > votes[1][1]) else None
    decision.offsets = {n: fallback if o is None else o for n, o in role_offsets.items()}
    return decision


def absolute_from_delta(arrays: dict[str, Any]) -> dict[str, Any]:
    """Every norm gain of a zero-centred (delta) head moved by +1 (the Hugging Face convention,
    as mlx-lm's sanitize applies it to the trunk): the one place the +1 is written."""
    return {n: a + 1.0 if is_shifted_norm(n) and a.ndim == 1 else a for n, a in arrays.items()}


def reencode(arrays: dict[str, Any], shifts: dict[str, float]) -> dict[str, Any]:
    """`arrays` with each gain named in `shifts` moved by its shift (lazy arrays stay lazy)."""
    return {n: a + shifts[n] if n in shifts else a for n, a in arrays.items()}
