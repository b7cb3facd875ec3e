"""Gemma 4's assistant drafter run beside its target (docs/assistant.md).

The assistant keeps no cache: each of its layers attends over the K/V the target's cache holds
for the target's last K/V-owning layer of the same kind (full or sliding attention), so drafting
reads the target's mlx-lm caches as they stand after a commit and changes nothing in them. One
draft step: `pre_projection(concat[target_embed(token) * sqrt(target hidden), h])` through the
layers (mlx-lm gemma4_text's own DecoderLayer, built as a K/V-sharing layer), the final norm, then
logits from the tied embedding (or the centroid-routed sparse head) and the next `h` from
`post_projection`. The first `h` is the target's last hidden after its final norm; every step's
queries sit at the last committed token's position, the length of the target's caches (held
constant through a round, as transformers' SinglePositionMultiTokenCandidateGenerator holds it).
"""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.models.gemma4_text import DecoderLayer, ModelArgs

from mtpkit.decoder.drafters.draft_model import STEP_REPS, STEP_TEXT
from mtpkit.decoder.drafters.drafts import Draft
from mtpkit.decoder.drafters.proposers import SessionBound
from mtpkit.decoder.options import OptionError, SamplingParams, Source
from mtpkit.decoder.sampling import Candidates, candidates, greedy
from mtpkit.loaders.assistant import AssistantSpec, read_drafter, read_spec, target_kv
from mtpkit.loaders.config import read_json
from mtpkit.loaders.drafters import bundle_drafter, float_weights
from mtpkit.loaders.findings import UserError


class CentroidHead(nn.Module):
    """The E2B / E4B assistants' LM head: score token clusters, keep the `top_k` best, score
    only their tokens against the embedding and give every other token the row's lowest
    selected logit minus one (transformers' Gemma4AssistantMaskedEmbedder fills with the
    minimum minus one too, so greedy and sampled drafts see the same law)."""

    def __init__(self, spec: AssistantSpec) -> None:
        super().__init__()
        self.centroids = nn.Linear(spec.hidden, spec.num_centroids, bias=False)
        self.token_ordering = mx.zeros((spec.vocab,), dtype=mx.int32)
        self.freeze(keys=["token_ordering"], recurse=False)  # an index, never trained
        self.top_k, self.per_centroid = spec.top_k, spec.vocab // spec.num_centroids

    def __call__(self, h: mx.array, table: mx.array) -> mx.array:
        scores = self.centroids(h)  # (B, L, C)
        best = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., :self.top_k]
        clusters = self.token_ordering.reshape(-1, self.per_centroid)
        ids = clusters[best].reshape(*h.shape[:-1], -1)  # (B, L, top_k * per_centroid)
        rows = table[ids]  # (B, L, n, hidden)
        picked = (rows @ h[..., None]).squeeze(-1)
        floor = picked.min(axis=-1, keepdims=True) - 1
        full = mx.broadcast_to(floor, (*h.shape[:-1], table.shape[0]))
        return mx.put_along_axis(full, ids, picked, axis=-1)


