"""A DFlash drafter run beside its target (docs/dflash.md): a whole block drafted in one pass.

The drafter's layers are mlx-lm's own Qwen3 `TransformerBlock`s. Their attention sees two
things: the context, keys and values projected (by the layer's own k_proj / v_proj, k_norm and
RoPE) from the target's hidden states at every committed position, and the block itself: the
target's embedding of the last committed token, then one mask token per draft. The context
comes from the target's layers `target_layer_ids` (their outputs, concatenated, through `fc`
and `hidden_norm`), captured by wrapping those trunk layers (decoder/model/trunk.py's LayerTap). Each
sequence's context keys and values live in its proposer's own KVCaches: positions are fed once,
when committed, so a rejected draft never reaches them and nothing is ever rolled back. The
layer is handed a cache view whose `update_and_fetch` returns the context's keys before the
block's and keeps nothing of the block, so mlx-lm's attention runs unchanged; the block sits after
the context, as z-lab's drafter places them. Block position i's output, through the target's LM
head, is draft i's logits.

Exact at any temperature: each draft i is drawn from the processed law q_i of its logits at the
request's sampling (decoder/sampling.py `candidates(..., drafter=True)`), from the round's
noise, and the Draft carries those q_i. The drafts of one block are drawn independently, so q_i
is also draft i's law given the drafts before it, which is what the acceptance rule needs.
"""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import ModelArgs, TransformerBlock

from mtpkit.decoder.cache.batch_cache import RowKVCache
from mtpkit.decoder.cache.caches import FrozenKV, freeze, leaves
from mtpkit.decoder.drafters.draft_model import PREFILL_STEP, STEP_REPS, STEP_TEXT
from mtpkit.decoder.drafters.drafts import Draft
from mtpkit.decoder.drafters.proposers import SessionBound
from mtpkit.decoder.model.trunk import LayerTap, Trunk
from mtpkit.decoder.options import SamplingParams, Source
from mtpkit.decoder.sampling import Candidates, candidates, greedy
from mtpkit.loaders.dflash import DFlashSpec, read_dflash
from mtpkit.loaders.drafters import bundle_drafter, float_weights


class _BlockView:
    """The cache a drafter layer is handed for the block: the context's keys and values
    first, then the block's own. The block's are written past the context in the store's
    buffer and trimmed off again (the next block or context overwrites them), so a round
    writes its block, not a copy of the whole context."""

    def __init__(self, store: KVCache) -> None:
        self.store = store

    @property
    def offset(self) -> int:
        return self.store.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.store.offset == 0:
            return keys, values
        out = self.store.update_and_fetch(keys, values)
        self.store.trim(keys.shape[2])
        return out


