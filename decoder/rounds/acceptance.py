"""Leviathan/Chen acceptance on the device: which drafts to keep and which token to emit.

Pure functions of the round's arrays, so their exactness can be tested on their own and the
decoder cannot apply a different rule in different places. Everything stays lazy: the host
reads one small array per round (the drafts, the kept count and the emitted token).
"""

from __future__ import annotations

import mlx.core as mx

from mtpkit.decoder.sampling import Candidates, greedy


def kept_prefix(accepted: mx.array) -> mx.array:
    """How many leading entries of a boolean row are true (none: 0, without a cumprod of
    nothing, which MLX 0.32.2 ends with a floating point exception)."""
    if accepted.shape[0] == 0:
        return mx.array(0, dtype=mx.int32)
    return mx.cumprod(accepted.astype(mx.int32)).sum()


def accept_greedy(drafts: mx.array, targets: mx.array) -> mx.array:
    """Temperature 0: keep drafts (K,) while they equal the target's argmax (K+1,); emit the
    next argmax. Returns [kept, token]."""
    kept = kept_prefix(drafts == targets[:drafts.shape[0]])
    return _verdict(kept, targets[kept])


def accept_greedy_rows(tokens: mx.array, logits: mx.array, depths: mx.array) -> mx.array:
    """accept_greedy for every row of a batch at once: tokens (B, T) (the last committed
    token, then row b's depths[b] drafts, then padding), logits (B, T, V). Returns (B, 2):
    each row's [kept, token]."""
    targets = greedy(logits)
    rows, width = tokens.shape
    if width == 1:  # no drafts in the pass (and no cumprod of nothing: see kept_prefix)
        kept = mx.zeros((rows,), mx.int32)
    else:
        drafted = mx.arange(width - 1)[None] < depths[:, None]
        match = (tokens[:, 1:] == targets[:, :-1]) & drafted
        kept = mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1)
    token = mx.take_along_axis(targets, kept[:, None], axis=1)[:, 0]
    return mx.stack([kept.astype(mx.int32), token.astype(mx.int32)], axis=1)


def accept_sampled(drafts: mx.array, q: Candidates | None, p: Candidates,
                   noise: mx.array) -> mx.array:
    """drafts (K,) drawn from q's K rows; p: the target's K+1 rows; noise: K + p.width
    uniforms in [0, 1) (the ratio tests', then the emitted token's draw). Keep draft i with
    probability min(1, p_i(x)/q_i(x)); on the first rejection emit a token from
    normalize(max(0, p_i - q_i)); when all K are kept emit a bonus token from p_{K+1}.
    Returns [kept, token]."""
    depth = drafts.shape[0]
    draw = noise[None, depth:]
    if depth == 0 or q is None:
        return _verdict(mx.array(0), p[:1].draw(draw)[0])
    ratio = noise[:depth] * q.at(drafts) < p[:depth].at(drafts)
    kept = kept_prefix(ratio)
    residual = mx.maximum(p.probs[:depth] - q.on(p[:depth]), 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # p == q up to rounding: the draft could not have been rejected; p keeps the row a law
    residual = mx.where(mass > 0, residual, p.probs[:depth])
    rows = Candidates(mx.concatenate([residual, p.probs[depth:depth + 1]]),
                      None if p.ids is None else p.ids[:depth + 1])
    return _verdict(kept, rows[kept[None]].draw(draw)[0])  # the row a device index picks


def _verdict(kept: mx.array, token: mx.array) -> mx.array:
    return mx.stack([kept.astype(mx.int32), token.astype(mx.int32)])