class _Inner(nn.Module):
    def __init__(self, spec: AssistantSpec, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = [DecoderLayer(args, i) for i in range(spec.layers)]
        self.norm = nn.RMSNorm(spec.hidden, eps=args.rms_norm_eps)


class Assistant(nn.Module):
    """The assistant's parameters under its published names; `step` is one draft step."""

    def __init__(self, spec: AssistantSpec) -> None:
        super().__init__()
        self.spec = spec
        # every layer K/V-shared: mlx-lm's Attention then builds no k/v projections, its MLP
        # no double width, and reads the K/V it is given
        args = ModelArgs.from_dict({**spec.text, "num_kv_shared_layers": spec.layers,
                                    "layer_types": list(spec.layer_types),
                                    "hidden_size_per_layer_input": 0,
                                    "use_double_wide_mlp": False, "enable_moe_block": False})
        self.model = _Inner(spec, args)
        self.pre_projection = nn.Linear(2 * spec.backbone_hidden, spec.hidden, bias=False)
        self.post_projection = nn.Linear(spec.hidden, spec.backbone_hidden, bias=False)
        if spec.ordered:
            self.masked_embedding = CentroidHead(spec)
        if not spec.tied:
            self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def logits(self, h: mx.array) -> mx.array:
        if self.spec.ordered:
            return self.masked_embedding(h, self.model.embed_tokens.weight)
        if self.spec.tied:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def step(self, inputs: mx.array, shared: dict[str, tuple[mx.array, mx.array]],
             position: int | mx.array, masks: dict[str, mx.array] | None = None
             ) -> tuple[mx.array, mx.array]:
        """inputs (B, L, 2 * backbone) -> (logits (B, L, V), the next h (B, L, backbone)).
        `shared`: per layer kind the K/V the queries see, all of it unless `masks` says which
        positions (a batch's row: decoder/cache/batch_cache.py's row_kv)."""
        h = self.pre_projection(inputs)
        masks = masks or {}
        for layer in self.model.layers:
            h, _, _ = layer(h, masks.get(layer.layer_type), None,
                            shared_kv=shared[layer.layer_type], offset=position)
        h = self.model.norm(h)
        return self.logits(h), self.post_projection(h)

    @property
    def dtype(self) -> mx.Dtype:
        return self.pre_projection.weight.dtype


def load_assistant(folder: Path) -> Assistant:
    """The assistant from its folder (a bundle's assistant/): float weights as published; the
    tied head's copy, if saved, is dropped. A quantized assistant is refused with a hint."""
    raw = read_json(folder / "config.json")
    spec, bad = read_spec(raw if isinstance(raw, dict) else {}, str(folder / "config.json"))
    if spec is None:
        raise UserError(bad[0].code, bad[0].message, bad[0].hint)
    weights = float_weights(folder, "assistant")
    if spec.tied:
        weights.pop("lm_head.weight", None)
    if "masked_embedding.token_ordering" in weights:
        weights["masked_embedding.token_ordering"] = weights[
            "masked_embedding.token_ordering"].astype(mx.int32)
    model = Assistant(spec)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def _temporal(keys: mx.array, offset: int, idx: int) -> mx.array:
    """A RotatingKVCache buffer in position order, oldest first, from its public state (mlx-lm's
    layout: written in place up to the window, then rotating at `idx`; a multi-token update
    stores it in order, possibly longer than the window)."""
    if idx == keys.shape[2]:
        return keys
    if idx < offset:
        return mx.concatenate([keys[..., idx:, :], keys[..., :idx, :]], axis=2)
    return keys[..., :idx, :]


def shared_kv(caches: list[Any], reads: dict[str, int], window: int
              ) -> tuple[dict[str, tuple[mx.array, mx.array]], int]:
    """What each kind of assistant layer attends over, from the target's mlx-lm caches, and the
    number of tokens those caches hold: the full layer's whole K/V, the sliding layer's last
    `window` + 1 positions (the window of the last position, which the queries share; mlx-lm's
    cache, once it decodes token by token, holds only `window`)."""
    out: dict[str, tuple[mx.array, mx.array]] = {}
    length = 0
    for kind, index in reads.items():
        cache = caches[index]
        if isinstance(cache, KVCache):  # mlx-lm's, or decoder/cache/shapes.py's bounded one
            k, v, offset = cache.state  # buffers grown in steps: only `offset` are written
            keys, values = k[..., :offset, :], v[..., :offset, :]
        elif type(cache) is RotatingKVCache:
            k, v, offset, keep, _, idx = cache.state
            if keep:
                raise UserError("options.invalid", "a sliding cache that keeps a prefix is not "
                                "Gemma 4's", "load the target with mlx-lm's gemma4 caches")
            # transformers' assistant mask keeps keys within distance <= window (inclusive):
            # window + 1 positions, where the cache still holds them
            keys, values = (_temporal(a, offset, idx)[..., -(window + 1):, :] for a in (k, v))
        else:
            raise UserError("options.invalid", f"the assistant reads the target's K/V, which a "
                            f"{type(cache).__name__} holds in another form",
                            "drop --kv-bits when drafting with Gemma 4's assistant")
        out[kind] = (keys, values)
        length = max(length, cache.offset)
    return out, length


def target_embedding(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """The target's input embedding as its own first layer sees it (scaled by sqrt(hidden)):
    the assistant was trained on that, not on its own embedding table."""
    text = getattr(model, "language_model", model)
    inner = text.model
    return lambda tokens: inner.embed_tokens(tokens) * inner.embed_scale


@dataclass
class AssistantDrafter:
    """An assistant paired with its target: which target cache each layer kind reads, and the
    target's embedding."""

    assistant: Assistant
    embed: Callable[[mx.array], mx.array]
    reads: dict[str, int]
    target: nn.Module | None = None  # step_cost's probe fills a fresh cache of it
    _step: float | None = field(default=None, repr=False)  # step_cost, once timed

    @classmethod
    def pair(cls, assistant: Assistant, target: nn.Module, target_config: dict[str, Any]
             ) -> AssistantDrafter:
        kv = target_kv(target_config)
        kinds = set(assistant.spec.layer_types)
        if kv is None or not kinds <= set(kv.layer):
            raise UserError("drafter.mismatch", "the target keeps no K/V for some kind of layer "
                            "the assistant reads", "pair the assistant with its own target")
        return cls(assistant, target_embedding(target), {k: kv.layer[k] for k in kinds}, target)

    def proposer(self, session: AssistantFeed) -> AssistantProposer:
        """A session's proposer (Session builds it from its runner's drafter, as a draft's)."""
        return AssistantProposer(self, session)

    def step_cost(self) -> float:
        """Seconds of one draft step after a short text, timed once: the depth policy's prior
        for the assistant's rounds, as DraftModel.step_cost is a draft model's."""
        if self._step is None:
            assert self.target is not None, "paired with its target"
            caches = make_prompt_cache(self.target)
            inner = getattr(self.target, "language_model", self.target).model
            mx.eval(inner(mx.zeros((1, STEP_TEXT), mx.int32), cache=caches))
            hidden = mx.zeros((1, 1, self.assistant.spec.backbone_hidden), self.assistant.dtype)
            self._step = statistics.median(timeit.repeat(
                lambda: mx.eval(self.draft(caches, hidden, 0, 1)[0]), number=1, repeat=STEP_REPS))
        return self._step

    def draft(self, caches: list[Any], hidden: mx.array, last: int, depth: int,
              params: SamplingParams | None = None, draws: mx.array | None = None
              ) -> tuple[mx.array, Candidates | None]:
        """`depth` drafts after the last committed token `last` (not yet in the target's
        caches), from `hidden`, the target's (1, 1, H) hidden after its final norm at the last
        position the caches hold. Greedy when `draws` is None; else each draft drawn from its
        processed law with that row of `draws` (Session.round_noise's head rows), the laws
        returned as the draft's q. Lazy: nothing is evaluated here."""
        shared, length = shared_kv(caches, self.reads, self.assistant.spec.sliding_window)
        if length == 0:
            raise UserError("options.invalid", "the assistant drafts after a prompt: the "
                            "target's caches are empty", "prefill the prompt first")
        return self.draft_over(shared, None, length, hidden, last, depth, params, draws)

    def draft_row(self, view: RowView, hidden: mx.array, last: int, depth: int,
                  params: SamplingParams | None = None, draws: mx.array | None = None
                  ) -> tuple[mx.array, Candidates | None]:
        """`draft` for a row of a batch, from its view of the batch's caches: the same keys
        alone holds, masked where the batch keeps other rows' padding or holes."""
        shared, masks, length = {}, {}, None
        for kind, index in self.reads.items():
            keys, values, real, offset = view(index, self.assistant.spec.sliding_window + 1)
            shared[kind], masks[kind] = (keys, values), real.reshape(1, 1, 1, -1)
            length = offset if length is None else mx.maximum(length, offset)
        assert length is not None
        return self.draft_over(shared, masks, length, hidden, last, depth, params, draws)

    def draft_over(self, shared: dict[str, tuple[mx.array, mx.array]],
                   masks: dict[str, mx.array] | None, length: int | mx.array, hidden: mx.array,
                   last: int, depth: int, params: SamplingParams | None,
                   draws: mx.array | None) -> tuple[mx.array, Candidates | None]:
        """The draft steps over K/V already read (`draft`, `draft_row`)."""
        dtype = self.assistant.dtype
        shared = {k: (a.astype(dtype), b.astype(dtype)) for k, (a, b) in shared.items()}
        h, token = hidden.astype(dtype), mx.array([[last]], dtype=mx.int32)
        tokens, laws = [], []
        for k in range(depth):
            inputs = mx.concatenate([self.embed(token).astype(dtype), h], axis=-1)
            logits, h = self.assistant.step(inputs, shared, length, masks)
            row = logits[:, -1]
            if draws is None:
                token = greedy(row, keepdims=True)
            else:
                assert params is not None
                laws.append(candidates(row, params, drafter=True))
                token = laws[-1].draw(draws[k:k + 1])[:, None]
            token = token.astype(mx.int32)
            tokens.append(token)
        return mx.concatenate(tokens, axis=1), Candidates.concat(laws) if laws else None


class AssistantFeed(Protocol):
    """What the assistant's proposer reads from a session: the committed token not yet in the
    trunk's caches, those caches, and the trunk's final-normed hidden at their last position."""

    last: int
    params: SamplingParams
    cache: list[Any]
    assistant_hidden: mx.array | None

    def round_noise(self, head_steps: int, drafts: int = 0
                    ) -> tuple[mx.array | None, mx.array | None]: ...


class RowView(Protocol):
    """A batch row's view of one target cache (decoder/rounds/batch.py gives it): (keys, values,
    which of their positions are the row's, the row's length (1,)), a sliding window's
    `last` positions at most."""

    def __call__(self, layer: int, last: int
                 ) -> tuple[mx.array, mx.array, mx.array, mx.array]: ...


class AssistantProposer(SessionBound[AssistantFeed]):
    """decoder/drafters/proposers.py's Proposer for Gemma 4's assistant. Its rounds count as a separate
    drafter's (Source.MODEL). It keeps no state: the target's caches, rolled back by the
    round, are all it reads, so there is nothing to settle. In a batch the session's caches
    are the batch's: `batched` is its row's view of them while it is a row."""

    source = Source.MODEL
    reads_hidden = True  # the session keeps `assistant_hidden` for it (Session.keep_hidden)

    def __init__(self, drafter: AssistantDrafter, session: AssistantFeed) -> None:
        super().__init__(session)
        self.drafter = drafter
        self.batched: RowView | None = None

    def propose(self, depth: int) -> Draft | None:
        session = self.session
        if depth <= 0 or session.assistant_hidden is None:
            return None
        draws, rule = session.round_noise(depth)
        if self.batched is not None:
            tokens, q = self.drafter.draft_row(self.batched, session.assistant_hidden,
                                               session.last, depth, session.params, draws)
        else:
            tokens, q = self.drafter.draft(session.cache, session.assistant_hidden,
                                           session.last, depth, session.params, draws)
        return Draft(mx.concatenate([mx.array([[session.last]], dtype=mx.int32), tokens],
                                    axis=1), q, Source.MODEL, depth, rule=rule)

    def settle(self, tokens: list[int]) -> None:
        pass


def final_normed(trunk: Any, hidden: mx.array) -> mx.array:
    """The trunk's hidden as the assistant reads it, after the final norm: as the trunk returns
    it, or where a head is fed the pre-norm one, through the trunk's own norm (its tap wraps)."""
    if trunk.hidden_feed == "pre_norm":
        return trunk.inner.norm.norm(hidden)
    return hidden


def attach(runner: Any, root: Path | str | None = None) -> bool:
    """Make the bundle's assistant (drafter.path, else assistant/) the runner's drafter (draft
    "model", then the default); False where it has none. Refused: a pair doctor finds wrong, a
    quantized assistant or KV cache (options.invalid: it reads float weights and K/V)."""
    root = Path(root if root is not None else runner.root)
    report, target = bundle_drafter(root, read_drafter)
    if report.path is None:
        return False
    if runner.kv is not None:
        raise OptionError("options.invalid", "kv_bits", "{name} cannot run with Gemma 4's "
                          "assistant: it reads the target's K/V as float arrays",
                          "drop kv_bits to draft with the assistant")
    runner.drafter = AssistantDrafter.pair(load_assistant(root / report.path), runner.trunk.model,
                                           target)
    return True
