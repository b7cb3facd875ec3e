"""What a graft's budget buys and whether its head can pay, from costs measured on this machine.

`--minutes` bounds the whole command, so the held-out scoring and the writing are reserved out of
it before training starts: their cost is planned from a plain decode step, a depth-1 round and a
prefill token timed (decoder/tuning/costs.py's measure_decoding) with the real trunk and a head of the
real shape (a round costs the same
whatever the head learned). After training the same probe runs again on the decoding graph a
user gets, and with the measured acceptance gives the depth-1 speedup to expect here: a round
commits 1 + acceptance tokens for the cost of `round_steps` plain steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mtpkit.decoder.model.blas import fix
from mtpkit.decoder.tuning.costs import DecodeCosts

SCORING_SHARE = 0.25  # at most this share of a --minutes budget scores; fewer prompts beyond it
WRITE_BYTES_PER_S = 100e6  # a conservative copy + fsync rate for writing OUT
WRITE_FIXED_S = 2.0
PAYS_MARGIN = 1.05  # an expected speedup below this is within run-to-run noise: no gain


@dataclass
class Plan:
    """How the budget splits: what was spent before training, what training may use, and what
    is reserved for scoring `raw` + `chat` held-out prompts and for writing OUT."""

    total_s: float  # the whole command (inf: --steps alone)
    setup_s: float  # loading, tokenizing and the first probe
    scoring_s: float
    writing_s: float
    raw: int
    chat: int
    costs: DecodeCosts

    @property
    def training_s(self) -> float:
        return self.total_s - self.setup_s - self.scoring_s - self.writing_s

    def to_dict(self) -> dict[str, Any]:
        bounded = not math.isinf(self.total_s)  # JSON has no Infinity
        return {"minutes": self.total_s / 60 if bounded else None, "setup_s": self.setup_s,
                "reserved_training_s": self.training_s if bounded else None,
                "reserved_scoring_s": self.scoring_s, "reserved_writing_s": self.writing_s,
                "planned_prompts": {"raw": self.raw, "chat": self.chat}}


def plan(total_s: float, setup_s: float, costs: DecodeCosts, raw: list[int], chat: list[int],
         tokens: int, probe_len: int, write_bytes: int) -> Plan:
    """Reserve scoring and writing out of the budget. Raw and chat prompts (their token counts)
    are taken in proportion, as many as fit in SCORING_SHARE of what setup and writing leave,
    at least one raw prompt; the closing probe is reserved too."""
    writing = WRITE_FIXED_S + write_bytes / WRITE_BYTES_PER_S
    cap = SCORING_SHARE * (total_s - setup_s - writing)
    order = sorted([(i / len(raw), 0, n) for i, n in enumerate(raw)]
                   + [(i / len(chat), 1, n) for i, n in enumerate(chat)])
    spent = costs.probe_s(probe_len)
    counts = [0, 0]
    for _, kind, length in order:
        cost = costs.prompt_s(length, tokens)
        if counts[0] and spent + cost > cap:
            break
        spent += cost
        counts[kind] += 1
    return Plan(total_s, setup_s, spent, writing, counts[0], counts[1], costs)


def verdict(acceptance: float, costs: DecodeCosts, blas: str | None) -> dict[str, Any]:
    """The depth-1 speedup to expect here, whether it pays and, when not, why (numbers)."""
    expected = (1 + acceptance) / costs.round_steps
    record: dict[str, Any] = {"depth1": expected, "acceptance": acceptance,
                              "round_steps": costs.round_steps, "pays": expected >= PAYS_MARGIN}
    if record["pays"]:
        return record
    needed = PAYS_MARGIN * costs.round_steps - 1
    why = (f"a depth-1 round costs {costs.round_steps:.2f} plain decode steps here and commits "
           f"{1 + acceptance:.2f} tokens ({100 * acceptance:.1f}% of held-out drafts accepted), "
           f"so depth-1 decoding would run at {expected:.2f}x of plain")
    if needed >= 1:
        why += "; no acceptance can pay for a round this dear"
    else:
        why += f"; paying needs at least {100 * needed:.0f}% acceptance at this cost"
    if blas == "reference":
        why += ("; MLX runs on its wheel's reference BLAS, which makes a 2-token verify cost "
                f"about 2 steps and trains far fewer steps per minute: {fix()}, then graft again")
    elif needed < 1:
        why += "; train longer (--minutes) or on text closer to what you will decode (--corpus)"
    record["why"] = why
    return record
