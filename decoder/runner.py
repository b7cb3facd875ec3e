"""`mtpkit.load`: a bundle made runnable, and `generate` / `stream` over it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model, load_model

from mtpkit.decoder.cache.caches import batchable, is_recurrent, leaves, unquantizable
from mtpkit.decoder.cache.prefix import PrefixCache
from mtpkit.decoder.cache.shapes import bounded_by_default
from mtpkit.decoder.context import check_prompt, context_of
from mtpkit.decoder.drafters.assistant import attach as attach_assistant
from mtpkit.decoder.drafters.dflash import attach as attach_dflash
from mtpkit.decoder.drafters.draft_model import FIXED_DEPTH, DraftModel, check_vocab
from mtpkit.decoder.model import kernels
from mtpkit.decoder.model.head import Contract, MTPHead
from mtpkit.decoder.model.rows import (
    dequantize_where_wrong,
    use_few_rows_linears,
    use_kernel_linears,
)
from mtpkit.decoder.model.trunk import Trunk
from mtpkit.decoder.options import (
    KV_START,
    DecodeOptions,
    Depth,
    KVQuant,
    OptionError,
    Source,
    batch_option,
    dtype_option,
    kv_option,
)
from mtpkit.decoder.rounds.batch import Batch
from mtpkit.decoder.rounds.scheduler import Event, Request, Scheduler
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.sharded import distributed, sharding
from mtpkit.decoder.stats import Stats
from mtpkit.decoder.tuning import batch_costs
from mtpkit.decoder.tuning.costs import Progress, costs_for
from mtpkit.decoder.tuning.curve import CostCurve
from mtpkit.decoder.tuning.dtypes import choose as choose_dtype
from mtpkit.decoder.tuning.policy import CostTable, DepthPolicy, Tracker
from mtpkit.loaders.arrays import mtp_arrays
from mtpkit.loaders.bundle import BundleView, open_bundle
from mtpkit.loaders.families import family_for
from mtpkit.loaders.findings import Finding, UserError, root_rank
from mtpkit.loaders.model_check import blocking as load_errors
from mtpkit.loaders.mtp import DELTA_ENCODINGS
from mtpkit.loaders.norms import ABSOLUTE, absolute_from_delta, reencode
from mtpkit.loaders.templates import render, unsafe_reach
from mtpkit.loaders.tokenizer import load_wrapper

Prompt = str | list[int] | list[dict[str, Any]]
MAX_AUTO_DEPTH = 8  # deepest round --depth auto considers (the cost curve covers 16 rows)
# Findings that do not stop the weights from running: the template and tokenizer only matter for
# text and chat prompts (checked when used), a stale manifest is reported by doctor, and a
# declared-but-missing head still allows plain decoding.
NON_BLOCKING = ("template.", "tokenizer.", "manifest.", "mtp.missing", "mtp.unsupported")
# A chat prompt on a bundle without a usable template (none, unsafe, or not rendering): refused
# by Runner.render, the one place every entry (generate, serve, the Python API) goes through.
NO_TEMPLATE = "the bundle has no usable chat template, so a chat prompt cannot be rendered"
NO_TEMPLATE_HINT = ("send the prompt as plain text (generate --raw; serve: /v1/completions), or "
                    "restore a template: mtpkit doctor BUNDLE --fix --out DIR")


@dataclass
class Result:
    tokens: list[int]
    text: str
    stats: Stats
    finish_reason: str  # "stop" (EOS) or "length"
    cached_tokens: int = 0  # prompt tokens restored from a prefix cache (not prefilled)


@dataclass
class Piece:
    """Text committed by one step; the last piece of a stream carries the whole result."""

    text: str
    tokens: list[int]
    result: Result | None = None


def dequantize_for_cpu(module: nn.Module) -> None:
    """MLX's CPU backend runs bf16 matmuls far faster than quantized ones, and its gather_mm
    (MoE experts) only in float32: dequantize (mlx-lm's helper, plus the per-head MLA
    projections it skips), then widen the experts."""
    dequantize_model(module)
    multi = [(name, _dequantized_multi(m)) for name, m in module.named_modules()
             if isinstance(m, QuantizedMultiLinear)]
    if multi:
        module.update_modules(tree_unflatten(multi))
    wide = [(name, m) for name, m in module.named_modules()
            if isinstance(m, SwitchLinear) and m.weight.dtype != mx.float32]
    for _, m in wide:
        m.weight = m.weight.astype(mx.float32)


def _dequantized_multi(layer: QuantizedMultiLinear) -> MultiLinear:
    heads, out, packed = layer.weight.shape
    dense = MultiLinear(packed * 32 // layer.bits, out, heads)
    dense.weight = mx.dequantize(layer.weight, layer.scales, layer.get("biases"),
                                 layer.group_size, layer.bits, mode=layer.mode)
    return dense


def _wants_dequantize(dequantize: bool | str) -> bool:
    if dequantize == "auto":
        return mx.default_device().type == mx.DeviceType.cpu
    if isinstance(dequantize, bool):
        return dequantize
    raise ValueError("dequantize must be 'auto', True or False")


def _contract(view: BundleView, overrides: dict[str, Any]) -> Contract:
    fam = view.family
    base = Contract(fam.hidden_feed, fam.next_hidden, fam.concat_order, fam.zero_first_embedding)
    recorded = (view.manifest.data or {}).get("mtp") or {}
    base = base.override(**{k: recorded.get(k) for k in ("hidden_feed", "next_hidden",
                                                           "concat_order")})
    return base.override(**overrides)


def _head_arrays(view: BundleView) -> dict[str, mx.array]:
    """The head's arrays with norm gains encoded like the trunk's (absolute): as doctor decided
    from the trunk's gains, else as the config declares (MTPLX adds +1 to declared delta)."""
    arrays = mtp_arrays(view)
    shifts = view.mtp.norms.shifts(ABSOLUTE) if view.mtp.norms is not None else None
    if shifts is not None:
        return reencode(arrays, shifts)
    declared = str((view.config.mtp_quantization or {}).get("norm_encoding", "")).lower()
    if declared in DELTA_ENCODINGS and view.family.zero_centred_norms:
        arrays = absolute_from_delta(arrays)
    return arrays


