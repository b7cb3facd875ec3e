"""`mtpkit graft`: train a Qwen-style MTP head on a frozen trunk by self-distillation.

The head (fc over the normed embedding and the normed trunk hidden, one decoder layer of the
trunk's own class, final norm; embedding and lm_head shared and frozen) learns the trunk's own
greedy token at position t+2 from the trunk hidden at t and token t+1, on the trunk's own greedy
continuations of corpus prompts (rollouts.py). Training runs in float32
(MLX's CPU backend runs bf16 matmuls without BLAS), so its speed is the BLAS's (decoder/model/blas.py);
the written trunk is the source's, unchanged. `--minutes` bounds the whole command: scoring and
writing are reserved out of it from costs measured here before training (scoring.py).
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from mtpkit.convert.convert import ConvertError, finish_bundle, write_config
from mtpkit.convert.sidecar import SidecarOptions, encode_sidecar
from mtpkit.convert.writer import claim_output, staged_output, write_safetensors
from mtpkit.decoder.model.blas import fix, in_use, loaded_blas
from mtpkit.decoder.model.head import Contract, MTPHead, canonical_name
from mtpkit.decoder.model.rows import use_few_rows_linears
from mtpkit.decoder.model.trunk import Trunk
from mtpkit.decoder.runner import Prompt, Runner, cast_floats, dequantize_for_cpu, safe_template
from mtpkit.decoder.tuning.costs import measure_decoding
from mtpkit.loaders.bundle import BundleView, open_bundle
from mtpkit.loaders.manifest import MANIFEST_FILE
from mtpkit.loaders.tokenizer import load_wrapper
from mtpkit.loaders.weights import SIDECAR_FILE
from mtpkit.train.copying import attention_of, copy_loss, copy_sources
from mtpkit.train.corpus import Document, prose, read_documents, split_documents
from mtpkit.train.rollouts import INSTRUCTIONS, Prompts, Rollouts, chat_frame, rollout
from mtpkit.train.scoring import Plan, plan, verdict

WARMUP_STEPS = 50
DEFAULT_MINUTES = 27.0  # the whole command; on SmolLM2 with OpenBLAS ~25 of them train
PROBE_PROMPT = 32  # prompt tokens before the timed decode steps (costs.measure_decoding)


@dataclass
class GraftOptions:
    corpus: list[Path] | None = None  # None: the Python standard library's source
    steps: int | None = None
    minutes: float | None = None  # whole-command budget; training stops at steps or at its share
    seq_len: int = 128
    batch: int = 8
    learning_rate: float = 1e-3
    seed: int = 0
    draft_vocab: int = 8192  # draft over the corpus's most frequent tokens; 0: full vocabulary
    copy_weight: float = 1.0  # weight of the attention-on-the-copy loss (copying.py); 0: off
    trunk_share: float = 0.5  # with --minutes: share of the training time for the rollouts
    passes: int = 4  # with --steps: each window the trunk saw is trained on this many times
    rollout_batch: int = 32  # prompts the trunk continues together (decoding is batched)
    cache_bytes: int = 2 << 30  # ceiling on the cached trunk hiddens
    eval_prompts: int = 24
    eval_tokens: int = 48
    sidecar: SidecarOptions = field(default_factory=lambda: SidecarOptions(policy="keep"))
    force: bool = False
    command: str = "mtpkit graft"

    def __post_init__(self) -> None:
        if self.steps is None and self.minutes is None:
            self.minutes = DEFAULT_MINUTES


@dataclass
class Progress:
    step: int  # windows cached (phase "trunk") or optimizer steps (phase "head")
    loss: float | None
    elapsed_s: float
    eta_s: float | None
    phase: str = "head"
    total: int | None = None


@dataclass
class GraftResult:
    out: Path
    manifest: dict[str, Any]
    graft: dict[str, Any]


def _initial_weights(trunk: Trunk, seed: int) -> dict[str, mx.array]:
    """A warm start: the decoder layer copies the trunk's last layer of the same kind, the
    norms copy the trunk's final norm, fc starts near a mix of its two inputs."""
    build = trunk.layer_factory("full_attention")
    layer = build()
    template = next(layer_ for layer_ in reversed(list(trunk.inner.layers))
                    if type(layer_) is type(layer) and not getattr(layer_, "is_linear", False))
    weights = {f"mtp.layers.0.{k}": v for k, v in tree_flatten(template.parameters())}
    h = trunk.args.hidden_size
    key = mx.random.key(seed)
    eye = mx.eye(h)
    fc = mx.concatenate([0.5 * eye, 0.5 * eye], axis=1) + mx.random.normal((h, 2 * h), key=key) * 0.01
    norm = trunk.inner.norm.weight if "weight" in trunk.inner.norm else mx.ones((h,))
    return weights | {"mtp.fc.weight": fc, "mtp.pre_fc_norm_embedding.weight": mx.ones((h,)),
                      "mtp.pre_fc_norm_hidden.weight": mx.ones((h,)), "mtp.norm.weight": norm}


