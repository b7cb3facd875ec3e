"""MTP mechanics on a GPU: verify cost curves before/after, the compile per round, and an oracle.

A MECHANICS benchmark: the trunks have random weights (Llama-3-8B shapes, 4-bit g64 and bf16),
and the drafter is an oracle that proposes the trunk's own greedy continuation, right with
per-position acceptance 73/48/32% (a published figure for a 27B model at depth 3) and costs
nothing. It measures what the decoder's machinery delivers on this machine, not what any real
head accepts (bench_decode.py measures a real grafted head).

1. c(T), T = 1..16, for each trunk "before" (MLX's ops, mlx-lm's own KV cache), "after"
   (verify kernel, bounded attention shapes) and "traced" (also traced once per shape,
   decoder/model/traced.py: a GPU's default): decoder/tuning/costs.py's measure, medians after warm-up.
2. A T=2 verify at a new cache length every pass (what decoding does), before and after: the
   compile per round shows as the median pass time.
3. Oracle decoding on the 4-bit trunk, traced and untraced: plain vs depths 1-3 vs --depth
   auto; measured speedup beside the ideal one from c(T): E[tokens per round] / (c(K + 1) /
   plain step).
4. (--parts breakdown) where a pass's time goes: host build, hand-off, device, per arm.
5. (--parts threads) a generation on a thread of its own against one on the thread that traced.
6. (--parts sampled) the traced oracle at temperature 0 and sampled (--sampling, default
   t=0.6 / top_p 0.95 / top_k 20: code settings), plain and depth 3, arms interleaved: the
   sampled speedup (over sampled plain) beside the greedy one (over greedy plain).
7. (--parts hybrid) the oracle on a Qwen3.5-9B-shaped hybrid 4-bit trunk (GatedDeltaNet layers
   recorded and committed per position), beside the Llama oracle of the same run: the ratio of
   their depth-3 speedups.

    python bench/bench_gpu.py [--smollm2 BUNDLE] [--tokens 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save, summary  # noqa: E402

from mtpkit.verify.run import mean_by_position  # noqa: E402

RATES = (0.73, 0.48, 0.32)
SUCCESSOR: dict[int, object] = {}  # id(model) -> its greedy walk (oracle_ready), for bench_batch


def llama8b(bits: int | None, small: bool = False):
    """A Llama-3-8B-shaped mlx-lm model with random weights (bf16, or quantized g64); small:
    the same architecture scaled down, to check this script on a CPU."""
    from mlx_lm.models.llama import Model, ModelArgs

    scale = 16 if small else 1
    args = ModelArgs(model_type="llama", hidden_size=4096 // scale,
                     num_hidden_layers=32 // scale, intermediate_size=14336 // scale,
                     num_attention_heads=32 // scale, num_key_value_heads=max(1, 8 // scale),
                     rms_norm_eps=1e-5, vocab_size=128256 // scale, rope_theta=500000.0,
                     tie_word_embeddings=False)
    return oracle_ready(Model, args, bits)


def stock(model):
    """A second model over the same arrays whose quantized layers are mlx-lm's own classes.
    Our verify-kernel twins (decoder/model/rows.py) replace a trunk's layers in place, so
    mlx-lm's arms given the model our trunk wraps would run our kernel (and our one-matrix
    batch products), not stock mlx-lm; they run this copy."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mtpkit.decoder.cache.recording import unwrapped_name

    def own(path: str) -> str:  # a path without our trunk's recorders and taps (a hybrid's)
        return unwrapped_name(path + ".")[:-1]

    quantized = {own(path): m for path, m in model.named_modules() if hasattr(m, "scales")}
    copy = type(model)(model.args)  # (its random weights stay lazy: replaced before any eval)
    nn.quantize(copy, class_predicate=lambda path, _m: (
        {"group_size": quantized[path].group_size, "bits": quantized[path].bits,
         "mode": quantized[path].mode} if path in quantized else False))
    copy.load_weights([(own(k), v) for k, v in tree_flatten(model.parameters())])
    return copy


