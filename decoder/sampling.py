"""The processed next-token distribution, computed exactly as mlx-lm's sampler computes it.

Speculative sampling is exact only when the drafter's q and the target's p are the *processed*
distributions of the plain sampler, so both paths call `logprobs` here, which chains mlx-lm's own
filters in `make_sampler`'s order (log-softmax, top-p, min-p, top-k) before the temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Filtered log-probabilities over the last axis (before temperature), as mlx-lm filters."""
    out = logits.astype(mx.float32)
    out = out - mx.logsumexp(out, axis=-1, keepdims=True)
    if 0 < params.top_p < 1.0:
        out = apply_top_p(out, params.top_p)
    if params.min_p != 0.0:
        out = apply_min_p(out, params.min_p)
    if 0 < params.top_k < out.shape[-1]:
        out = apply_top_k(out, params.top_k)
    return out


def tempered(logits: mx.array, params: SamplingParams) -> mx.array:
    """The logits mlx-lm's categorical sampling draws from: filtered logprobs / temperature."""
    return logprobs(logits, params) * (1.0 / params.temperature)


def probabilities(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """Processed distribution(s) as float64 rows that sum to 1 (for the acceptance test)."""
    probs = np.array(mx.softmax(tempered(logits, params), axis=-1), dtype=np.float64)
    return probs / probs.sum(axis=-1, keepdims=True)


def greedy(logits: mx.array, keepdims: bool = False) -> mx.array:
    """Lazy argmax over the last axis in float32: the plain and speculative paths both break
    ties here (lowest id)."""
    return mx.argmax(logits.astype(mx.float32), axis=-1, keepdims=keepdims)


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a float64 distribution by inverse CDF (one uniform per draw)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))