def _loss(head: MTPHead, hidden: mx.array, tokens: mx.array, targets: mx.array,
          mask: mx.array, sources: mx.array | None, copy_weight: float) -> mx.array:
    """Cross-entropy of the trunk's greedy token at t+2 (an index into the draft vocabulary)
    under the head, averaged over the positions that train. Matching the trunk's argmax is what
    greedy acceptance counts; on SmolLM2 it beat KL to the trunk's full distribution for the
    same minutes (31.0% vs 22.6% held-out argmax agreement; docs/benchmarks-history.md). With sources, plus
    copy_weight times the attention-on-the-copy loss (copying.py)."""
    logits, _ = head(hidden, tokens, None, 0, full_vocab=False)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = mx.logsumexp(logits, axis=-1) - picked
    loss = mx.sum(ce * mask) / mx.maximum(mx.sum(mask), 1.0)
    if sources is None:
        return loss
    return loss + copy_weight * copy_loss(head.layers[0], head.layer_input(hidden, tokens), sources)


def _rollout_pass(trunk: Trunk, prompts: Prompts, eos: set[int], options: GraftOptions,
                  start: float, budget: float, after: float, step_s: float,
                  progress: Callable[[Progress], None]) -> tuple[Rollouts, dict[str, int]]:
    """Let the frozen trunk continue corpus prompts greedily, once, and keep its hiddens. The
    trunk costs several times the head's forward and backward, so the head then trains for
    several passes over this cache. Stops at the window target (--steps), trunk_share of the
    training time left (--minutes; training ends `budget` seconds after the command's `start`),
    the corpus's distinct prompts or cache_bytes, whichever comes first. A batch has no more
    rows than fit in the time left: at first priced at one single-row decode step (`step_s`)
    per window token, the reference BLAS's cost (an optimized one batches rows for far less),
    then at what the last batch cost per row. ETAs add `after`, what scoring and writing take."""
    total = options.seq_len + 2
    per_window = (options.seq_len + 1) * trunk.args.hidden_size * 4
    target = min(prompts.windows, options.cache_bytes // per_window)
    if options.steps is not None:
        target = min(target, max(options.batch,
                                 -(-options.steps * options.batch // max(1, options.passes))))
    if target == 0:
        raise ConvertError("graft.corpus", f"the corpus is too small for prompts of "
                           f"{prompts.span} tokens", "pass more text or a smaller --seq-len")
    begun = time.perf_counter() - start
    deadline = begun + (budget - begun) * options.trunk_share if options.minutes else budget
    hiddens: list[mx.array] = []
    tokens: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    kinds = {"raw": 0, "chat": 0}
    done = 0
    row_s = total * step_s
    while done < target and (not done or time.perf_counter() - start < deadline):
        fits = (deadline - (time.perf_counter() - start)) / row_s
        rows = min(options.rollout_batch, target - done)
        if fits < rows:  # never with --steps alone: the deadline is infinite
            rows = max(1, int(fits))
        began = time.perf_counter()
        batch, kind = prompts.next(rows)
        hidden, ids, greedy, mask = rollout(trunk, batch, total, eos)
        row_s = (time.perf_counter() - began) / rows
        hiddens.append(hidden)
        tokens.append(ids)
        targets.append(greedy)
        masks.append(mask)
        kinds[kind] += len(ids)
        done += len(ids)
        elapsed = time.perf_counter() - start
        left = row_s * (target - done)
        progress(Progress(done, None, elapsed, min(left, max(0.0, deadline - elapsed)) + after,
                          "trunk", target if options.minutes is None else None))
    return Rollouts(mx.concatenate(hiddens), mx.array(np.concatenate(tokens)),
                    mx.array(np.concatenate(targets)), mx.array(np.concatenate(masks))), kinds


def _draft_targets(cache: Rollouts, vocab: np.ndarray) -> tuple[mx.array, mx.array]:
    """The targets as indices into the draft vocabulary, and the mask without the positions
    whose target the draft vocabulary cannot propose."""
    targets = np.array(cache.targets)
    index = np.full(max(int(vocab.max()), int(targets.max())) + 1, -1, dtype=np.int32)
    index[vocab] = np.arange(len(vocab), dtype=np.int32)
    found = index[targets]
    return mx.array(np.maximum(found, 0)), cache.mask * mx.array(found >= 0)


def _train_head(head: MTPHead, cache: Rollouts, vocab: np.ndarray, options: GraftOptions,
                start: float, budget: float, after: float,
                progress: Callable[[Progress], None]) -> list[float]:
    """Distil the trunk's greedy choices into the head over shuffled passes of the cache, until
    --steps or `budget` seconds after the command's `start`."""
    optimizer = optim.AdamW(learning_rate=options.learning_rate, weight_decay=0.0)
    step_fn = nn.value_and_grad(head, _loss)
    head_start = time.perf_counter()
    head_budget = max(1e-9, budget - (head_start - start))
    targets, mask = _draft_targets(cache, vocab)
    sources = _copy_sources(head, cache, options)
    rng = np.random.default_rng(options.seed)
    order: list[int] = []
    losses: list[float] = []
    while ((options.steps is None or len(losses) < options.steps)
           and (not losses or time.perf_counter() - start < budget)):
        if len(order) < options.batch:
            order.extend(rng.permutation(cache.tokens.shape[0]).tolist())
        done = max(len(losses) / options.steps if options.steps else 0.0,
                   (time.perf_counter() - head_start) / head_budget)  # whichever ends first
        optimizer.learning_rate = learning_rate(options.learning_rate, len(losses), done)
        pick = mx.array(order[:options.batch])
        del order[:options.batch]
        loss, grads = step_fn(head, cache.hidden[pick][:, :-1], cache.tokens[pick][:, 1:-1],
                              targets[pick], mask[pick],
                              None if sources is None else sources[pick], options.copy_weight)
        optimizer.update(head, grads)
        mx.eval(loss, head.parameters(), optimizer.state)
        losses.append(float(loss))
        now = time.perf_counter()
        left = [budget - (now - start)]
        if options.steps is not None:
            left.append((now - head_start) / len(losses) * (options.steps - len(losses)))
        progress(Progress(len(losses), losses[-1], now - start, max(0.0, min(left)) + after,
                          "head", options.steps))
    return losses


def _copy_sources(head: MTPHead, cache: Rollouts, options: GraftOptions) -> mx.array | None:
    """Where the copy loss points each training position (-1: nowhere), or None when it is off
    or the head's attention class is not in copying.QUERY_KEY_FORMS."""
    if options.copy_weight <= 0 or attention_of(head.layers[0]) is None:
        return None
    sources = copy_sources(np.array(cache.tokens), np.array(cache.targets))
    return mx.array(np.where(np.array(cache.mask) > 0, sources, -1))


def learning_rate(peak: float, step: int, done: float) -> float:
    """Linear warm-up from a tenth of the peak over WARMUP_STEPS, then cosine decay to 5% of it
    at the end of the run (`done`: the share of steps or minutes spent). The warm start (the
    trunk's own last layer) survives the first steps; on SmolLM2 the schedule beat a constant
    rate for the same minutes (docs/benchmarks-history.md)."""
    if step < WARMUP_STEPS:
        return peak * (0.1 + 0.9 * step / WARMUP_STEPS)
    floor = 0.05 * peak
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def frequent_tokens(ids: Sequence[Sequence[int] | np.ndarray], vocab: int,
                    size: int) -> np.ndarray:
    """The `size` most frequent token ids of the corpus (ascending ids), or all of them."""
    if size <= 0 or size >= vocab:
        return np.arange(vocab, dtype=np.int32)
    counts = np.bincount(np.concatenate([np.asarray(d) for d in ids]), minlength=vocab)[:vocab]
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int32)


def _encode(docs: list[Document], tokenizer: Any) -> list[list[int]]:
    eos = tokenizer.eos_token_id
    return [[*tokenizer.encode(d.text, add_special_tokens=False), eos] for d in docs]


def held_out_prompts(held: list[Document], count: int, seed: int) -> list[str]:
    """Code openings and prose (docstrings) from held-out documents, alternating."""
    rng = np.random.default_rng(seed)
    code = [d.text[:600] for d in held if len(d.text.strip()) > 40]
    text = [p[:600] for d in held for p in prose(d)]
    rng.shuffle(code)
    rng.shuffle(text)
    mixed = [x for pair in zip(code, text, strict=False) for x in pair] + code + text
    return mixed[:count]


def held_out_chats(held: list[Document], count: int, seed: int) -> list[list[dict[str, str]]]:
    """The same kind of held-out text inside chat requests (the instructions in turn)."""
    return [[{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)] + text[:400]}]
            for i, text in enumerate(held_out_prompts(held, count, seed))]


def measure_acceptance(runner: Runner, prompts: Sequence[Prompt], tokens: int,
                       deadline: float = math.inf) -> dict[str, Any]:
    """Greedy depth-1 acceptance over held-out prompts (pooled over verify rounds). No prompt
    after the first starts past `deadline` (a time.perf_counter() value)."""
    proposed = accepted = scored = 0
    for prompt in prompts:
        if scored and time.perf_counter() >= deadline:
            break
        stats = runner.generate(prompt, tokens, depth=1).stats
        proposed += stats.proposed[0] if stats.proposed else 0
        accepted += stats.accepted[0] if stats.accepted else 0
        scored += 1
    return {"depth1": accepted / proposed if proposed else 0.0, "rounds": proposed,
            "prompts": scored, "tokens_per_prompt": tokens, "temperature": 0.0}


def blas_warning() -> str | None:
    """What the reference BLAS does to a graft on MLX's CPU backend, said before training
    starts (None otherwise: GPUs do not multiply through it)."""
    if loaded_blas() != "reference" or mx.default_device().type != mx.DeviceType.cpu:
        return None
    return ("warning: MLX is on the reference BLAS bundled with its Linux wheel: a float32 "
            "matmul of M rows costs about M single-row ones, so this graft trains a small "
            "fraction of the steps an optimized BLAS allows (SmolLM2-135M in 25 minutes: 29 "
            "steps and 7.5% held-out acceptance, against ~1,550 steps and 44% with OpenBLAS) "
            f"and its head will likely not speed decoding up. Fix: {fix()}")


def _check(view: BundleView, force: bool) -> None:
    """Refuse what graft cannot start from, and a head it would throw away unasked."""
    if view.kind != "mlx":
        raise ConvertError("load.not_converted", f"{view.root} is not an MLX bundle",
                           "mtpkit convert it first")
    if view.errors:
        first = view.errors[0]
        raise ConvertError(first.code, f"source: {first.message} [{first.location}]",
                           first.hint or "mtpkit doctor shows every finding")
    if view.mtp.tensors and not force:
        raise ConvertError("graft.has_head", f"{view.root} already has an MTP head "
                           f"({len(view.mtp.tensors)} tensors); the grafted one would replace it",
                           "pass --force to replace it, or decode with the head it has")


def graft(bundle: str, out: Path, options: GraftOptions,
          progress: Callable[[Progress], None] = lambda p: None,
          on_plan: Callable[[Plan], None] = lambda p: None) -> GraftResult:
    """Graft a head onto `bundle`'s trunk and write `out`. `on_plan` hears, before training,
    how the budget splits (what scoring and writing will take, from costs measured here)."""
    start = time.perf_counter()
    view = open_bundle(bundle)
    claim_output(out, view.root, options.force)  # before the budget is spent, not after
    _check(view, options.force)
    model, _ = load_model(view.root, lazy=True, trust_remote_code=False)  # never bundle code
    dequantize_for_cpu(model)
    cast_floats(model, mx.float32)
    model.freeze()
    trunk = Trunk(model)
    tokenizer = load_wrapper(view.root, view.tokenizer, bundle)  # never runs bundle code
    fam = view.family
    contract = Contract(fam.hidden_feed, fam.next_hidden, fam.concat_order,
                        fam.zero_first_embedding)
    mx.random.seed(options.seed)
    docs = read_documents(options.corpus)
    train, held = split_documents(docs)
    if not train:
        raise ConvertError("graft.corpus", "the corpus has no training text",
                           "pass --corpus with text files or folders")
    encoded = _encode(train, tokenizer)
    template = safe_template(view)
    special = view.tokenizer.special_tokens()
    frame = chat_frame(template, special, tokenizer)
    prompts = Prompts(encoded, options.seq_len, frame, tokenizer, options.seed)
    weights = _initial_weights(trunk, options.seed)
    vocab_size = trunk.args.vocab_size
    # a head of the final shape (its draft vocabulary from the corpus alone) to time a round
    probe = Runner(trunk, _head(trunk, weights, frequent_tokens(encoded, vocab_size,
                                                                options.draft_vocab), contract),
                   tokenizer, template if frame else None, special)
    raw = held_out_prompts(held, options.eval_prompts, options.seed)
    chats = (held_out_chats(held, max(1, options.eval_prompts // 2), options.seed + 1)
             if probe.template is not None else [])
    probe_ids = max(encoded, key=len)[:PROBE_PROMPT]
    assert probe.head is not None
    costs = measure_decoding(trunk, probe.head, probe_ids)
    write_bytes = (sum(p.stat().st_size for p in view.root.rglob("*") if p.is_file())
                   + sum(v.nbytes for v in weights.values()))
    planned = plan(options.minutes * 60 if options.minutes is not None else math.inf,
                  time.perf_counter() - start, costs, [len(probe.encode(p)) for p in raw],
                  [len(probe.encode(c)) for c in chats], options.eval_tokens, len(probe_ids),
                  write_bytes)
    on_plan(planned)
    train_end = planned.total_s - planned.scoring_s - planned.writing_s  # seconds after start
    after = planned.scoring_s + planned.writing_s
    train_start = time.perf_counter()
    cache, kinds = _rollout_pass(trunk, prompts, set(tokenizer.eos_token_ids), options, start,
                                 train_end, after, costs.step_s, progress)
    vocab = frequent_tokens([*encoded, *np.array(cache.tokens)], vocab_size, options.draft_vocab)
    head = _head(trunk, weights, vocab, contract)
    losses = _train_head(head, cache, vocab, options, start, train_end, after, progress)
    copying = options.copy_weight if attention_of(head.layers[0]) is not None else 0.0
    score_start = time.perf_counter()
    if not losses:
        raise ConvertError("graft.no_steps", "no training step ran", "raise --steps/--minutes")
    cpu = mx.default_device().type == mx.DeviceType.cpu
    if cpu:  # decode as mtpkit.load will
        use_few_rows_linears(trunk.inner)
        use_few_rows_linears(head)
    runner = Runner(trunk, head, tokenizer, probe.template, special)
    progress(Progress(0, None, score_start - start, after, "score", planned.raw + planned.chat))
    deadline = start + train_end + planned.scoring_s - costs.probe_s(len(probe_ids))
    acceptance = measure_acceptance(runner, raw[:planned.raw], options.eval_tokens, deadline)
    if planned.chat and time.perf_counter() < deadline:
        acceptance["chat"] = measure_acceptance(runner, chats[:planned.chat], options.eval_tokens,
                                                deadline)
    measured = measure_decoding(trunk, head, probe_ids)
    pooled = [acceptance, *([acceptance["chat"]] if "chat" in acceptance else [])]
    rounds = sum(a["rounds"] for a in pooled)
    kept = sum(a["depth1"] * a["rounds"] for a in pooled) / rounds if rounds else 0.0
    blas, blas_path = in_use()
    record = {
        "corpus": [str(p) for p in options.corpus] if options.corpus else "python-stdlib",
        "documents": {"train": len(train), "held_out": len(held)},
        "steps": len(losses), "tokens": len(losses) * options.batch * options.seq_len,
        "distinct_tokens": int(cache.tokens.shape[0]) * options.seq_len,
        "rollouts": kinds | {"trained_positions": int(mx.sum(cache.mask).item())},
        "seq_len": options.seq_len, "batch": options.batch, "seed": options.seed,
        "learning_rate": options.learning_rate,
        "train_minutes": (score_start - train_start) / 60,
        "draft_vocab": len(vocab), "copy_weight": copying,
        "final_loss": float(np.mean(losses[-10:])), "held_out_acceptance": acceptance,
        "blas": {"kind": blas, "path": blas_path},
        "budget": planned.to_dict() | {"training_s": score_start - train_start,
                                      "scoring_s": time.perf_counter() - score_start},
        "decode_costs": measured.to_dict(),
        "expected_speedup": verdict(kept, measured, blas if cpu else None),
    }
    return _write(view, out, head, record, options)


def _head(trunk: Trunk, weights: dict[str, mx.array], vocab: np.ndarray,
          contract: Contract) -> MTPHead:
    """The head over the initial weights, drafting over `vocab` where it is not the whole one."""
    if len(vocab) < trunk.args.vocab_size:
        weights = weights | {"mtp.draft_vocab": mx.array(vocab)}
    return MTPHead(trunk, weights, contract, "full_attention", {})


def _write(view: BundleView, out: Path, head: MTPHead, record: dict[str, Any],
           options: GraftOptions) -> GraftResult:
    arrays = {canonical_name(k): v for k, v in tree_flatten(head.parameters())}
    sidecar, mtp_record = encode_sidecar(arrays, options.sidecar)
    skip = {SIDECAR_FILE, MANIFEST_FILE, "config.json", "README.md"}
    with staged_output(out, view.root, force=options.force) as stage:
        for path in sorted(view.root.rglob("*")):
            rel = path.relative_to(view.root)
            if path.is_file() and rel.as_posix() not in skip and not rel.name.startswith("."):
                (stage / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, stage / rel)
        hashes = {SIDECAR_FILE: write_safetensors(stage / SIDECAR_FILE, sidecar, sorted(sidecar))}
        write_config(stage, view.config.raw, mtp_record, 1)
        source = {"kind": "mlx", "path": str(view.root)}
        manifest = finish_bundle(stage, out.name, source, str(view.root), options.command,
                                 view.template.source and f"source {view.template.source}",
                                 hashes, {"graft": record})
    return GraftResult(out, manifest, record)