class Runner:
    """A trunk, its MTP head (if any), the tokenizer and the chat template of one bundle.
    `context`: the model's context (config.json; None: it declares none); `max_prompt_tokens`:
    an entry's own prompt bound, which replaces it (decoder/context.py)."""

    def __init__(self, trunk: Trunk, head: MTPHead | None, tokenizer: TokenizerWrapper | None,
                 template: str | None = None, special: dict[str, str] | None = None,
                 rollback: str = "record", root: Path | None = None,
                 load_options: dict[str, Any] | None = None, context: int | None = None) -> None:
        self.trunk, self.head, self.tokenizer = trunk, head, tokenizer
        self.context, self.max_prompt_tokens = context, None
        self.template, self.special = template, special or {}
        self.template_code = "template.missing"  # why there is none: the bundle's finding
        self.rollback = rollback
        self.root, self.load_options = root, load_options or {}
        self.dtype_note = ""  # what dtype="auto" chose and why (decoder/tuning/dtypes.py)
        self.unsupported: str | None = None  # why the bundle's head is not run (mtp.unsupported)
        self._costs: CostCurve | None = None
        self.paid: CostTable | None = None  # what passes cost here, by shape (policy.py)
        self.kept: dict[str, Tracker] = {}  # what auto requests' drafts kept, by source (policy.py)
        self.drafter: DraftModel | None = None  # a draft model (load_draft_model)
        self.vocab: dict[str, int] | None = None  # its tokenizer's token -> id, as the bundle's

    @property
    def kv(self) -> KVQuant | None:
        """The trunk's KV cache quantization (--kv-bits), or None."""
        return self.trunk.kv

    def quantize_kv(self, bits: int | None = None, group_size: int = 64,
                    start: int = KV_START) -> None:
        """Quantize the trunk's KV caches as mlx-lm's --kv-bits, --kv-group-size and
        --quantized-kv-start do (bits None: never), for every generation, batch and cost
        measurement of this runner. Refused (options.invalid) where the values are not
        mlx's or this trunk's caches cannot be quantized (a sliding window, no attention,
        a group size that does not divide the heads' width). The MTP head's own cache stays
        unquantized: it holds a few positions per round."""
        kv = kv_option(bits, group_size, start)
        self.trunk.kv = None
        if kv is not None:  # one lazy pass fills fresh caches: their shapes, nothing computed
            probe = self.trunk.make_cache()
            self.trunk(mx.array([[0]]), probe, logits_for=0)
            if (fault := unquantizable(probe, kv)) is not None:
                raise OptionError("options.invalid", *fault)
        self.trunk.kv = kv
        self.load_options.pop("kv", None)
        if kv is not None:  # its own cost curve (decoder/tuning/costs.py keys it by load_options)
            self.load_options["kv"] = kv.to_dict()
        self._costs = None

    def costs(self, refresh: bool = False, progress: Progress | None = None) -> CostCurve:
        """This machine's cost curve for this runner (measured once, cached per bundle).
        progress: told how a measurement goes (decoder/tuning/costs.py's Tick); nothing is printed."""
        if self._costs is None or refresh:
            self._costs = costs_for(self, refresh, progress)
            self.paid = None
            if self._costs.key:  # a bundle's: what `tune --max-batch` timed, as the first prices
                paid, stock = batch_costs.read(self._costs.key)
                batch_costs.seed(self.table(), paid)
                self._stock(stock)
        return self._costs

    def table(self) -> CostTable:
        """The cost table every auto generation and batch of this runner prices passes by
        (decoder/tuning/policy.py): its curve the prior, what passes paid here the correction."""
        curve = self.costs()
        if self.paid is None or self.paid.curve is not curve:
            self.paid = CostTable(curve)
        return self.paid

    def _stock(self, stock: batch_costs.Stock) -> None:
        """A traced trunk's batch passes go stock where tune timed that faster."""
        if self.trunk.passes is not None:
            self.trunk.passes.stock_rows = dict(stock)

    def batch_costs(self, most: int, refresh: bool = False,
                    told: batch_costs.Told | None = None) -> tuple[batch_costs.Paid, bool]:
        """What batches of up to `most` rows pay per round here (decoder/tuning/batch_costs.py):
        stored for this bundle where they cover `most` rows, else timed now and stored; they
        become this runner's batch prices. Returns them and whether they were timed now."""
        most = batch_option(most, self.kv, self.unbatchable)
        key = self.costs().key
        found, stock = batch_costs.read(key) if key and not refresh else ({}, {})
        complete = all(batch_costs.missing(found, size, batch_costs.deepest(self)) is None
                       for size in batch_costs.sizes_up_to(most))
        if complete or self.head is None:
            paid, timed = found, False
        else:
            paid, timed, stock = {}, True, {}
            try:
                batch_costs.measure(self, most, told, paid, stock=stock)
            finally:  # Ctrl-C keeps the shapes timed so far (a later tune times the rest)
                if key and paid:
                    batch_costs.store(key, paid, stock)
        self.paid = None
        batch_costs.seed(self.table(), paid)
        self._stock(stock)
        return paid, timed

    @property
    def batchable(self) -> bool:
        """Whether its rows can decode in one batch exactly (see `unbatchable`)."""
        return not self.unbatchable

    @property
    def unbatchable(self) -> str:
        """Why its rows cannot decode in one batch exactly ("" where they can): caches a batch
        cannot hold (caches.batchable), a recurrent layer no recorder replays (a batch rolls
        each row back to its own count by replay: decoder/cache/recording.py), or the family
        table's reason."""
        cache = self.trunk.make_cache()
        if not batchable(cache):
            return ("a batch holds mlx-lm's KVCache, recurrent caches, sliding windows that keep "
                    "no prefix and CacheLists of those")
        if sum(map(is_recurrent, leaves(cache))) > len(self.trunk.recorders):
            return "a recurrent layer here is not recorded, so a batch cannot roll a row back"
        return family_for(getattr(self.trunk.args, "model_type", None)).unbatchable

    def draft_source(self, depth: Depth, draft: str | None) -> Source:
        """The draft source for a depth and draft argument on this bundle (checked as every
        entry checks it: decoder/options.py)."""
        return DecodeOptions.of(depth, draft).source(self.head is not None, self.unsupported,
                                                     self.drafter is not None)

    def load_draft_model(self, path: str | Path, dequantize: bool | str = "auto") -> DraftModel:
        """A separate draft model (mlx-lm's --draft-model) checked against this runner and
        loaded: refused as `load` refuses a bundle, draft.vocab_mismatch where its tokenizer
        is not this one's, options.invalid where its caches cannot roll back
        (decoder/drafters/draft_model.py). From then on it is the default drafter (draft "model")."""
        view = open_draft(path, self.vocab)
        model, _ = load_model(view.root, lazy=True, trust_remote_code=False)  # never bundle code
        if _wants_dequantize(dequantize):
            dequantize_for_cpu(model)
        drafter = DraftModel(model, self.trunk.args.vocab_size, f"draft model {path}")
        mx.eval(model.parameters())
        self.drafter = drafter
        self.load_options["draft_model"] = str(path)
        return drafter

    def policy(self, depth: Depth, draft: Source = Source.HEAD
               ) -> tuple[int, DepthPolicy | None]:
        """(deepest depth, policy or None) for a depth argument: a number forces that depth;
        "auto" lets measured costs and online acceptance choose, up to MAX_AUTO_DEPTH (a draft
        model's rounds priced by its own step, timed once: DraftModel.step_cost). A draft
        model drafts FIXED_DEPTH under None (decoder/drafters/draft_model.py)."""
        if draft == Source.MODEL and depth is None:
            return FIXED_DEPTH, None
        if draft == Source.MODEL and depth == "auto" and self.drafter is not None:
            return MAX_AUTO_DEPTH, DepthPolicy(self.costs(), MAX_AUTO_DEPTH, sources=(draft,),
                                               table=self.table(), memory=self.kept,
                                               model_step=self.drafter.step_cost())
        if depth == "auto":
            sources = tuple(s for s, ok in ((Source.HEAD, self.head is not None
                                             and draft != Source.LOOKUP),
                                            (Source.LOOKUP, draft != Source.HEAD)) if ok)
            if not sources:
                return 0, None
            return MAX_AUTO_DEPTH, DepthPolicy(self.costs(), MAX_AUTO_DEPTH, sources=sources,
                                               table=self.table(), memory=self.kept)
        if depth is None:
            return (self.head.blocks if self.head is not None else 0), None
        assert isinstance(depth, int)  # checked: DecodeOptions
        return depth, None

    def encode(self, prompt: Prompt, **template_options: Any) -> list[int]:
        """Text as is, token ids as given, chat messages through the bundle's template (with
        `template_options` such as enable_thinking or tools)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if self.tokenizer is None:
            raise UserError("tokenizer.missing", "this runner has no tokenizer",
                            "pass token ids instead of text")
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        text = self.render(prompt, **template_options)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_prompt(self, tokens: int) -> None:
        """UserError prompt.too_long for a prompt over this runner's bound, before any model
        work (decoder/context.py: the one check every entry makes)."""
        check_prompt(tokens, self.context, self.max_prompt_tokens)

    def render(self, messages: list[dict[str, Any]], **template_options: Any) -> str:
        """The chat prompt text (sandboxed render of the bundle's template)."""
        if self.template is None:  # never sent as raw text instead: every entry refuses
            raise UserError(self.template_code, NO_TEMPLATE, NO_TEMPLATE_HINT)
        return render(self.template, messages, self.special, **template_options)

    def stream(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
               depth: Depth = "auto", seed: int | None = None,
               draft: str | None = None, prefix: PrefixCache | None = None,
               stop: Callable[[], bool] | None = None,
               checkpoints: Sequence[int] = ()) -> Iterator[Piece]:
        """Yield text as it is committed; the last piece carries the Result. depth: "auto"
        (chosen per round from this machine's measured costs), a number (forced; 0 is plain
        decoding) or None (the head's layer count). draft: "head", "lookup" (context drafts,
        any bundle) or "both"; default: see draft_source. prefix: a prefix cache the prompt
        starts from and is kept in (decoder/cache/prefix.py), with the states at `checkpoints` (prompt
        lengths) where recurrent states cannot be trimmed back. stop: asked after each piece
        and between prefill chunks; true ends the generation there (a stop sequence seen, a
        client gone), result and all (cut in the prefill: no tokens). A prompt over the
        runner's bound is refused first (UserError prompt.too_long)."""
        request = self.prepare(prompt, max_tokens, temperature=temperature, top_p=top_p,
                               top_k=top_k, min_p=min_p, depth=depth, seed=seed, draft=draft,
                               prefix=prefix, stop=stop, checkpoints=checkpoints)
        pieces = self.texts(request)
        if max_tokens <= 0:
            request.finish = "length"
            yield from pieces(Event(request, [], True))
            return
        scheduler = self.scheduler(1)
        scheduler.add(request)
        for event in scheduler.run():
            yield from pieces(event)
            if not event.done and stop is not None and stop():  # asked after each piece
                request.finish = "cancelled"
                yield from pieces(Event(request, [], True))
                return

    def prepare(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, depth: Depth = "auto",
                seed: int | None = None, draft: str | None = None,
                prefix: PrefixCache | None = None, stop: Callable[[], bool] | None = None,
                checkpoints: Sequence[int] = ()) -> Request:
        """One generation's options checked (decoder/options.py), its prompt encoded and
        bounded, and the session that will decode it (see stream for the arguments)."""
        options = DecodeOptions.of(depth, draft, temperature, top_p, top_k, min_p, seed)
        source = options.source(self.head is not None, self.unsupported,
                                self.drafter is not None)
        deepest, policy = self.policy(options.depth, source)
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("empty prompt")
        self.check_prompt(len(ids))
        session = Session(self.trunk, self.head, options.sampling, deepest, options.seed,
                          self.rollback, draft=source, stop=stop, prefix=prefix,
                          checkpoints=checkpoints, drafter=self.drafter)
        eos = set(self.tokenizer.eos_token_ids) if self.tokenizer is not None else set()
        return Request(ids, session, max_tokens, eos, policy if deepest > 0 else None, stop)

    def scheduler(self, most: int, table: CostTable | None = None,
                  solo: bool = True) -> Scheduler:
        """The engine for sequences, one or many (decoder/rounds/scheduler.py over
        rounds/batch.py), up to `most` at once, built here only: `stream`, `stream_batch`,
        `serve`'s worker and `tune --max-batch` all run this one. table, solo: Scheduler's; a
        lone request may run as a batch of one where this runner's rows batch exactly, with
        float caches, unsharded, and no recurrent layer (a batch replays all of a round's
        positions to roll a row back, a lone session only those kept: cache/recording.py)."""
        return Scheduler(Batch(self.trunk, self.head), most, table, solo,
                         one_row=(self.kv is None and "shard" not in self.load_options
                                  and not self.trunk.recorders and self.batchable))

    def stream_batch(self, prompts: Sequence[Prompt], max_tokens: int = 256,
                     max_batch: int = 8, each: Sequence[dict[str, Any]] | None = None,
                     **options: Any) -> Iterator[tuple[int, Piece]]:
        """Decode `prompts` together (decoder/rounds/scheduler.py: up to `max_batch` at once, the rest
        joining as others finish), each exactly as `stream` would decode it alone. Yields
        (prompt index, Piece) as text is committed; each prompt's last piece carries its
        Result. `options` apply to every prompt, `each[i]` (max_tokens included) to prompt i
        only."""
        most = batch_option(max_batch, self.kv, self.unbatchable)
        scheduler = self.scheduler(most)
        asks = [options | {"max_tokens": max_tokens} | (dict(each[i]) if each else {})
                for i in range(len(prompts))]
        requests = [self.prepare(p, **a) for p, a in zip(prompts, asks, strict=True)]
        index = {id(r): i for i, r in enumerate(requests)}
        texts = {id(r): self.texts(r) for r in requests}
        for r in requests:
            scheduler.add(r)
        for event in scheduler.run():
            for piece in texts[id(event.request)](event):
                yield index[id(event.request)], piece

    def texts(self, request: Request) -> Callable[[Event], list[Piece]]:
        """A batched request's events as Pieces: its text detokenized as it is committed,
        and on its last event the Result (as `stream` ends)."""
        detok = self.tokenizer.detokenizer if self.tokenizer is not None else None

        def pieces(event: Event) -> list[Piece]:
            out, text = [], ""
            if detok is not None:
                for t in event.tokens:
                    detok.add_token(t)
                text = detok.last_segment
            if event.tokens:
                out.append(Piece(text, event.tokens))
            if event.done:
                tail = ""
                if detok is not None:
                    detok.finalize()
                    tail = detok.last_segment
                decoded = (self.tokenizer.decode(request.tokens)
                           if self.tokenizer is not None else "")
                reason = "length" if request.finish == "length" else "stop"
                out.append(Piece(tail, [], Result(request.tokens, decoded, request.stats, reason,
                                                  request.session.cached_tokens)))
            return out

        return pieces

    def generate_batch(self, prompts: Sequence[Prompt], max_tokens: int = 256,
                       **options: Any) -> list[Result]:
        """Results of `prompts` decoded together (see stream_batch), in prompt order."""
        results: list[Result | None] = [None] * len(prompts)
        for i, piece in self.stream_batch(prompts, max_tokens, **options):
            if piece.result is not None:
                results[i] = piece.result
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def generate(self, prompt: Prompt, max_tokens: int = 256, **options: Any) -> Result:
        """Tokens, text and statistics of one generation; depth=0 is plain decoding."""
        for piece in self.stream(prompt, max_tokens, **options):
            if piece.result is not None:
                return piece.result
        raise AssertionError("stream ended without a result")


def cast_floats(module: nn.Module, dtype: mx.Dtype) -> None:
    module.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating)
                           else a, module.parameters()))