def qwen35_9b(bits: int | None, small: bool = False):
    """A Qwen3.5-9B-shaped hybrid (three GatedDeltaNet layers to one attention layer, 248,320
    tokens) with random weights, as llama8b; the family that ships MTP heads."""
    from mlx_lm.models.qwen3_5 import Model, ModelArgs

    scale = 16 if small else 1
    text = {"model_type": "qwen3_5_text", "hidden_size": 4096 // scale,
            "num_hidden_layers": 8 if small else 32, "intermediate_size": 12288 // scale,
            "num_attention_heads": max(1, 16 // scale), "num_key_value_heads": max(1, 4 // scale),
            "head_dim": 256 // min(scale, 4), "linear_num_key_heads": 16 // min(scale, 4),
            "linear_num_value_heads": 32 // min(scale, 4), "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "full_attention_interval": 4,
            "vocab_size": 248320 // scale, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    return oracle_ready(Model, ModelArgs(model_type="qwen3_5", text_config=text), bits)


# What writes into the residual stream, in every family bench_families.py builds: attention
# outputs (o_proj, Bailing's attention.dense), recurrent mixers' out_proj, MLPs' and experts'
# down_proj (Nemotron-H's non-gated experts: fc2).
RESIDUAL_WRITERS = ("o_proj", "out_proj", "down_proj", "attention.dense", "fc2")


def quantizable(model):
    """Which modules oracle_ready quantizes (a class_predicate): those whose input width is a
    multiple of 64 and that mlx-lm's own quant_predicate (where the model has one) asks for no
    other quantization; what it keeps out, or asks at 8 bits as MoE routers, stays bf16: one
    quantized layout, one set of CUDA kernels compiled."""
    own = getattr(model, "quant_predicate", None)

    def predicate(path: str, module) -> bool:
        weight = getattr(module, "weight", None)
        fits = hasattr(module, "to_quantized") and weight is not None and weight.shape[-1] % 64 == 0
        return fits and (own is None or own(path, module) is True)

    return predicate


def oracle_ready(cls, args, bits: int | None):
    """cls(args) with random weights whose greedy continuation rounding cannot flip (random
    logits over 100K+ tokens tie within bf16 ulps): layers write little into the residual
    stream, and the output row of token j is the embedding of the token whose successor j is,
    so the argmax is that successor by a wide margin (a walk through a random permutation: no
    repetition loops). bf16, or quantized g64 with `bits` (the modules `quantizable` picks).
    Any mlx-lm family with an lm_head of its own: the inner model and embedding where
    decoder/model/trunk.py finds them (bench_families.py)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mtpkit.decoder.model.trunk import parts

    mx.random.seed(0)
    model = cls(args)
    model.set_dtype(mx.bfloat16)
    text, inner_name, embed_name = parts(model)
    inner = getattr(text, inner_name)
    embedding = getattr(inner, embed_name)
    for layer in inner.layers:
        for name, module in tree_flatten(layer.leaf_modules(), is_leaf=nn.Module.is_module):
            if name.endswith(RESIDUAL_WRITERS):
                module.weight = module.weight * 0.01
    vocab = embedding.weight.shape[0]
    successor = mx.random.permutation(vocab)
    SUCCESSOR[id(model)] = successor
    text.lm_head.weight = embedding.weight[mx.argsort(successor)]
    for layer in [*inner.layers, model]:  # materialize layer by layer, module by module:
        if bits is not None and layer is not model:  # bounded peak (an MoE layer's experts)
            nn.quantize(layer, group_size=64, bits=bits, class_predicate=quantizable(model))
        for _, module in tree_flatten(layer.leaf_modules(), is_leaf=nn.Module.is_module):
            mx.eval(module.parameters())
    if bits is not None:
        nn.quantize(text, group_size=64, bits=bits, class_predicate=lambda p, m: p in (
            "lm_head", f"{inner_name}.{embed_name}"))
    mx.eval(model.parameters())
    return model


class Oracle:
    """Stands in for an MTP head: proposes ref[position] (the trunk's own greedy token) with the
    conditional chance that gives unconditional acceptance RATES per draft position (and never
    past the last), else a wrong token; costs one tiny array per draft."""

    blocks = 1

    def __init__(self, ref: list[int], vocab: int, rates: tuple[float, ...], seed: int) -> None:
        import numpy as np

        self.ref, self.vocab = ref, vocab
        self.conditional = [rates[0]] + [rates[i] / rates[i - 1] for i in range(1, len(rates))]
        self.rng = np.random.default_rng(seed)
        self.position, self.right = 0, True

    def make_cache(self, bounded: bool = False):
        from mlx_lm.models.cache import KVCache

        return [KVCache()]  # its offset counts committed tokens (trimmed like a real head's)

    def __call__(self, hidden, tokens, cache, step, last_only=False):
        import mlx.core as mx

        if step == 0:  # owed pairs end at the committed token at index `offset`
            cache[0].offset += tokens.shape[1]
            self.position, self.right = cache[0].offset + 1, True
        else:
            cache[0].offset += 1
            self.position += 1
        chance = self.conditional[step] if step < len(self.conditional) else 0.0
        self.right = self.right and self.rng.random() < chance
        want = self.ref[self.position] if self.position < len(self.ref) else 0
        token = want if self.right else (want + 1) % self.vocab
        return mx.zeros((1, 1, self.vocab)).at[..., token].add(1e9), hidden[:, -1:]


def curves(runner, label: str) -> dict:
    """c(T) before (MLX's ops, mlx-lm's caches: call with the runner's stock linears), with the
    verify kernel and bounded shapes ("after"), and with the pass traced too ("traced", what a
    GPU runs by default)."""
    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.tuning.costs import measure

    text = runner.trunk.text
    runner.trunk.use_traced(False)
    before = measure(runner, bounded=False)
    before_moving = moving_verify(runner, bounded=False)
    prefill_before = prefill_ms(runner, bounded=False)
    use_kernel_linears(text)
    unbounded = measure(runner, bounded=False)
    after = measure(runner, bounded=True)
    after_moving = moving_verify(runner, bounded=True)
    runner.trunk.use_traced()
    traced = measure(runner, bounded=True)
    out = {"before": before.to_dict(), "after": after.to_dict(), "traced": traced.to_dict(),
           "kernel_unbounded": unbounded.to_dict(),
           "moving_t2_ms": {"before": before_moving, "after": after_moving,
                            "traced": moving_verify(runner, bounded=True),
                            "kernel_unbounded": moving_verify(runner, bounded=False)},
           "prefill_2048_ms": {"before": prefill_before,
                               "after": prefill_ms(runner, bounded=True)}}
    for name in ("before", "kernel_unbounded", "after", "traced"):
        print(label, f"c(T)/c(1) {name:16}", [round(r, 2) for r in out[name]["ratios"]],
              "c(1) ms", round(1000 * out[name]["verify"][0], 2), "plain ms",
              round(1000 * out[name]["plain"], 2), "moving T=2 ms",
              round(out["moving_t2_ms"][name]["median"], 2), flush=True)
    print(label, "prefill 2048 ms", out["prefill_2048_ms"], flush=True)
    return out


def prefill_ms(runner, bounded: bool, n: int = 2048) -> float:
    """Median ms to prefill a fresh n-token prompt (a new cache each time)."""
    from mtpkit.decoder.rounds.session import Session
    from mtpkit.decoder.sampling import SamplingParams

    vocab = runner.trunk.args.vocab_size
    times = []
    for run in range(4):
        session = Session(runner.trunk, None, SamplingParams(), 0, bounded=bounded)
        start = time.perf_counter()
        session.start([(17 * i + run) % vocab for i in range(n)])
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times[1:])


def moving_verify(runner, bounded: bool, passes: int = 24) -> dict:
    """Median ms of T=2 verify passes, each at a cache one token longer than the last (as
    decoding goes), after a 300-token prompt."""
    import mlx.core as mx

    from mtpkit.decoder.rounds.session import Session
    from mtpkit.decoder.sampling import SamplingParams, greedy

    session = Session(runner.trunk, None, SamplingParams(), 0, bounded=bounded)
    vocab = runner.trunk.args.vocab_size
    session.start([(11 * i + 5) % vocab for i in range(300)])
    times = []
    for i in range(passes):
        start = time.perf_counter()
        _, logits = runner.trunk(mx.array([[i % vocab, (i + 1) % vocab]]), session.cache)
        mx.eval(greedy(logits[0]))
        times.append(1000 * (time.perf_counter() - start))
        for c in session.cache:
            c.trim(1)  # keep one: the next pass sees a new length
    return summary(times)


def smollm2_shaped():
    """A SmolLM2-135M-shaped mlx-lm llama with random bf16 weights (no bundle needed)."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=30,
                     intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     rms_norm_eps=1e-5, vocab_size=49152, rope_theta=100000.0,
                     tie_word_embeddings=True)
    mx.random.seed(0)
    model = Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def breakdown(runner, label: str, arms: list[str], rows=(1, 2, 3, 4, 8), passes: int = 16) -> dict:
    """Where a verify pass's time goes, at a 512-token cache: host graph building (the Python
    forward, nothing evaluated), handing it to the device (async_eval), the synchronous pass
    (build + device + sync, what a round pays today), and the pipelined pass (each queued while
    the last runs: the device's own time when that is the bound). Stock (MLX's ops, mlx-lm's
    cache) and ours (kernel, bounded)."""
    import mlx.core as mx

    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.rounds.session import Session
    from mtpkit.decoder.sampling import SamplingParams, greedy

    vocab = runner.trunk.args.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(512)]
    out: dict = {}
    for arm in arms:
        if arm != "stock":
            use_kernel_linears(runner.trunk.text)
        runner.trunk.use_traced(arm == "traced")
        session = Session(runner.trunk, None, SamplingParams(), 0, bounded=arm != "stock")
        session.start(ids)
        cache = session.cache
        per: dict = {}
        for t in rows:
            tokens = mx.array(ids[:t])[None]
            build, encode, sync = [], [], []
            for i in range(passes + 2):
                start = time.perf_counter()
                _, logits = runner.trunk(tokens, cache)
                y = greedy(logits[0])
                built = time.perf_counter()
                mx.async_eval(y)  # returns once the work is handed to the device
                encoded = time.perf_counter()
                mx.eval(y)
                done = time.perf_counter()
                for c in cache:
                    c.trim(t)
                if i >= 2:  # the first passes of a shape may compile
                    build.append(1000 * (built - start))
                    encode.append(1000 * (encoded - built))
                    sync.append(1000 * (done - start))
            start = time.perf_counter()
            for _ in range(passes):
                _, logits = runner.trunk(tokens, cache)
                y = greedy(logits[0])
                mx.async_eval(y)
                for c in cache:
                    c.trim(t)
            mx.eval(y)
            piped = 1000 * (time.perf_counter() - start) / passes
            per[t] = {"build_ms": statistics.median(build),
                      "encode_ms": statistics.median(encode),
                      "sync_ms": statistics.median(sync), "pipelined_ms": piped}
            print(label, arm, f"T={t}", {k: round(v, 2) for k, v in per[t].items()}, flush=True)
        out[arm] = per
    return out


def with_oracle(runner, tokens: int):
    """(a runner drafting with the Oracle, its prompt, the plain result, its cost curve)."""
    from mtpkit.decoder.runner import Runner
    from mtpkit.decoder.tuning.costs import measure

    vocab = runner.trunk.args.vocab_size
    prompt = [(13 * i + 7) % vocab for i in range(128)]
    plain = runner.generate(prompt, tokens, depth=0)
    oracle = Oracle(prompt + plain.tokens, vocab, RATES, seed=0)
    mtp = Runner(runner.trunk, oracle, None)
    mtp._costs = measure(mtp)
    return mtp, prompt, plain, mtp._costs


def oracle_decoding(runner, tokens: int, runs: int) -> dict:
    """Plain vs oracle MTP (depths 1-3 and auto) on the 4-bit trunk, with the ideal speedups."""
    import numpy as np

    mtp, prompt, plain, curve = with_oracle(runner, tokens)
    oracle = mtp.head
    plain_s = curve.plain
    rows: dict = {"curve": curve.to_dict()}
    print("c(T) ms", [round(1000 * c, 2) for c in curve.verify[:8]], "plain ms",
          round(1000 * plain_s, 2), "draft ms", round(1000 * curve.draft, 3), flush=True)
    depths = (0, 1, 2, 3, "auto")
    for depth in depths:
        mtp.generate(prompt, tokens, depth=depth)  # warm-up: every cache shape of a run
    runs_of: dict = {depth: [] for depth in depths}
    for run in range(runs):  # arms interleaved: the machine's drift hits each alike
        for depth in depths:
            oracle.rng = np.random.default_rng(run)
            runs_of[depth].append(mtp.generate(prompt, tokens, depth=depth))
    for depth in depths:
        results = runs_of[depth]
        tps = [r.stats.decode_tps for r in results]
        accept = [r.stats.acceptance_by_depth for r in results]
        row = {"decode_tps": summary(tps),
               "greedy_tokens_identical": all(r.tokens == plain.tokens for r in results)}
        if depth != 0:  # per run, over the plain run just before it
            row["speedup_paired"] = statistics.median(
                t / r0.stats.decode_tps for t, r0 in zip(tps, runs_of[0], strict=True))
        if depth not in (0, "auto"):
            a = mean_by_position(accept)
            row["acceptance_by_depth"] = a
            fixed = depth * curve.draft + curve.verify[depth]  # a forced depth never pads
            row["ideal_speedup"] = (1 + sum(RATES[:depth])) / (fixed / plain_s)
            row["ideal_speedup_measured_acceptance"] = (1 + sum(a)) / (fixed / plain_s)
        if depth == "auto":
            row["depths"] = results[-1].stats.depths  # of the last run
            row["cost_scale"] = [r.stats.cost_scale for r in results]  # paid / predicted
            predicted = [r.stats.predicted_speedup for r in results
                         if r.stats.predicted_speedup is not None]
            row["predicted_speedup"] = statistics.median(predicted) if predicted else None
            row["ideal_best"] = max((1 + sum(RATES[:d])) / (curve.round_cost(d) / plain_s)
                                    for d in range(1, 4))
        rows[str(depth)] = row
    base = rows["0"]["decode_tps"]["median"]
    for key, row in rows.items():
        if key not in ("curve", "0"):
            row["speedup"] = row["decode_tps"]["median"] / base
            ideal = row.get("ideal_speedup") or row.get("ideal_best")
            row["measured_over_ideal"] = row["speedup"] / ideal if ideal else None
            print("oracle depth", key, f"{row['speedup']:.2f}x, paired "
                  f"{row['speedup_paired']:.2f}x (ideal {ideal:.2f}x)",
                  row.get("acceptance_by_depth") or row.get("depths"), row.get("cost_scale", ""),
                  flush=True)
    return rows


def sampled_decoding(runner, tokens: int, runs: int, sampling: dict, depth: int = 3) -> dict:
    """Greedy and sampled arms, plain and at `depth`, interleaved run by run on the oracle:
    each mode's speedup over its own plain decoding, and their ratio (issue 32's target: the
    sampled speedup at least 0.95x the greedy one)."""
    import numpy as np

    mtp, prompt, _, _ = with_oracle(runner, tokens)
    modes = {"greedy": {}, "sampled": sampling}
    arms = [(mode, d) for mode in modes for d in (0, depth)]
    for mode, d in arms:  # warm-up
        mtp.generate(prompt, tokens, depth=d, seed=0, **modes[mode])
    tps: dict = {arm: [] for arm in arms}
    accept: dict = {arm: [] for arm in arms}
    for run in range(runs):
        for mode, d in arms:
            mtp.head.rng = np.random.default_rng(run)
            result = mtp.generate(prompt, tokens, depth=d, seed=run, **modes[mode])
            tps[(mode, d)].append(result.stats.decode_tps)
            accept[(mode, d)].append(result.stats.acceptance_by_depth)
    rows: dict = {"sampling": sampling, "depth": depth}
    for mode in modes:
        plain, mtp_tps = tps[(mode, 0)], tps[(mode, depth)]
        rows[mode] = {"plain_tps": summary(plain), "mtp_tps": summary(mtp_tps),
                      "speedup": statistics.median(mtp_tps) / statistics.median(plain),
                      "speedup_paired": statistics.median(
                          m / p for m, p in zip(mtp_tps, plain, strict=True)),
                      "acceptance_by_depth": mean_by_position(accept[(mode, depth)])}
        print("sampled part", mode, f"plain {statistics.median(plain):.1f} tok/s, depth "
              f"{depth} {statistics.median(mtp_tps):.1f} tok/s, {rows[mode]['speedup']:.2f}x",
              rows[mode]["acceptance_by_depth"], flush=True)
    rows["sampled_over_greedy_speedup"] = rows["sampled"]["speedup"] / rows["greedy"]["speedup"]
    print(f"sampled speedup / greedy speedup: {rows['sampled_over_greedy_speedup']:.2f}",
          flush=True)
    return rows


def fresh_threads(runner, tokens: int, runs: int) -> dict:
    """A generation on the thread that traced its passes against one on a thread of its own,
    as `mtpkit serve` ran each request (on its connection's thread) before the worker
    (serve/worker.py): MLX keeps compiled functions per thread. Wall time and decode tok/s,
    plain and oracle depth 3, arms interleaved."""
    import threading

    mtp, prompt, _, _ = with_oracle(runner, tokens)

    def timed(depth: int) -> tuple[float, float]:
        start = time.perf_counter()
        result = mtp.generate(prompt, tokens, depth=depth)
        return time.perf_counter() - start, result.stats.decode_tps

    def on_a_new_thread(depth: int) -> tuple[float, float]:
        box: list[tuple[float, float]] = []
        thread = threading.Thread(target=lambda: box.append(timed(depth)))
        thread.start()
        thread.join()
        return box[0]

    rows: dict = {}
    for depth in (0, 3):
        timed(depth)  # warm-up: this thread traces every shape of a run
        same, fresh = [], []
        for _ in range(runs):
            same.append(timed(depth))
            fresh.append(on_a_new_thread(depth))
        rows[str(depth)] = {
            "same_thread_s": summary([s for s, _ in same]),
            "new_thread_s": summary([s for s, _ in fresh]),
            "same_thread_tps": summary([t for _, t in same]),
            "new_thread_tps": summary([t for _, t in fresh]),
            "new_over_same_time": statistics.median(f / s for (f, _), (s, _) in
                                                    zip(fresh, same, strict=True))}
        print("threads depth", depth, {k: v for k, v in rows[str(depth)].items()
                                       if k.endswith("_s") or k == "new_over_same_time"},
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", type=Path, help="a SmolLM2 bundle for its c(T) (optional)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--parts", default="q4,bf16,smollm2,oracle")
    ap.add_argument("--tag", default="gpu-mechanics")
    ap.add_argument("--small", action="store_true", help="scaled-down trunks (a CPU smoke run)")
    ap.add_argument("--arm", help="measure one configuration of the 4-bit trunk (kernel on) "
                    "under this name: c(T), a moving T=2 verify, prefill; oracle if in --parts")
    ap.add_argument("--bounded", choices=["0", "1"], default="1")
    ap.add_argument("--arms", default="stock,ours,traced",
                    help="breakdown arms: stock (MLX's ops), ours (kernel, bounded), traced")
    ap.add_argument("--sampling", default="0.6,0.95,20",
                    help="temperature,top_p,top_k of the sampled part")
    ap.add_argument("--oracle-arms", default="traced,untraced",
                    help="the oracle parts' arms: traced and/or untraced verify passes")
    ap.add_argument("--traced", choices=["0", "1"], default="1",
                    help="verify passes traced once per shape (decoder/model/traced.py)")
    args = ap.parse_args()

    import mlx.core as mx

    import mtpkit
    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.runner import Runner

    if args.arm:  # one configuration, in its own process (MLX reads its env vars once)
        runner = Runner(Trunk(llama8b(4, args.small)), None, None)
        use_kernel_linears(runner.trunk.text)
        runner.trunk.use_traced(args.traced == "1")
        from mtpkit.decoder.tuning.costs import measure

        bounded = args.bounded == "1"
        curve = measure(runner, bounded=bounded, repeats=15)
        row = {"curve": curve.to_dict(), "moving_t2_ms": moving_verify(runner, bounded),
               "prefill_2048_ms": prefill_ms(runner, bounded), "bounded": bounded,
               "traced": args.traced == "1",
               "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")}}
        print(args.arm, [round(1000 * c, 2) for c in curve.verify[:8]], "plain ms",
              round(1000 * curve.plain, 2), "moving", round(row["moving_t2_ms"]["median"], 2),
              "prefill", round(row["prefill_2048_ms"], 1), flush=True)
        if "oracle" in args.parts:
            row["oracle"] = oracle_decoding(runner, args.tokens, args.runs)
        print(f"saved {save(f'gpu-arm-{args.arm}', row)}")
        return
    parts = set(args.parts.split(","))
    out: dict = {"rates": RATES, "tokens": args.tokens, "runs": args.runs,
                 "device": mx.device_info() if hasattr(mx, "device_info") else {}}
    if parts & {"q4", "oracle", "threads", "sampled", "hybrid"}:
        runner = Runner(Trunk(llama8b(4, args.small)), None, None)
        if "q4" in parts:
            out["llama8b_4bit"] = curves(runner, "8B 4-bit")
        use_kernel_linears(runner.trunk.text)  # (no-op after curves)
        if parts & {"oracle", "hybrid"}:
            out["oracle_8b_4bit"] = {}
            for arm in args.oracle_arms.split(","):  # traced: what a GPU runs by default
                runner.trunk.use_traced(arm == "traced")
                print("oracle arm", arm, flush=True)
                out["oracle_8b_4bit"][arm] = oracle_decoding(runner, args.tokens, args.runs)
        if "sampled" in parts:
            runner.trunk.use_traced()
            t, top_p, top_k = args.sampling.split(",")
            out["sampled_8b_4bit"] = sampled_decoding(
                runner, args.tokens, args.runs,
                {"temperature": float(t), "top_p": float(top_p), "top_k": int(top_k)})
        if "threads" in parts:
            runner.trunk.use_traced()
            out["threads_8b_4bit"] = fresh_threads(runner, args.tokens, args.runs)
        del runner
        mx.clear_cache()
    if "hybrid" in parts:  # issue 32's target: a hybrid's depth-3 speedup over the Llama's
        runner = Runner(Trunk(qwen35_9b(4, args.small)), None, None)
        use_kernel_linears(runner.trunk.text)
        out["oracle_qwen35_9b_4bit"] = {}
        for arm in args.oracle_arms.split(","):
            runner.trunk.use_traced(arm == "traced")
            print("hybrid oracle arm", arm, flush=True)  # (its c(T): the row's "curve")
            out["oracle_qwen35_9b_4bit"][arm] = oracle_decoding(runner, args.tokens, args.runs)
        del runner
        mx.clear_cache()
        for arm in out["oracle_qwen35_9b_4bit"]:
            ratio = (out["oracle_qwen35_9b_4bit"][arm]["3"]["speedup"]
                     / out["oracle_8b_4bit"][arm]["3"]["speedup"])
            out.setdefault("hybrid_over_llama_depth3", {})[arm] = ratio
            print(f"hybrid depth-3 speedup / Llama's ({arm}): {ratio:.2f}", flush=True)
    if "bf16" in parts:
        runner = Runner(Trunk(llama8b(None, args.small)), None, None)
        out["llama8b_bf16"] = curves(runner, "8B bf16")
        del runner
        mx.clear_cache()
    if "breakdown" in parts:
        arms = args.arms.split(",")
        out["breakdown"] = {"llama8b_4bit": breakdown(Runner(Trunk(llama8b(4, args.small)), None,
                                                             None), "8B 4-bit", arms)}
        mx.clear_cache()
        out["breakdown"]["smollm2_shaped_bf16"] = breakdown(
            Runner(Trunk(smollm2_shaped()), None, None), "SmolLM2-shaped bf16", arms)
    if "smollm2" in parts and args.smollm2:
        out["smollm2"] = curves(mtpkit.load(args.smollm2), "SmolLM2")
    out["peak_memory_gb"] = mx.get_peak_memory() / 2**30
    print(f"saved {save(args.tag, out)}")


if __name__ == "__main__":
    main()
