"""The processed next-token distribution, computed exactly as mlx-lm's sampler computes it.

Speculative sampling keeps the plain sampler's law only when the target's p is the *processed*
distribution mlx-lm samples from (a draft's q may be any law the draft is drawn from; the nearer
p, the more is kept). `logprobs` chains mlx-lm's own filters in `make_sampler`'s
order (log-softmax, top-p, min-p, top-k) before the temperature: the reference law. The decoder
draws from `candidates`, the same law kept on the device: with a top-k (the usual code settings,
top_k 20) only the k most likely tokens can survive the chain, so a partial selection finds them
and top-p and min-p are decided on those k alone, without sorting the vocabulary (mlx-lm's top-p
sorts all of it). tests/test_decoder.py checks the two laws equal on every filter combination.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mtpkit.decoder.options import SamplingParams


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


SPARSE_TOP_K = 1024  # above this a top-k keeps dense rows (acceptance compares k x k ids)


@dataclass(frozen=True)
class Candidates:
    """Rows of processed distributions on the device: `probs` (R, W) over the token ids `ids`
    (R, W), or, with ids None, over the whole vocabulary in id order. Padding has id -1 and
    probability 0. A deterministic draft's q is one candidate of probability 1 (`one_hot`)."""

    probs: mx.array
    ids: mx.array | None = None

    def tokens(self, columns: mx.array) -> mx.array:
        """Token ids of per-row column indices (R,)."""
        if self.ids is None:
            return columns.astype(mx.int32)
        return mx.take_along_axis(self.ids, columns[:, None], axis=-1)[:, 0]

    def at(self, tokens: mx.array) -> mx.array:
        """(R,) the probability row r gives tokens[r]."""
        if self.ids is None:
            return mx.take_along_axis(self.probs, tokens[:, None], axis=-1)[:, 0]
        return mx.where(self.ids == tokens[:, None], self.probs, 0.0).sum(axis=-1)

    def on(self, other: Candidates) -> mx.array:
        """These rows' probabilities on `other`'s columns (same row count)."""
        if other.ids is None and self.ids is None:
            return self.probs
        if other.ids is None:  # sparse on dense: scatter (no padding outside sparse mode)
            return mx.put_along_axis(mx.zeros_like(other.probs), self.ids, self.probs, axis=-1)
        if self.ids is None:
            return mx.take_along_axis(self.probs, mx.maximum(other.ids, 0), axis=-1)
        same = other.ids[:, :, None] == self.ids[:, None, :]
        return mx.where(same, self.probs[:, None, :], 0.0).sum(axis=-1)

    def draw(self, noise: mx.array) -> mx.array:
        """(R,) token ids, one drawn from each row by the Gumbel-max trick from `noise`,
        uniforms in [0, 1) shaped like the rows (as mx.random.categorical draws, but from
        uniforms the caller drew for the whole round in one op: on a GPU each keyed random op
        costs about as much as the filter itself)."""
        gumbel = -mx.log(-mx.log(noise))
        return self.tokens(mx.argmax(mx.log(self.probs) + gumbel, axis=-1))

    @property
    def width(self) -> int:
        return self.probs.shape[-1]

    def __getitem__(self, rows: slice | mx.array) -> Candidates:
        return Candidates(self.probs[rows], None if self.ids is None else self.ids[rows])

    @staticmethod
    def concat(parts: list[Candidates]) -> Candidates:
        if parts[0].ids is None:
            return Candidates(mx.concatenate([p.probs for p in parts]))
        width = max(p.width for p in parts)

        def pad(a: mx.array, value: int) -> mx.array:  # to `width` columns (id -1, prob 0)
            return mx.pad(a, [(0, 0), (0, width - a.shape[-1])], constant_values=value)

        return Candidates(mx.concatenate([pad(p.probs, 0) for p in parts]),
                          mx.concatenate([pad(p.ids, -1) for p in parts]))

    @staticmethod
    def one_hot(tokens: list[int], like: Candidates | None = None) -> Candidates:
        """The q of deterministic drafts, in the layout of `like` (dense rows where `like` is
        dense, so a chain's rows concatenate)."""
        ids = mx.array(tokens, dtype=mx.int32)[:, None]
        if like is not None and like.ids is None:
            vocab = like.probs.shape[-1]
            return Candidates((mx.arange(vocab)[None] == ids).astype(mx.float32))
        return Candidates(mx.ones(ids.shape, dtype=mx.float32), ids)


def sparse(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab and params.top_k <= SPARSE_TOP_K


def candidate_width(params: SamplingParams, vocab: int) -> int:
    """How many columns `candidates` gives a row: the top k, or the vocabulary."""
    return params.top_k if sparse(params, vocab) else vocab


def candidates(logits: mx.array, params: SamplingParams, drafter: bool = False) -> Candidates:
    """The processed law of each row of logits (R, V), lazily; see the module docstring.

    drafter: a draft's q, which may be any law the draft is drawn from (acceptance stays exact
    whatever q is; the nearer p, the more drafts are kept). With a top-k its top-p mass is
    taken over the top k alone, which saves the pass over the vocabulary that p's exact mass
    needs; it cuts no later than p's nucleus, so q only misses tokens p's residual covers."""
    vocab = logits.shape[-1]
    if not sparse(params, vocab):
        return Candidates(mx.softmax(tempered(logits, params), axis=-1))
    return _top_k_candidates(logits, params.top_k, params.top_p, params.min_p,
                             params.temperature, not drafter)


def _top_k_candidates(logits: mx.array, k: int, top_p: float, min_p: float,
                      temperature: float, vocabulary_mass: bool) -> Candidates:
    """mlx-lm's chain on the k most likely tokens. Top-p keeps a token while the mass above it
    (the larger tokens, summed largest first as mlx-lm sums them) is below top_p of the total
    mass, and every token tied with the last kept one; min-p keeps tokens within log(min_p)
    of the largest; top-k then keeps at most k, all of which are here. `vocabulary_mass`:
    the total is the whole vocabulary's (mlx-lm's law), else the top k's."""
    out = logits.astype(mx.float32)
    ids = mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(out, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    vals, ids = mx.take_along_axis(vals, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)
    keep = mx.ones(vals.shape, dtype=mx.bool_)
    if 0 < top_p < 1.0:
        top = vals[..., :1]
        probs = mx.exp(vals - top)
        total = mx.exp(out - top).sum(axis=-1, keepdims=True) if vocabulary_mass else probs.sum(
            axis=-1, keepdims=True)
        above = mx.cumsum(probs, axis=-1, inclusive=False)
        last = mx.where(above < top_p * total, vals, mx.inf).min(axis=-1, keepdims=True)
        keep = vals >= last
    if min_p != 0.0:
        keep = keep & (vals >= vals[..., :1] + math.log(min_p))
    tempered = mx.where(keep, vals, -mx.inf) * (1.0 / temperature)
    return Candidates(mx.softmax(tempered, axis=-1), ids.astype(mx.int32))


def greedy(logits: mx.array, keepdims: bool = False) -> mx.array:
    """Lazy argmax over the last axis in float32: the plain and speculative paths both break
    ties here (lowest id)."""
    return mx.argmax(logits.astype(mx.float32), axis=-1, keepdims=keepdims)

