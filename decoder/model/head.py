"""The MTP head, built from the sidecar with its own quantization.

One module for every family: the canonical roles (fc over the concat of the normed embedding and
the normed trunk hidden, decoder layer(s) of the trunk's own class, final norm, and optionally
DeepSeek's own embedding and shared head). Family differences are the contract knobs (concat
order, which hidden is chained, zeroed first embedding) and how a block is built (a trunk-class
layer with constructor arguments, a block composed of the trunk module's classes, or a step of
several trunk-class layers), read from the family table.
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask, create_causal_mask
from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache

from mtpkit.decoder.cache.shapes import bounded_caches
from mtpkit.decoder.model.trunk import Trunk
from mtpkit.loaders.families import Family, Sublayer, family_for
from mtpkit.loaders.quant import ModuleQuant

HIDDEN_FEEDS = ("post_norm", "pre_norm")
# Optional int32 sidecar tensor `mtp.draft_vocab`: the token ids the head drafts over (a grafted
# head's most frequent tokens), so a draft step pays for those unembedding rows only.
DRAFT_VOCAB = "draft_vocab"
NEXT_HIDDENS = ("post_mtp_norm", "pre_mtp_norm")
CONCAT_ORDERS = ("embedding_first", "hidden_first")


@dataclass(frozen=True)
class Contract:
    """How the head is wired to the trunk (recorded in mtpkit.json; overridable at load)."""

    hidden_feed: str = "post_norm"
    next_hidden: str = "post_mtp_norm"
    concat_order: str = "embedding_first"
    zero_first_embedding: bool = False

    def __post_init__(self) -> None:
        for value, allowed in ((self.hidden_feed, HIDDEN_FEEDS), (self.next_hidden, NEXT_HIDDENS),
                               (self.concat_order, CONCAT_ORDERS)):
            if value not in allowed:
                raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")

    def override(self, **values: Any) -> Contract:
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Roles(nn.Module):
    """The head-level modules around one decoder layer (norms of the class the family's
    table names, else RMSNorm)."""

    def __init__(self, hidden: int, eps: float, names: set[str], vocab: int,
                 norm: Callable[..., nn.Module] = nn.RMSNorm) -> None:
        super().__init__()
        self.pre_fc_norm_embedding = norm(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        if "norm" in names or not names:  # ERNIE's head has none: its block feeds the LM head
            self.norm = norm(hidden, eps=eps)
        if "shared_head" in names:
            self.shared_head = nn.Linear(hidden, vocab, bias=False)
        if "embed_tokens" in names:
            self.embed_tokens = nn.Embedding(vocab, hidden)


def _module_name(canonical: str) -> str:
    """Canonical sidecar name -> this module's parameter path."""
    name = canonical[len("mtp."):]
    if name.startswith("layers.") or name == DRAFT_VOCAB:
        return name
    m = re.match(r"^heads\.(\d+)\.(.+)$", name)
    return f"roles.{m[1]}.{m[2]}" if m else f"roles.0.{name}"


def canonical_name(param: str) -> str:
    """This module's parameter path -> the canonical sidecar name (inverse of _module_name)."""
    m = re.match(r"^roles\.(\d+)\.(.+)$", param)
    if m is None:
        return "mtp." + param
    return f"mtp.{m[2]}" if m[1] == "0" else f"mtp.heads.{m[1]}.{m[2]}"


def _role_names(names: list[str], block: int) -> set[str]:
    scope = "roles.0." if block == 0 else f"roles.{block}."
    return {n[len(scope):].split(".")[0] for n in names if n.startswith(scope)}