def load(path: str | Path, dequantize: bool | str = "auto", *, dtype: str | None = "auto",
         hidden_feed: str | None = None, next_hidden: str | None = None,
         concat_order: str | None = None, rollback: str = "record",
         shard: str | None = None, kv_bits: int | None = None, kv_group_size: int = 64,
         quantized_kv_start: int = KV_START, draft_model: str | Path | None = None) -> Runner:
    """Load a converted bundle: trunk through mlx-lm's own classes, MTP head from the sidecar.

    dequantize="auto" runs quantized weights as bf16 (and MoE experts as float32) on MLX's CPU
    backend, where that is much faster. dtype="auto" keeps the bundle's float dtype except where
    float32 is clearly faster and fits (MLX's CPU backend; decoder/tuning/dtypes.py says why, and
    `Runner.dtype_note` what it chose); None keeps it always; "float32" widens every
    float weight: verify passes
    over K+1 positions then round like one-token steps to ~1e-6, so greedy identity with plain
    decoding holds even where bf16 rounding would flip a near-tie. The contract knobs override
    the family/manifest values. On CPU, the trunk's and head's float linears multiply verify
    passes weight-first (decoder/model/rows.py). rollback: how recurrent (GatedDeltaNet) state
    returns to the last kept token: "record" (states recorded per position during verify) or
    "replay". shard: "tensor" or "pipeline" in a process started by mlx.launch: this rank's
    part of the trunk (decoder/sharded/sharding.py), the head on rank 0 only, which drives the other
    ranks (decoder/sharded/distributed.py). kv_bits, kv_group_size, quantized_kv_start: mlx-lm's
    quantized KV cache (Runner.quantize_kv), checked before the weights load. draft_model: a
    separate draft model's bundle (Runner.load_draft_model), its tokenizer checked against
    this one's before any weights load.
    """
    _check_load_options(dequantize, dtype, shard, kv_bits, kv_group_size, quantized_kv_start,
                        draft_model)
    view = open_bundle(path)
    unsupported = _refuse(view, path)
    if draft_model is not None:
        open_draft(draft_model, view.tokenizer.vocab)
    # never runs bundle code (auto_map); a file transformers chokes on is one UserError, before
    # the weights load
    tokenizer = load_wrapper(view.root, view.tokenizer, str(path)) if view.tokenizer.kind else None
    contract = _contract(view, {"hidden_feed": hidden_feed, "next_hidden": next_hidden,
                                "concat_order": concat_order})
    group = sharding.join(shard) if shard is not None else None
    trunk, head, options, dtype_note = _build(view, contract, unsupported, dequantize, dtype,
                                              group, shard)
    runner = Runner(trunk, head, tokenizer, safe_template(view), view.tokenizer.special_tokens(),
                    rollback, Path(view.root), options, context_of(view.config.text))
    runner.dtype_note = dtype_note
    runner.vocab = view.tokenizer.vocab
    runner.unsupported = unsupported.message if unsupported is not None else None
    runner.quantize_kv(kv_bits, kv_group_size, quantized_kv_start)
    runner.template_code = next((f.code for f in view.findings if f.code.startswith("template.")
                                 and f.severity == "error"), "template.missing")
    _attach_drafters(runner, Path(view.root), group, draft_model, dequantize)
    return distributed.attach(runner, group, shard) if group is not None else runner


