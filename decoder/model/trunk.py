"""The trunk: mlx-lm's own model, with the hidden states the MTP head needs.

mlx-lm's inner text model returns the final-normed hidden state and the outer model turns it into
logits; calling the two halves separately gives the post-norm hidden without re-implementing any
layer. The pre-norm hidden (for heads trained on it) is read by wrapping the final norm module.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mtpkit.decoder.cache.caches import quantize
from mtpkit.decoder.cache.recording import install, recorded
from mtpkit.decoder.cache.shapes import bounded_caches
from mtpkit.decoder.model.traced import TracedPasses
from mtpkit.decoder.options import KVQuant
from mtpkit.loaders.families import LAYER_KIND_ATTRIBUTES, family_for

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


class LayerTap(nn.Module):
    """A trunk layer that hands its output to the sinks listening (a DFlash drafter reads the
    outputs of several target layers: decoder/drafters/dflash.py), with the cache the layer was given,
    so a sink keeps only its own sequence's passes. Everything else is the layer's own."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        super().__init__()
        self.tapped = layer
        self.index = index
        self.sinks: weakref.WeakSet[Any] = weakref.WeakSet()  # (not a parameter)

    def __getattr__(self, name: str) -> Any:
        if name in self or "tapped" not in self:
            return super().__getattr__(name)
        return getattr(self["tapped"], name)  # what mlx-lm reads of its layers (is_linear)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        out = self.tapped(x, *args, **kwargs)
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        for sink in list(self.sinks):
            sink.captured(self.index, cache, out)
        return out


def parts(model: nn.Module) -> tuple[nn.Module, str, str]:
    """Where an mlx-lm model keeps what the decoder reads: its text model (a VL model's
    language_model), the attribute of its inner model (one of INNER) and, inside that, the
    token embedding's (the family table's embed_module)."""
    text = getattr(model, "language_model", model)
    inner = next(n for n in INNER if hasattr(text, n))
    return text, inner, family_for(getattr(text.args, "model_type", None)).embed_module