def _dequantize_float_only(head: nn.Module, weights: dict[str, mx.array],
                           specs: dict[str, Any]) -> dict[str, mx.array]:
    """Modules stored quantized whose mlx-lm class has no quantized form (DeepSeek-V3's MoE
    router, `MoEGate`, which mlx-lm's own quantization leaves in floats) are dequantized here,
    and dropped from `specs`, so the head builds instead of failing in nn.quantize."""
    leaves = dict(tree_flatten(head.leaf_modules(), is_leaf=nn.Module.is_module))
    canonical = {_module_name(n): n for n in weights}
    out = dict(weights)
    for path in [p for p in specs if p in leaves and not hasattr(leaves[p], "to_quantized")]:
        spec = specs.pop(path)
        w, s = out.pop(canonical[f"{path}.weight"]), out.pop(canonical[f"{path}.scales"])
        b = out.pop(canonical[f"{path}.biases"]) if f"{path}.biases" in canonical else None
        out[canonical[f"{path}.weight"]] = mx.dequantize(
            w, s, b, group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
    return out


class _Block(nn.Module):
    """An MTP block that no single trunk layer class computes, from the family table's
    sublayers (loaders/families.py's Sublayer): each x + module(norm(x)), in order, the module
    a class of the trunk's own mlx-lm module built from the config."""

    def __init__(self, module: Any, args: Any, parts: tuple[Sublayer, ...], eps: float) -> None:
        super().__init__()
        if sum(part.attends for part in parts) > 1:
            raise ValueError("a composite MTP block holds one cache: one attending sublayer")
        object.__setattr__(self, "_parts", parts)
        for part in parts:
            built = getattr(module, part.cls)(args, **part.args)
            attr, _, slot = part.name.partition(".")
            setattr(self, attr, [built] if slot else built)
            setattr(self, part.norm, nn.RMSNorm(args.hidden_size, eps=eps))

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        for part in self._parts:
            attr, _, slot = part.name.partition(".")
            module = getattr(self, attr)[int(slot)] if slot else getattr(self, attr)
            y = getattr(self, part.norm)(x)
            x = x + (module(y, mask, cache) if part.attends else module(y))
        return x


@dataclass(frozen=True)
class BlockFactory:
    """Builds a family's composite MTP block (called with the MTP depth, as a LayerFactory)
    and its cache (`cache`): one KVCache, for its one attending sublayer (or, for a pattern of
    layers, its one attending layer: mlx-lm makes a KVCache for attention layers)."""

    trunk: Trunk
    family: Family

    def __call__(self, depth: int = 0) -> _Block:
        module = _trunk_module(self.trunk)
        args = self.trunk.args
        return _Block(module, args, self.family.mtp_block, getattr(args, self.family.eps_key))

    def cache(self, layer: nn.Module) -> KVCache:
        return KVCache()


def _configured(factory: Any, values: dict[str, Any]) -> Any:
    """The layer factory building under the trunk's config with the table's values set (on a
    copy of mlx-lm's args, so the trunk's own layers keep theirs)."""
    if not values:
        return factory
    args = copy.copy(factory.args)
    for key, value in values.items():
        setattr(args, key, value)
    return replace(factory, args=args)


def _trunk_module(trunk: Trunk) -> Any:
    """The mlx-lm module the trunk's classes come from."""
    return sys.modules[type(trunk.text).__module__]


def _family(trunk: Trunk) -> Family:
    """The trunk's family by the outer model's type, else the text model's (MiniMax-M3's text
    config may name none)."""
    family = family_for(getattr(trunk.model, "model_type", None))
    return family if family.model_types else family_for(getattr(trunk.args, "model_type", None))


def _hidden(out: Any) -> mx.array:
    """A layer's hidden output: mlx-lm's Kimi-K3 layer returns (hidden, residual blocks)."""
    return out[0] if isinstance(out, tuple) else out


def _layers(trunk: Trunk, family: Family, layer_kind: str, names: list[str]
            ) -> tuple[Any, list[nn.Module], list[list[int]], list[bool]]:
    """(what builds and caches them, the head's physical layers, each draft block's layers,
    which of them attend): one layer per block, or for a family with an mtp_pattern one block
    of every layer, each built with the constructor value its weights say."""
    physical = 1 + max((int(m[1]) for n in names if (m := re.match(r"^layers\.(\d+)\.", n))),
                       default=0)
    if family.mtp_pattern is None:
        build = (BlockFactory(trunk, family) if family.mtp_block
                 else _configured(trunk.layer_factory(layer_kind, family.mtp_layer_args),
                                  family.mtp_config))
        return (build, [build(k) for k in range(physical)], [[k] for k in range(physical)],
                [True] * physical)
    arg, by_module, attending = family.mtp_pattern
    values = [next((v for module, v in by_module.items()
                    if any(n.startswith(f"layers.{j}.{module}.") for n in names)), None)
              for j in range(physical)]
    if None in values:
        raise ValueError(f"MTP layer {values.index(None)} holds none of {sorted(by_module)}")
    layers = [trunk.layer_factory("full_attention", {arg: v})() for v in values]
    return (BlockFactory(trunk, family), layers, [list(range(physical))],
            [v == attending for v in values])


class WindowKVCache(KVCache):
    """A sliding-window block's cache in the head: every position kept, the window applied by
    the mask (mlx-lm's causal mask with its window_size, which the layer takes as any mask).
    mlx-lm's RotatingKVCache overwrites its oldest keys once it wraps, so the chained draft
    entries a round leaves could not be trimmed away; this cache trims, exports and restores
    as a KVCache does, and attends to the same keys. It costs what a full-attention layer's
    cache does: one layer's keys for the whole context."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array:
        return create_causal_mask(n, self.offset, window_size=window_size or self.window)


def _windowed(cache: Any) -> Any:
    """A sliding window's RotatingKVCache (no kept prefix) as a WindowKVCache of its size."""
    if isinstance(cache, RotatingKVCache) and not cache.keep:
        return WindowKVCache(cache.max_size)
    return cache


def _positions(cache: Any) -> Any:
    """The cache that says a block's positions (offset, mask): a DSA layer's CacheList holds
    its KV cache first and its indexer's second, and mlx-lm's model reads the first."""
    return cache[0] if isinstance(cache, CacheList) else cache


class MTPHead(nn.Module):
    """Predicts token t+2 from the trunk hidden at t and token t+1; chains on its own output."""

    def __init__(self, trunk: Trunk, weights: dict[str, mx.array], contract: Contract,
                 layer_kind: str, quant: dict[str, ModuleQuant]) -> None:
        super().__init__()
        args = trunk.args
        self.contract = contract
        self._trunk = trunk
        family = _family(trunk)
        unused = re.compile(rf"^mtp\.layers\.\d+\.(?:{'|'.join(family.unused_layer_parts)})[._]")
        weights = {n: w for n, w in weights.items()
                   if not (family.unused_layer_parts and unused.match(n))}
        self._draft_rows: mx.array | None = None
        if (vocab := weights.get(f"mtp.{DRAFT_VOCAB}")) is not None:
            weights[f"mtp.{DRAFT_VOCAB}"] = self.draft_vocab = vocab.astype(mx.int32)
        names = [_module_name(n) for n in weights]
        role_sets = 1 + max((int(m[1]) for n in names if (m := re.match(r"^roles\.(\d+)\.", n))),
                            default=0)
        self._build, self.layers, steps, attends = _layers(trunk, family, layer_kind, names)
        object.__setattr__(self, "_steps", steps)  # the physical layers of each draft block
        object.__setattr__(self, "_attends", attends)  # which of them take the mask and cache
        norm = (getattr(_trunk_module(trunk), family.norm_class) if family.norm_class
                else nn.RMSNorm)
        self.roles = [_Roles(args.hidden_size, getattr(args, family.eps_key),
                             _role_names(names, k), args.vocab_size, norm)
                      for k in range(role_sets)]
        specs = {_module_name(p): q.quant for p, q in quant.items() if q.quant is not None}
        weights = _dequantize_float_only(self, weights, specs)
        if specs:
            nn.quantize(self, class_predicate=lambda path, _m: (
                {"group_size": specs[path].group_size, "bits": specs[path].bits,
                 "mode": specs[path].mode} if path in specs else False))
        self.load_weights([(_module_name(n), w) for n, w in weights.items()], strict=True)
        if DRAFT_VOCAB in self:
            self.freeze(keys=[DRAFT_VOCAB], recurse=False)

    def draft_logits(self, roles: _Roles, post: mx.array) -> mx.array:
        """Logits over the draft vocabulary only (the full vocabulary when there is none)."""
        if "shared_head" in roles:
            return roles.shared_head(post)
        if DRAFT_VOCAB not in self:
            return self._trunk.logits(post)
        if self._draft_rows is None:
            self._draft_rows = self._trunk.output_rows(self.draft_vocab)
        return post @ self._draft_rows.T

    def _full(self, logits: mx.array) -> mx.array:
        """Scatter draft-vocabulary logits into the full vocabulary (-inf elsewhere)."""
        if DRAFT_VOCAB not in self or logits.shape[-1] != self.draft_vocab.shape[0]:
            return logits
        full = mx.full((*logits.shape[:-1], self._trunk.args.vocab_size), -mx.inf, logits.dtype)
        index = mx.broadcast_to(self.draft_vocab, logits.shape)
        return mx.put_along_axis(full, index, logits, axis=-1)

    @property
    def blocks(self) -> int:
        return len(self._steps)

    def make_cache(self, bounded: bool = False) -> list[Any]:
        """One cache per block, of the kind mlx-lm's model makes for the block's trunk twin
        (decoder/model/trunk.py's LayerFactory), a sliding window's as a WindowKVCache; `bounded`: a
        plain KVCache padded, as the trunk's."""
        caches = [_windowed(self._build.cache(self.layers[step[0]])) for step in self._steps]
        return bounded_caches(caches) if bounded else caches

    def _roles(self, block: int) -> _Roles:
        return self.roles[block] if len(self.roles) > 1 else self.roles[0]

    def layer_input(self, hidden: mx.array, tokens: mx.array, block: int = 0,
                    at_start: bool | mx.array = True) -> mx.array:
        """What block's decoder layer reads: fc over the normed embedding of the next tokens
        and the normed trunk hidden (at_start: the first position is the sequence's first;
        per row (B,) for a batch, decoder/rounds/batch.py)."""
        roles = self._roles(block)
        embed = roles.embed_tokens(tokens) if "embed_tokens" in roles else self._trunk.embed(tokens)
        if self.contract.zero_first_embedding and (not isinstance(at_start, bool) or at_start):
            first = mx.arange(tokens.shape[1])[None, :, None] == 0
            if not isinstance(at_start, bool):
                first = first & at_start[:, None, None]
            embed = mx.where(first, mx.zeros_like(embed), embed)
        parts = [roles.pre_fc_norm_embedding(embed), roles.pre_fc_norm_hidden(hidden)]
        if self.contract.concat_order == "hidden_first":
            parts.reverse()
        return roles.fc(mx.concatenate(parts, axis=-1))

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: list[Any] | None,
                 step: int, full_vocab: bool = True, last_only: bool = False,
                 pick: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """hidden (1, S, H) paired with the next tokens (1, S) -> (logits, hidden to chain).

        Chained draft step k uses block k mod blocks, each block with its own KV cache. With a
        draft vocabulary, logits cover it only unless full_vocab (then -inf elsewhere). A draft
        needs the last position only: last_only skips the unembedding of the others (a whole
        prompt's worth on the first round); `pick` (B,) keeps position pick[b] of row b instead
        (a batch's rows end at their own lengths, decoder/rounds/batch.py).
        """
        block = step % self.blocks
        roles = self._roles(block)
        layer_cache = cache[block] if cache is not None else None  # None: training, causal
        kv = _positions(layer_cache)
        offset = 0 if kv is None else kv.offset
        x = self.layer_input(hidden, tokens, block, offset == 0)  # per row in a batch
        mask = create_attention_mask(x, kv, return_array=True)
        for j in self._steps[block]:
            x = _hidden(self.layers[j](x, mask, layer_cache) if self._attends[j]
                        else self.layers[j](x))
        if pick is not None:
            x = mx.take_along_axis(x, pick[:, None, None], axis=1)
        elif last_only:
            x = x[:, -1:]
        post = roles.norm(x) if "norm" in roles else x
        logits = self.draft_logits(roles, post)
        if full_vocab:
            logits = self._full(logits)
        return logits, post if self.contract.next_hidden == "post_mtp_norm" else x