def _check_load_options(dequantize: bool | str, dtype: str | None, shard: str | None,
                        kv_bits: int | None, kv_group_size: int, quantized_kv_start: int,
                        draft_model: str | Path | None) -> None:
    """`load`'s options, alone and against each other, before the bundle is even opened: a bad
    option costs no weights loaded and reads no file (checked in this order: dtype, kv_bits
    against shard, keep-quantized against dtype, draft_model against shard)."""
    dtype_option(dtype)
    if kv_option(kv_bits, kv_group_size, quantized_kv_start) is not None and shard is not None:
        raise OptionError("options.invalid", "kv_bits", "{name} cannot run with a sharded trunk",
                          "drop kv_bits or shard (each rank would switch its caches alone)")
    if dequantize is False and dtype not in (None, "auto"):
        raise UserError("usage", "keeping the quantized weights and casting them to "
                        f"{dtype} contradict each other", "drop --keep-quantized or --dtype")
    if draft_model is not None and shard is not None:
        raise OptionError("options.invalid", "draft_model", "{name} cannot run with a sharded "
                          "trunk", "drop draft_model or shard")


def _build(view: BundleView, contract: Contract, unsupported: Finding | None,
           dequantize: bool | str, dtype: str | None, group: mx.distributed.Group | None,
           shard: str | None) -> tuple[Trunk, MTPHead | None, dict[str, Any], str]:
    """The trunk and head as this machine runs them: (trunk, head, the load options the cost
    cache is keyed by, why this dtype). One dtype choice for both, so the head computes in the
    trunk's numerics; this rank's part of the trunk where sharded, the head on rank 0 only (it
    drives the others) and only where it is supported; the backend's faster linears; traced
    verify passes where the host bounds them; every weight evaluated (and the ranks in step)."""
    model, _ = load_model(view.root, lazy=True, trust_remote_code=False)  # never bundle code
    chosen = choose_dtype(dtype, [a for _, a in tree_flatten(model.parameters())],
                          dequantize is False)
    dtype = chosen.dtype
    flat = _wants_dequantize(dequantize) or dtype is not None
    _set_numerics(model, flat, dtype)
    if group is not None and shard == "tensor":
        sharding.shard_tensor(model, group)
    trunk = Trunk(model, contract.hidden_feed)
    head = None
    if view.mtp.tensors and unsupported is None and (group is None or group.rank() == 0):
        head = MTPHead(trunk, _head_arrays(view), contract, view.family.mtp_layer_kind,
                       view.mtp_quantization)
        _set_numerics(head, flat, dtype)
    if group is not None and shard == "pipeline":
        sharding.shard_pipeline(trunk, group)
    _fast_linears(trunk, head)
    for module in (trunk.text, head):
        if module is not None and not flat:
            dequantize_where_wrong(module)
    traced = group is None and bounded_by_default()
    if traced:  # where the host's graph building bounds a verify pass (a GPU)
        trunk.use_traced()
    mx.eval(model.parameters(), head.parameters() if head is not None else [])
    options = {"dequantize": flat, "dtype": dtype, "contract": contract.to_dict(),
               "traced": traced, "dequantized": flat and bool(view.config.quantization)}
    if group is not None:
        options |= {"shard": shard, "ranks": group.size()}
        sharding.barrier(group)
    return trunk, head, options, chosen.reason


