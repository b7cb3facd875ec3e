"""Leviathan/Chen acceptance: which drafts to keep and which token to emit after them.

A pure function over processed distributions, so its exactness can be tested on its own and the
decoder cannot apply a different rule in different places.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mtpkit.decoder.sampling import draw


@dataclass(frozen=True)
class Verdict:
    accepted: int  # how many drafts were kept
    token: int  # the correction (after a rejection) or the bonus (all kept)

    def bonus(self, depth: int) -> bool:
        return self.accepted == depth


def accept_greedy(drafts: list[int], targets: list[int]) -> Verdict:
    """Temperature 0: keep drafts while they equal the target's argmax; emit the next argmax."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return Verdict(n, targets[n])


def accept_sampled(drafts: list[int], q: np.ndarray, p: np.ndarray,
                   rng: np.random.Generator) -> Verdict:
    """q: (K, V) drafter distributions the drafts were drawn from; p: (K+1, V) target's.

    Keep draft i with probability min(1, p_i(x)/q_i(x)); on the first rejection emit a token
    from normalize(max(0, p_i - q_i)); when all K are kept emit a bonus token from p_{K+1}.
    """
    for i, x in enumerate(drafts):
        if rng.random() * q[i, x] < p[i, x]:
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        if residual.sum() <= 0.0:  # p == q up to rounding: the draft could not have been rejected
            residual = p[i]
        return Verdict(i, draw(residual / residual.sum(), rng))
    return Verdict(len(drafts), draw(p[len(drafts)], rng))