class DFlashDrafter(nn.Module):
    """The drafter's parameters under their published names (layers.N.*, fc, hidden_norm,
    norm); no embedding and no LM head: those are the target's."""

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        args = ModelArgs.from_dict(spec.qwen3_args())
        self.layers = [TransformerBlock(args) for _ in range(spec.layers)]
        self.norm = nn.RMSNorm(spec.hidden, eps=args.rms_norm_eps)
        self.fc = nn.Linear(len(spec.target_layer_ids) * spec.hidden, spec.hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(spec.hidden, eps=args.rms_norm_eps)
        self.spec = spec

    def make_stores(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def context(self, features: mx.array, stores: list[KVCache]) -> None:
        """Append committed positions' context keys and values: features (1, n, k * hidden),
        the target layers' outputs concatenated, at positions from the stores' offset on."""
        ctx = self.hidden_norm(self.fc(features))
        b, n, _ = ctx.shape
        for layer, store in zip(self.layers, stores, strict=True):
            attn = layer.self_attn
            keys = attn.k_norm(attn.k_proj(ctx).reshape(b, n, attn.n_kv_heads, -1))
            values = attn.v_proj(ctx).reshape(b, n, attn.n_kv_heads, -1)
            store.update_and_fetch(attn.rope(keys.transpose(0, 2, 1, 3), offset=store.offset),
                                   values.transpose(0, 2, 1, 3))

    def block(self, x: mx.array, stores: list[KVCache]) -> mx.array:
        """The block's final-normed outputs (1, L, hidden) from its inputs x (1, L, hidden)."""
        for i, (layer, store) in enumerate(zip(self.layers, stores, strict=True)):
            x = layer(x, self.mask(i, store.offset, x.shape[1]), _BlockView(store))
        return self.norm(x)

    def mask(self, layer: int, context: int, length: int) -> mx.array | None:
        """Which keys the block's queries see in a layer: the whole context (a sliding layer:
        the last `sliding_window` positions before each query) and the block, causally where
        the config says so (z-lab: `is_causal`, else causal exactly on sliding layers)."""
        spec = self.spec
        sliding = spec.layer_types[layer] == "sliding_attention"
        causal = sliding if spec.causal is None else spec.causal
        if not sliding and not causal:
            return None
        query = context + mx.arange(length)[:, None]
        key = mx.arange(context + length)[None]
        seen = key < context
        if sliding:
            seen = seen & (query - key < (spec.sliding_window or 0))
        return seen | ((key >= context) & (key <= query) if causal else key >= context)


def load_dflash(folder: Path, spec: DFlashSpec, dtype: mx.Dtype | None = None) -> DFlashDrafter:
    """The drafter from its folder: float weights as published, cast to the target's float
    dtype. A quantized drafter is refused with a hint (the decoder reads float weights)."""
    weights = float_weights(folder, "DFlash drafter")
    model = DFlashDrafter(spec)
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@dataclass
class DFlashPair:
    """A drafter beside its target's trunk, whose layers `target_layer_ids` are tapped."""

    drafter: DFlashDrafter
    trunk: Trunk
    taps: list[LayerTap]
    _step: float | None = field(default=None, repr=False)

    @classmethod
    def pair(cls, drafter: DFlashDrafter, trunk: Trunk) -> Self:
        return cls(drafter, trunk, trunk.tap_layers(list(drafter.spec.target_layer_ids)))

    @property
    def spec(self) -> DFlashSpec:
        return self.drafter.spec

    def proposer(self, session: DFlashFeed) -> DFlashProposer:
        """A session's proposer (Session builds it from its runner's drafter)."""
        return DFlashProposer(self, session)

    def block_logits(self, stores: list[KVCache], features: mx.array | None, last: int,
                     depth: int) -> mx.array:
        """(depth, V) logits of drafts 1..depth after the last committed token `last`, once
        the committed positions' `features` (not yet in the stores) are fed. Lazy."""
        spec, dtype = self.spec, self.drafter.fc.weight.dtype
        if features is not None:
            self.feed(stores, features)
        ids = mx.array([[last] + [spec.mask_token_id] * depth])
        x = self.trunk.embed(ids).astype(dtype) * spec.embedding_scale
        logits = self.trunk.logits(self.drafter.block(x, stores)[:, 1:])[0]
        logits = logits * spec.output_multiplier if spec.output_multiplier != 1 else logits
        return mx.tanh(logits / spec.softcap) * spec.softcap if spec.softcap else logits

    def feed(self, stores: list[KVCache], features: mx.array) -> None:
        """Committed positions' features into the drafter's context caches. Lazy."""
        self.drafter.context(features.astype(self.drafter.fc.weight.dtype), stores)

    def step_cost(self) -> float:
        """Seconds of one draft, timed once: a block pass of min(block - 1, 8) drafts after a
        short context, divided by its drafts (the depth policy prices K drafts at K of these;
        what rounds pay then corrects it, as for a draft model)."""
        if self._step is None:
            depth = min(self.spec.block_size - 1, 8)
            stores = self.drafter.make_stores()
            width = len(self.spec.target_layer_ids) * self.spec.hidden
            mx.eval(self.block_logits(stores, mx.zeros((1, STEP_TEXT, width)), 0, depth))
            self._step = statistics.median(timeit.repeat(
                lambda: mx.eval(self.block_logits(stores, None, 0, depth)), number=1,
                repeat=STEP_REPS)) / depth
        return self._step


class DFlashFeed(Protocol):
    """What the proposer reads from a session: its trunk caches (to know its own passes), the
    last committed token, the sampling and the round's noise."""

    last: int
    params: SamplingParams
    cache: list[Any]

    def round_noise(self, head_steps: int, drafts: int = 0
                    ) -> tuple[mx.array | None, mx.array | None]: ...


def _start(caches: list[Any], cache: Any, rows: int, index: int) -> int | None:
    """Where a pass that just ran trunk layer `index` (its cache `cache`, `rows` positions)
    began: the layer's own cache has grown by `rows`; a layer without an offset (recurrent)
    reads it from an attention cache, grown already where it comes earlier."""
    if isinstance(getattr(cache, "offset", None), int):
        return cache.offset - rows
    for j, other in enumerate(caches):
        if isinstance(getattr(other, "offset", None), int):
            return other.offset - (rows if j < index else 0)
    return None


class DFlashProposer(SessionBound[DFlashFeed]):
    """decoder/drafters/proposers.py's Proposer for a DFlash drafter (Source.MODEL). It keeps the
    committed text, the target layers' outputs of committed positions not fed to the drafter
    yet (`parts`, from position `base`; a pass's rows past the committed end are overwritten by
    the next pass from there) and the drafter's context caches (`stores`). While its session is
    a batch's row, `batched` gives the batch's caches and the row's index: the row's outputs of
    a batch pass are kept at the row's position, read from the batch's offsets when the
    proposer next needs them (`pending`), so queued passes cost no host read."""

    source = Source.MODEL

    def __init__(self, pair: DFlashPair, session: DFlashFeed) -> None:
        super().__init__(session)
        self.pair = pair
        self.stores = pair.drafter.make_stores()
        self.text: list[int] = []
        self.parts: dict[int, list[mx.array]] = {}
        self.base = 0
        self.gap = False  # a position no pass of ours computed (a restored prefix)
        self.rebuilding: list[Any] | None = None  # a rebuild's caches, ours while it runs
        self.batched: Callable[[], tuple[list[Any] | None, int]] | None = None
        self.pending: list[tuple[int, mx.array, mx.array]] = []  # (layer, start, outputs)
        for tap in pair.taps:
            tap.sinks.add(self)

    def captured(self, index: int, cache: Any, out: mx.array) -> None:
        """A tapped trunk layer's output: kept where the pass is this session's (its own, a
        rebuild's, or its row of its batch's)."""
        if self.rebuilding is None and self.batched is not None:
            caches, row = self.batched()
            if caches is None or not any(c is cache for c in caches):
                return
            offsets = next((c.offset for c in leaves(caches) if isinstance(c, RowKVCache)), None)
            if offsets is None:
                self.gap = True
                return
            self.pending.append((index, offsets[row], out[row:row + 1]))
            return
        caches = self.rebuilding if self.rebuilding is not None else self.session.cache
        if out.shape[0] != 1 or not any(c is cache for c in caches):
            return
        self._placed()
        start = _start(caches, cache, out.shape[1], index)
        if start is None:
            self.gap = True
            return
        self._keep(index, start, out)

    def _placed(self) -> None:
        """The batch passes' outputs kept at their rows' positions (one read of them all)."""
        if not self.pending:
            return
        starts = mx.stack([start for _, start, _ in self.pending]).tolist()
        pending, self.pending = self.pending, []
        for (index, _, out), start in zip(pending, starts, strict=True):
            self._keep(index, int(start), out)

    def _keep(self, index: int, start: int, out: mx.array) -> None:
        """Layer `index`'s outputs of positions start.. (1, n, hidden), over what a pass
        before left from there."""
        if start < self.base:  # a replay of positions already fed: the same rows
            out, start = out[:, self.base - start:], self.base
        if not out.shape[1]:
            return
        pieces, at = self.parts.get(index, []), start - self.base
        if at > sum(p.shape[1] for p in pieces):
            self.gap = True
        kept, n = [], 0
        for piece in pieces:
            if n >= at:
                break
            kept.append(piece[:, :at - n])
            n += kept[-1].shape[1]
        self.parts[index] = [*kept, out]

    def features(self, end: int) -> mx.array | None:
        """The target layers' outputs at positions base..end, concatenated per position in
        target_layer_ids order (None: nothing new); they leave `parts`."""
        if end <= self.base:
            return None
        out = []
        for i in self.pair.spec.target_layer_ids:
            whole = mx.concatenate(self.parts[i], axis=1)
            out.append(whole[:, :end - self.base])
            self.parts[i] = [whole[:, end - self.base:]]
        self.base = end
        return mx.concatenate(out, axis=-1)

    def _complete(self, end: int) -> bool:
        self._placed()
        ids = self.pair.spec.target_layer_ids
        return not self.gap and all(
            self.base + sum(p.shape[1] for p in self.parts.get(i, [])) >= end for i in ids)

    def rebuild(self, end: int) -> None:
        """The context from scratch: the committed text's first `end` tokens through the trunk
        on fresh caches (what a restored prefix left uncaptured)."""
        self.stores, self.parts, self.base, self.gap = self.pair.drafter.make_stores(), {}, 0, False
        self.pending = []
        trunk = self.pair.trunk
        self.rebuilding = trunk.make_cache()
        try:
            for at in range(0, end, PREFILL_STEP):
                trunk(mx.array([self.text[at:min(at + PREFILL_STEP, end)]]), self.rebuilding,
                      logits_for=0)
                mx.eval([c.state for c in self.rebuilding],
                        [p for ps in self.parts.values() for p in ps])
        finally:
            self.rebuilding = None

    def export(self, positions: int) -> list[FrozenKV]:
        """The drafter's context over the trunk's first `positions` positions, for the prefix
        cache beside the trunk's export (views of its caches, trimmed as the trunk's are):
        every position captured so far is fed first (rebuilt where some are missing)."""
        if not self._complete(positions):
            self.rebuild(positions)
        features = self.features(positions)
        if features is not None:
            self.pair.feed(self.stores, features)
        return [freeze(s) for s in self.stores]

    def restore(self, frozen: list[FrozenKV], cached: int) -> None:
        """The context an `export` left, cut back to the `cached` positions the trunk's
        restored caches hold (a mismatch leaves a gap: the first proposal rebuilds)."""
        self.stores = [f.thaw(s) for f, s in zip(frozen, self.pair.drafter.make_stores(),
                                                   strict=True)]
        self.parts, self.pending, self.base = {}, [], cached
        self.gap = any(s.offset != cached for s in self.stores)

    def propose(self, depth: int) -> Draft | None:
        """min(depth, block_size - 1) drafts after the last committed token, from one drafter
        pass; each drawn from its position's processed law (greedy: its argmax). None before
        the session has caches of its own or a batch's."""
        session = self.session
        if depth <= 0 or not (session.cache or self.batched is not None):
            return None
        depth = min(depth, self.pair.spec.block_size - 1)
        end = len(self.text) - 1  # committed positions in the trunk's caches
        if not self._complete(end):
            self.rebuild(end)
        logits = self.pair.block_logits(self.stores, self.features(end), session.last, depth)
        draws, rule = session.round_noise(depth)
        q: Candidates | None = None
        if draws is None:
            tokens = greedy(logits)
        else:
            q = candidates(logits, session.params, drafter=True)
            tokens = q.draw(draws[:depth])
        chain = mx.concatenate([mx.array([session.last]), tokens.astype(mx.int32)])
        return Draft(chain[None], q, Source.MODEL, depth, rule=rule)

    def settle(self, tokens: list[int]) -> None:
        """Committed tokens: the text grows (the trunk's passes brought their positions'
        features already; a rejected draft's rows are overwritten by the next pass). While
        no draft is asked (plain stretches), every PREFILL_STEP committed positions go into
        the drafter's context, so the outputs kept for it stay bounded."""
        self.text += tokens
        end = len(self.text) - 1
        if end - self.base >= PREFILL_STEP and self._complete(end):
            features = self.features(end)
            assert features is not None
            self.pair.feed(self.stores, features)
            mx.eval([s.state for s in self.stores])


def attach(runner: Any, root: Path | str | None = None) -> bool:
    """Make the bundle's DFlash drafter (`drafter.path` of kind "dflash", else dflash/) the
    runner's drafter (draft "model", then the default); False where it has none or a drafter
    is attached already. Refused: what doctor finds wrong with it or the pair, a quantized
    drafter. The trunk's verify passes run untraced from then on (the taps must see them)."""
    root = Path(root if root is not None else runner.root)
    if runner.drafter is not None:
        return False
    report, target = bundle_drafter(root, read_dflash)
    if report.path is None or report.spec is None:
        return False
    trunk: Trunk = runner.trunk
    dtype = trunk.embedding.weight.dtype
    drafter = load_dflash(root / report.path, report.spec,
                          dtype if mx.issubdtype(dtype, mx.floating) else None)
    if trunk.passes is not None:
        trunk.use_traced(False)
        runner.load_options["traced"] = False
    runner.drafter = DFlashPair.pair(drafter, trunk)
    runner.load_options["drafter"] = "dflash"
    return True