def _set_numerics(module: nn.Module, flat: bool, dtype: str | None) -> None:
    """The trunk's or the head's weights in the numerics `load` chose (the same for both):
    quantized ones dequantized where `flat`, floats cast to `dtype` (None: kept)."""
    if flat:
        dequantize_for_cpu(module)
    if dtype is not None:
        cast_floats(module, getattr(mx, dtype))


def _fast_linears(trunk: Trunk, head: MTPHead | None) -> None:
    """The backend's faster linears for verify passes (decoder/model/rows.py): few-row linears on a
    CPU (weight-first), the CUDA kernel's twins where the kernel is available; else MLX's own."""
    if mx.default_device().type == mx.DeviceType.cpu:
        use_few_rows_linears(trunk.inner)  # the layers; an untied lm_head is slower weight-first
        if head is not None:
            use_few_rows_linears(head)
    elif kernels.cuda_available():
        use_kernel_linears(trunk.text)
        if head is not None:
            use_kernel_linears(head)


def _attach_drafters(runner: Runner, root: Path, group: mx.distributed.Group | None,
                     draft_model: str | Path | None, dequantize: bool | str) -> None:
    """The runner's drafters beyond its head: one shipped in the bundle (Gemma 4's assistant/, a
    DFlash drafter's dflash/; untried on a sharded trunk, so not attached there), then a draft
    model given to `load`, which replaces it as the default drafter."""
    if group is None:
        attach_assistant(runner, root)
        attach_dflash(runner, root)
    if draft_model is not None:
        runner.load_draft_model(draft_model, dequantize)