class Trunk:
    """Forward passes over an mlx-lm model that return (hidden for the head, logits)."""

    def __init__(self, model: nn.Module, hidden_feed: str = "post_norm") -> None:
        self.model = model
        self.text, inner, self._embed_module = parts(model)
        self.inner = getattr(self.text, inner)
        self.args = self.text.args
        self.hidden_feed = hidden_feed
        self._tap: _NormTap | None = None
        if hidden_feed == "pre_norm":
            self._tap = _NormTap(self.inner.norm)
            self.inner.norm = self._tap
        self.recorders = install(list(self.inner.layers))
        self.passes: TracedPasses | None = None
        self.kv: KVQuant | None = None  # --kv-bits: the caches' quantization (Runner.quantize_kv)
        self.ran: set[Hashable] = set()  # pass shapes run here (`first_pass`)

    @property
    def embedding(self) -> nn.Module:
        """The token embedding, where the family table says mlx-lm's inner model keeps it
        (read each time: a module swapped after load is the one used)."""
        return getattr(self.inner, self._embed_module)

    @property
    def tied(self) -> bool:
        """No LM head of its own (mlx-lm's Kimi-K3 keeps `lm_head = None` when tied)."""
        return getattr(self.text, "lm_head", None) is None

    def tap_layers(self, ids: list[int]) -> list[LayerTap]:
        """Wrap the trunk layers `ids` (once) so their outputs reach listening sinks
        (LayerTap); the model runs as before."""
        layers = self.inner.layers
        for i in ids:
            if not isinstance(layers[i], LayerTap):
                layers[i] = LayerTap(layers[i], i)
        return [layers[i] for i in ids]

    def make_cache(self, bounded: bool = False) -> list[Any]:
        """mlx-lm's caches for this model; `bounded`: attention views of bounded shapes
        (decoder/cache/shapes.py); quantized from the first position under --kv-bits with
        --quantized-kv-start 0."""
        cache = make_prompt_cache(self.model)
        cache = bounded_caches(cache) if bounded else cache
        quantize(cache, self.kv)
        return cache

    def first_pass(self, shape: Hashable) -> bool:
        """Whether a pass of `shape` (its kind, rows, width and cache buffers) runs for the
        first time here: it may have compiled (a trace, kernels, a cuDNN graph, all built on
        the host as it is queued), so what it took is no price of the shape."""
        new = shape not in self.ran
        self.ran.add(shape)
        return new

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embedding(tokens)

    def logits(self, post_norm: mx.array) -> mx.array:
        if self.tied:
            return self.embedding.as_linear(post_norm)
        return self.text.lm_head(post_norm)

    def output_rows(self, ids: mx.array) -> mx.array:
        """The unembedding rows of `ids` (float weights; for a truncated draft vocabulary)."""
        weight = self.embedding.weight if self.tied else self.text.lm_head.weight
        if "scales" in (self.embedding if self.tied else self.text.lm_head):
            raise ValueError("a draft vocabulary needs float unembedding weights (dequantize)")
        return weight[ids]

    def __call__(self, tokens: mx.array, cache: list[Any], logits_for: int | None = None,
                 real: int | None = None, record: bool = False
                 ) -> tuple[mx.array, mx.array | None]:
        """tokens (1, S) -> (hidden fed to the MTP head (1, S, H), logits (1, S', V)) where
        logits cover the last `logits_for` positions (all when None, none when 0). With `real`,
        only the first `real` positions count (the rest pad the pass to a bounded shape).
        record: recurrent layers keep their state after every position (decoder/cache/recording.py),
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
        """Verify passes (every row's logits) traced once per shape (decoder/model/traced.py)."""
        self.passes = TracedPasses(self) if on else None

    def layer_factory(self, kind: str, layer_args: dict[str, Any] | None = None
                      ) -> LayerFactory:
        """A constructor for more decoder layers of the trunk's own class and kind: the MTP
        layer is "full_attention" (like the trunk's first softmax-attention layer that keeps
        the constructor arguments' values) or "after_trunk" (depth k built as trunk layer
        num_hidden_layers + k, as vLLM numbers DeepSeek's nextn layers). layer_args: the
        constructor's keyword arguments beyond the config (the family table's)."""
        layers, layer_args = list(self.inner.layers), layer_args or {}
        if kind == "after_trunk":
            index, like = len(layers), layers[-1]
        else:
            twins = [i for i, layer in enumerate(layers)
                     if layer is not None and not getattr(layer, "is_linear", False)
                     and all(getattr(layer, k, v) == v for k, v in layer_args.items())]
            if not twins:
                raise ValueError(f"no trunk layer of this stage is like the MTP layer ({kind})")
            index = twins[0]
            like = layers[index]
        return LayerFactory(type(like), self.args, index, self.model, self.inner, kind,
                            layer_args)


def _kind(layer: nn.Module) -> dict[str, Any]:
    """What mlx-lm's classes say of a layer's kind (families.LAYER_KIND_ATTRIBUTES), which
    decides the cache its model makes for it."""
    return {a: getattr(layer, a) for a in LAYER_KIND_ATTRIBUTES if hasattr(layer, a)}


@dataclass(frozen=True)
class LayerFactory:
    """Builds decoder layers of the trunk's class (called with the MTP depth), and the cache
    mlx-lm's model makes for a built layer's twin, the trunk layer of the same kind (`cache`):
    a DSA layer reads a CacheList of its KV and indexer caches, a sliding-window one a
    RotatingKVCache. So the head's caches are of the kinds the trunk's are, and whatever
    handles those handles them."""

    cls: type[nn.Module]
    args: Any
    index: int
    model: nn.Module
    inner: nn.Module
    kind: str
    layer_args: dict[str, Any]

    def __call__(self, depth: int = 0) -> nn.Module:
        index = self.index + (depth if self.kind == "after_trunk" else 0)
        try:
            if "layer_idx" in inspect.signature(self.cls.__init__).parameters:
                return self.cls(self.args, layer_idx=index, **self.layer_args)
            return self.cls(self.args, **self.layer_args)
        except (IndexError, KeyError) as exc:  # a per-layer config list that stops at the trunk
            raise ValueError(f"mlx-lm's {self.cls.__name__} cannot be built as layer {index} "
                             f"from this config ({type(exc).__name__}: {exc})") from exc

    def cache(self, layer: nn.Module) -> Any:
        """A fresh cache of the kind mlx-lm's model makes for the trunk layers like `layer`
        (the last such for "after_trunk", the first otherwise), read where they are now: a
        pipeline stage's caches are its own layers', the last of the inner model's list (the
        earlier ones None)."""
        caches = make_prompt_cache(self.model)
        layers = list(self.inner.layers)[len(self.inner.layers) - len(caches):]
        kind = _kind(layer)
        twins = [i for i, other in enumerate(layers)
                 if other is not None and _kind(other) == kind]
        if not twins:
            raise ValueError(f"no trunk layer of this stage is of the MTP layer's kind {kind}")
        return caches[twins[-1] if self.kind == "after_trunk" else twins[0]]
