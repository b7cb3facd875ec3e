"""Teaching a grafted head to copy: supervise where its attention looks.

A one-layer head sees the trunk hidden at t and the token at t+1. When the text repeats itself
(small models' greedy text loops), the token at t+2 already followed an earlier occurrence of
the same tokens, and the head position that holds it as its input token is a key the head could
attend to — but it must find it through the trunk's final hidden, whose current-token signal is
weak, and cross-entropy alone teaches that slowly. So, where a 3-token lookup in the window finds
the trunk's target, one group of query heads (those sharing the first key/value head) is also
trained to put its attention on that position. On SmolLM2 (472 steps on 448 cached rollouts)
held-out code acceptance went 23.8% -> 32.6% (docs/benchmarks-history.md, issue 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mtpkit.decoder.drafters.misses import lookup_sources


@dataclass(frozen=True)
class QueryKeyForm:
    """How an mlx-lm attention module forms its queries and keys (the parts before RoPE)."""

    heads: str  # attribute holding the number of query heads
    kv_heads: str
    gated: bool = False  # q_proj emits [queries, output gate] per head
    qk_norm: bool = False  # per-head q_norm / k_norm


_PLAIN = QueryKeyForm("n_heads", "n_kv_heads")
_GATED = QueryKeyForm("num_attention_heads", "num_key_value_heads", gated=True, qk_norm=True)
# The attention classes a head layer can be (by module and class name); others are not
# supervised and the graft records that.
QUERY_KEY_FORMS = {
    "mlx_lm.models.llama.Attention": _PLAIN,
    "mlx_lm.models.qwen2.Attention": _PLAIN,
    "mlx_lm.models.qwen3.Attention": QueryKeyForm("n_heads", "n_kv_heads", qk_norm=True),
    "mlx_lm.models.qwen3_next.Qwen3NextAttention": _GATED,
    "mlx_lm.models.qwen3_5.Attention": _GATED,
}


def attention_of(layer: nn.Module) -> tuple[nn.Module, QueryKeyForm] | None:
    """The layer's attention module and its form, or None when copying is not supervised."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not hasattr(layer, "input_layernorm"):
        return None
    form = QUERY_KEY_FORMS.get(f"{type(attn).__module__}.{type(attn).__qualname__}")
    return (attn, form) if form is not None else None


def copy_sources(tokens: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """(windows, seq_len): for head position t (token t+1 in, target at t+2), the head position
    whose input token is the target, when a 3-token lookup in the window drafts the target;
    -1 elsewhere. `tokens` are the windows (seq_len + 2), `targets` the trunk's greedy tokens."""
    out = np.full(targets.shape, -1, dtype=np.int32)
    for w, (window, target) in enumerate(zip(tokens.tolist(), targets.tolist(), strict=True)):
        sources = lookup_sources(window)
        for t, want in enumerate(target):
            source = sources[t + 2]
            if source >= 0 and window[source] == want:
                out[w, t] = source - 1  # head position source - 1 reads token `source`
    return out


def copy_loss(layer: nn.Module, x: mx.array, sources: mx.array) -> mx.array:
    """Mean negative log attention, over the first key/value group's query heads, from each
    position with a source (sources >= 0) to that source; x is the layer's input (B, L, H)."""
    attn, form = attention_of(layer)  # type: ignore[misc]
    heads, kv_heads = getattr(attn, form.heads), getattr(attn, form.kv_heads)
    group = heads // kv_heads
    b, n, _ = x.shape
    xn = layer.input_layernorm(x)
    q = attn.q_proj(xn).reshape(b, n, heads, -1)
    if form.gated:
        q = mx.split(q, 2, axis=-1)[0]
    k = attn.k_proj(xn).reshape(b, n, kv_heads, -1)
    q, k = q[:, :, :group], k[:, :, :1]
    if form.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = attn.rope(q.transpose(0, 2, 1, 3)), attn.rope(k.transpose(0, 2, 1, 3))
    scores = (q @ k.transpose(0, 1, 3, 2)) * attn.scale + mx.triu(mx.full((n, n), -1e9), k=1)
    logp = scores - mx.logsumexp(scores, axis=-1, keepdims=True)  # (B, group, L, L)
    picked = mx.take_along_axis(logp, mx.maximum(sources, 0)[:, None, :, None], axis=-1)[..., 0]
    has = (sources >= 0).astype(logp.dtype)
    return -mx.sum(picked.mean(axis=1) * has) / mx.maximum(mx.sum(has), 1.0)
