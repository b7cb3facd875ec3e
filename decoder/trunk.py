"""The trunk: mlx-lm's own model, with the hidden states the MTP head needs.

mlx-lm's inner text model returns the final-normed hidden state and the outer model turns it into
logits; calling the two halves separately gives the post-norm hidden without re-implementing any
layer. The pre-norm hidden (for heads trained on it) is read by wrapping the final norm module.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mtpkit.decoder.caches import quantize
from mtpkit.decoder.options import KVQuant
from mtpkit.decoder.recording import install, recorded
from mtpkit.decoder.shapes import bounded_caches
from mtpkit.decoder.traced import TracedPasses

INNER = ("model", "backbone")  # where mlx-lm's classes keep the inner text model (Nemotron-H:
# backbone)


class _NormTap(nn.Module):
    """The trunk's final norm, remembering its input (the pre-norm hidden state)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.last_input: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        self.last_input = x
        return self.norm(x)


class Trunk:
    """Forward passes over an mlx-lm model that return (hidden for the head, logits)."""

    def __init__(self, model: nn.Module, hidden_feed: str = "post_norm") -> None:
        self.model = model
        self.text = getattr(model, "language_model", model)
        self.inner = next(getattr(self.text, n) for n in INNER if hasattr(self.text, n))
        self.args = self.text.args
        self.hidden_feed = hidden_feed
        self._tap: _NormTap | None = None
        if hidden_feed == "pre_norm":
            self._tap = _NormTap(self.inner.norm)
            self.inner.norm = self._tap
        self.recorders = install(list(self.inner.layers))
        self.passes: TracedPasses | None = None
        self.kv: KVQuant | None = None  # --kv-bits: the caches' quantization (Runner.quantize_kv)

    @property
    def tied(self) -> bool:
        return not hasattr(self.text, "lm_head")

    def make_cache(self, bounded: bool = False) -> list[Any]:
        """mlx-lm's caches for this model; `bounded`: attention views of bounded shapes
        (decoder/shapes.py); quantized from the first position under --kv-bits with
        --quantized-kv-start 0."""
        cache = make_prompt_cache(self.model)
        cache = bounded_caches(cache) if bounded else cache
        quantize(cache, self.kv)
        return cache

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def logits(self, post_norm: mx.array) -> mx.array:
        if self.tied:
            return self.inner.embed_tokens.as_linear(post_norm)
        return self.text.lm_head(post_norm)

    def output_rows(self, ids: mx.array) -> mx.array:
        """The unembedding rows of `ids` (float weights; for a truncated draft vocabulary)."""
        weight = self.inner.embed_tokens.weight if self.tied else self.text.lm_head.weight
        if "scales" in (self.inner.embed_tokens if self.tied else self.text.lm_head):
            raise ValueError("a draft vocabulary needs float unembedding weights (dequantize)")
        return weight[ids]

    def __call__(self, tokens: mx.array, cache: list[Any], logits_for: int | None = None,
                 real: int | None = None, record: bool = False
                 ) -> tuple[mx.array, mx.array | None]:
        """tokens (1, S) -> (hidden fed to the MTP head (1, S, H), logits (1, S', V)) where
        logits cover the last `logits_for` positions (all when None, none when 0). With `real`,
        only the first `real` positions count (the rest pad the pass to a bounded shape).
        record: recurrent layers keep their state after every position (decoder/recording.py),
        for a commit of the kept prefix."""
        traced = self.passes.run(tokens, cache, record) if (self.passes is not None
                                                              and logits_for is None) else None
        if traced is not None:
            hidden, logits = traced
            return (hidden, logits) if real is None else (hidden[:, :real], logits[:, :real])
        post = recorded(self.recorders, record, lambda: self.inner(tokens, cache=cache))
        hidden = self._tap.last_input if self._tap is not None else post
        if real is not None:
            post, hidden = post[:, :real], hidden[:, :real]
        if logits_for == 0:
            return hidden, None
        return hidden, self.logits(post if logits_for is None else post[:, -logits_for:])

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """(hidden fed to the head, logits) of every position: the traced pass's body."""
        post = self.inner(tokens, cache=cache)
        return (self._tap.last_input if self._tap is not None else post), self.logits(post)

    def use_traced(self, on: bool = True) -> None:
        """Verify passes (every row's logits) traced once per shape (decoder/traced.py)."""
        self.passes = TracedPasses(self) if on else None

    def layer_factory(self, kind: str, layer_args: dict[str, Any] | None = None
                      ) -> LayerFactory:
        """A constructor for one more decoder layer of the trunk's own class and kind: the MTP
        layer is "full_attention" (like the trunk's softmax-attention layers) or "after_trunk"
        (built as layer num_hidden_layers, e.g. DeepSeek's MoE nextn layer). layer_args: the
        constructor's keyword arguments beyond the config (the family table's)."""
        layers, layer_args = list(self.inner.layers), layer_args or {}
        twin = _twin(layers, kind, layer_args)
        index = len(layers) if kind == "after_trunk" else twin
        return LayerFactory(type(layers[twin]), self.args, index, self.model, self.inner, kind,
                            layer_args)


def _twin(layers: list[Any], kind: str, layer_args: dict[str, Any]) -> int:
    """The trunk layer the MTP layer is like: the last one ("after_trunk"), else the first
    attention layer that keeps the constructor arguments' values (None in `layers`: another
    pipeline stage's)."""
    if kind == "after_trunk":
        return len(layers) - 1
    twins = (i for i, layer in enumerate(layers)
             if layer is not None and not getattr(layer, "is_linear", False)
             and all(getattr(layer, k, v) == v for k, v in layer_args.items()))
    twin = next(twins, None)
    if twin is None:
        raise ValueError(f"no trunk layer of this stage is like the MTP layer ({kind})")
    return twin


@dataclass(frozen=True)
class LayerFactory:
    """Builds one more decoder layer of the trunk's class (called), and the cache mlx-lm's
    model makes for its twin, the trunk layer of the same kind (`cache`): a DSA layer reads a
    CacheList of its KV and indexer caches, a sliding-window one a RotatingKVCache. So the
    head's caches are of the kinds the trunk's are, and whatever handles those handles them."""

    cls: type[nn.Module]
    args: Any
    index: int
    model: nn.Module
    inner: nn.Module
    kind: str
    layer_args: dict[str, Any]

    def __call__(self) -> nn.Module:
        if "layer_idx" in inspect.signature(self.cls.__init__).parameters:
            return self.cls(self.args, layer_idx=self.index, **self.layer_args)
        return self.cls(self.args, **self.layer_args)

    def cache(self) -> Any:
        """A fresh cache of the twin's kind, read where it is now: a pipeline stage's caches
        are its own layers', the last of the inner model's list (the earlier ones None)."""
        caches = make_prompt_cache(self.model)
        layers = list(self.inner.layers)[len(self.inner.layers) - len(caches):]
        return caches[_twin(layers, self.kind, self.layer_args)]