def open_draft(path: str | Path, vocab: dict[str, int] | None) -> BundleView:
    """A draft model's bundle, header-only, refused as `load` refuses a bundle, or with
    draft.vocab_mismatch where its tokenizer's token -> id map is not `vocab` (the target's;
    None: a target built in memory, with no tokenizer files to compare)."""
    view = open_bundle(path)
    _refuse(view, path)
    if vocab is not None:
        check_vocab(vocab, view.tokenizer.vocab, f"draft model {path}")
    return view


def _refuse(view: BundleView, path: str | Path) -> Finding | None:
    """Refuse a bundle before mlx-lm opens or builds anything, root cause first (a file no
    loader may open leaves shards missing, the shards that would have said "MLX bundle"
    included); a tensor the model class or the head would refuse or misread, as doctor reports
    it. Returns the mtp.unsupported finding, if any: such a head is kept on disk and the trunk
    still runs (plain decoding and context drafts)."""
    errors = load_errors(view)
    blocking = sorted((f for f in errors if not f.code.startswith(NON_BLOCKING)),
                      key=root_rank)
    if view.kind != "mlx" and not (blocking and blocking[0].code in (
            "files.not_regular", "index.path_escape")):
        raise UserError("load.not_converted", f"{path} is a Hugging Face checkpoint, not an MLX "
                        "bundle", "mtpkit convert it first")
    if blocking:
        first = blocking[0]
        where = f" [{first.location}]" if first.location else ""
        raise UserError(first.code, f"{path}: {first.message}{where}", first.hint or
                        "mtpkit doctor BUNDLE shows every finding")
    return next((f for f in errors if f.code == "mtp.unsupported"), None)


def numerics_note(runner: Runner) -> str | None:
    """A line each where the numerics are not mlx-lm's on this bundle (its quantized weights run
    dequantized; dtype auto widened them, or said why not), so that a greedy text differing from
    stock mlx-lm is never a surprise."""
    notes = [f"note: {runner.dtype_note}"] if runner.dtype_note else []
    if runner.load_options.get("dequantized"):
        notes.append("note: this quantized bundle runs dequantized (faster on MLX's CPU backend), "
                     "so its greedy text can differ from mlx-lm's on the same bundle; "
                     "--keep-quantized runs mlx-lm's quantized numerics")
    return "\n".join(notes) or None


def safe_template(view: BundleView) -> str | None:
    """The bundle's chat template, or None where it is unsafe or does not render (doctor
    reports why; such a template is never rendered)."""
    template = view.template.text
    if template is not None and (not view.template.renders or unsafe_reach(template)):
        return None
    return template
