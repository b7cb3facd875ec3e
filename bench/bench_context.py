"""The context sweep (issue 49): what MTP and plain decoding pay as the prompt grows.

For each context L and each arm, one whole generation (prefill of L tokens, then `--tokens`),
arms interleaved run by run (each run starting one arm later) after a warm-up of each: TTFT,
decode tok/s over the steady window (the first `--drop` tokens dropped), peak memory (reset per
arm), acceptance per draft position, and per context the verify cost curve c(T) timed at L, so
each depth's ideal speedup, E[tokens per round] / (c(K + 1) / plain step), comes from the
measured acceptance and the measured curve at that context (bench_gpu.py's formula; the drafters
here cost nothing).

Trunks (`--trunk`):
- llama8b, qwen35: bench_gpu.py's random-weight 4-bit trunks (Llama-3-8B-shaped; the
  Qwen3.5-9B-shaped hybrid) with its oracle drafter at 73/48/32%: a mechanics benchmark for a
  GPU (`--small` scales them down to check this script on a CPU).
- smollm2: a real bundle (`--bundle`, e.g. out/SmolLM2-135M-mlx) rewriting difflib.py with
  context drafts (`--draft lookup`): the prompt is the file's first L tokens, then its first
  lines again under an "(after)" header, so the same rewrite is asked at every window.

Arms (`--arms`): mlx_lm (mlx-lm's `generate_step`, the same prefill_step_size), plain (ours,
depth 0), d1 / d2 / d3 (forced depth), auto (`--depth auto`, the cost curve measured at
bench_gpu's default context), and any of them with a quantized KV cache as `ARM:kvN` (e.g.
`plain:kv4`, `d3:kv8`, `mlx_lm:kv4`: the runner's `quantize_kv`, from `--kv-start` on, 0 by
default; ours only where the decoder has it, else the arm is skipped and said). Ratios per
context: each arm over mlx-lm and over our plain with the same KV cache (medians, and per run
where paired), TTFT and peak memory over mlx-lm's, and each depth's speedup over its speedup at
the first context. Greedy tokens are checked equal across arms with the same KV cache. auto's
rows also keep, per run, the depths it chose, the cost scales it priced by and its rounds'
timeline (`rounds`: when each ended, tokens by then, depth, drafts kept).

Progress and an ETA go to stderr. JSON: `--out DIR` / context-<trunk>.json.

    python bench/bench_context.py --trunk llama8b --contexts 1024,16384,65536 --out $OUT
    .venv/bin/python bench/bench_context.py --trunk smollm2 --bundle out/SmolLM2-135M-mlx \\
        --dtype float32 --draft lookup --contexts 1536,7680 --arms mlx_lm,plain,d3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import _timed, steady_tps  # noqa: E402
from bench_gpu import RATES, SUCCESSOR, Oracle, llama8b, qwen35_9b, stock  # noqa: E402
from common import RESULTS, summary  # noqa: E402

from mtpkit.verify.record import machine  # noqa: E402
from mtpkit.verify.run import mean_by_position  # noqa: E402

PREFILL_STEP = 2048  # mlx-lm's default prefill_step_size, and the decoder's (session.py)
KV_GROUP = 64
ROWS = (1, 2, 3, 4)  # c(T) timed at each context: depths up to 3


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


class Arm:
    """One arm: a mode (mlx_lm, plain, dK, auto), an optional KV quantization (`:kvN`) and,
    for ours, `:b1`: the request decoded as a batch of one (the scheduler with no solo path:
    Batch's pipelined plain steps and speculative rounds) rather than by Runner.stream."""

    def __init__(self, spec: str) -> None:
        mode, *tags = spec.split(":")
        if mode not in ("mlx_lm", "plain", "auto") and not (mode[:1] == "d" and mode[1:].isdigit()):
            raise SystemExit(f"unknown arm {spec!r}: mlx_lm, plain, dK, auto, optionally :kvN, :b1")
        kv = [t for t in tags if t != "b1"]
        if len(kv) > 1 or kv and not (kv[0].startswith("kv") and kv[0][2:] in ("2", "3", "4", "6", "8")):
            raise SystemExit(f"unknown tag in {spec!r}: kv4, kv8, ..., b1")
        self.name, self.mode = spec, mode
        self.kv_bits = int(kv[0][2:]) if kv else None
        self.one_row = "b1" in tags
        if self.one_row and (mode == "mlx_lm" or self.kv_bits):
            raise SystemExit(f"{spec!r}: :b1 is for our arms with a float cache")

    @property
    def depth(self) -> int | str | None:
        """Our decoder's depth argument (None: mlx-lm's arm)."""
        named: dict[str, int | str | None] = {"plain": 0, "auto": "auto", "mlx_lm": None}
        return named[self.mode] if self.mode in named else int(self.mode[1:])

    @property
    def baseline(self) -> str:
        """The plain arm with the same KV cache, which this arm's speedup is over."""
        return "plain" + (f":kv{self.kv_bits}" if self.kv_bits else "")


def kv_supported() -> bool:
    """Whether our decoder takes mlx-lm's KV quantization options (issue 49: a runner's
    `quantize_kv`, what `load(kv_bits=...)` and --kv-bits call)."""
    from mtpkit.decoder.runner import Runner

    return hasattr(Runner, "quantize_kv")


# -- trunks and prompts --------------------------------------------------------------------

class Setup:
    """A trunk to sweep: the runner, how a context's prompt is made, the drafter's reset per run
    and the reference tokens greedy decoding must give (None: the arms are compared instead)."""

    def __init__(self, runner: Any, prompt: Callable[[int], list[int]], draft: str,
                 oracle: Any = None, successor: Any = None) -> None:
        self.runner, self.prompt, self.draft = runner, prompt, draft
        self.oracle, self.successor = oracle, successor
        self.prefix: Any = None  # --prefix: the prompt's state, prefilled once per context
        self.stock = stock(runner.trunk.model)  # mlx-lm's arms: its own layers, not our twins

    def walk(self, ids: list[int], n: int) -> list[int]:
        """The oracle trunk's greedy continuation: a walk through its successor permutation
        (bench_gpu.oracle_ready), known without running it."""
        out, last = [], ids[-1]
        for _ in range(n):
            last = int(self.successor[last].item())
            out.append(last)
        return out

    def ready(self, ids: list[int], tokens: int, run: int) -> list[int] | None:
        """Point the oracle at this prompt's continuation, its draws seeded by `run`; the
        expected greedy tokens (oracle trunks) or None."""
        if self.oracle is None:
            return None
        walk = self.walk(ids, tokens + 8)
        if isinstance(self.oracle, Oracle):
            import numpy as np

            self.oracle.ref = ids + walk
            self.oracle.rng = np.random.default_rng(run)
        else:  # bench_batch's BatchOracle: it walks the successors itself
            import mlx.core as mx

            self.oracle.key = mx.random.key(run)
        return walk[:tokens]


def oracle_setup(trunk: str, small: bool, traced: bool, rows: bool = False) -> Setup:
    """rows: bench_batch's BatchOracle (drafts on the device, any number of rows: what `:b1`
    arms need) for every arm, rather than bench_gpu's host-side walk."""
    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.runner import Runner
    from mtpkit.decoder.tuning.costs import measure

    model = (llama8b if trunk == "llama8b" else qwen35_9b)(4, small)
    base = Runner(Trunk(model), None, None)
    use_kernel_linears(base.trunk.text)
    base.trunk.use_traced(traced)
    vocab = base.trunk.args.vocab_size
    if rows:
        from bench_batch import BatchOracle

        runner = Runner(base.trunk, BatchOracle(SUCCESSOR[id(model)], RATES, seed=0), None)
    else:
        oracle = Oracle([], vocab, RATES, seed=0)
        runner = Runner(base.trunk, oracle, None)
        oracle.ref = list(range(vocab))  # (the curve's own passes: any drafts will do)
    log("measuring the cost curve --depth auto decides by (bench_gpu's context)")
    runner._costs = measure(runner)

    def prompt(length: int) -> list[int]:
        return [(13 * i + 7) % vocab for i in range(length)]

    return Setup(runner, prompt, "head", runner.head, SUCCESSOR[id(model)])


def rewrite_prompt(tokenizer: Any, length: int, source: str, name: str) -> list[int]:
    """`source`'s first lines under a "(before)" header, then its first lines again under an
    "(after)" header (what an agent rewriting a file sends): `length` tokens in all, give or
    take a line, the file cut at a line boundary."""
    tail = f"\n\n# {name} (after)\n" + source[:source.find("\n", 300) + 1]
    head = f"# {name} (before)\n"
    budget = length - len(tokenizer.encode(head + tail))
    body = tokenizer.encode(source)[:max(budget, 16)]
    text = tokenizer.decode(body)
    text = text[:text.rfind("\n") + 1] if "\n" in text else text
    return list(tokenizer.encode(head + text.rstrip() + tail))


def smollm2_setup(bundle: Path, dtype: str | None, draft: str) -> Setup:
    import difflib

    import mtpkit

    runner = mtpkit.load(bundle, dtype=dtype)
    source = Path(difflib.__file__).read_text()
    return Setup(runner, lambda n: rewrite_prompt(runner.tokenizer, n, source, "difflib.py"),
                 draft)


# -- one generation per arm ----------------------------------------------------------------

def run_mlx_lm(model: Any, ids: list[int], tokens: int, drop: int, kv_bits: int | None,
               kv_start: int, sampling: dict[str, Any], seed: int) -> dict[str, Any]:
    """mlx-lm's generate_step (prefill_step_size as ours; greedy, or mlx-lm's own sampler
    with `sampling` seeded by `seed`), timed per token."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    kv = {"kv_bits": kv_bits, "kv_group_size": KV_GROUP, "quantized_kv_start": kv_start} \
        if kv_bits else {}
    if sampling:
        mx.random.seed(seed)
        kv["sampler"] = make_sampler(sampling["temperature"], top_p=sampling["top_p"],
                                     top_k=sampling["top_k"])
    mx.clear_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    out, times = [], []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=tokens,
                                  prefill_step_size=PREFILL_STEP, **kv):
        times.append(time.perf_counter())
        out.append(int(token))
    return {"tokens": out, "ttft_s": times[0] - start, "prefill_s": times[0] - start,
            "decode_tps": steady_tps(times, drop), "peak_gb": mx.get_peak_memory() / 1e9}


def run_ours(runner: Any, arm: Arm, ids: list[int], tokens: int, drop: int, draft: str,
             kv_start: int, sampling: dict[str, Any], seed: int, prefix: Any = None
             ) -> dict[str, Any]:
    """Our decoder's generation (Runner.stream resets the peak memory itself); a kv arm's
    quantized cache set on the runner for this generation only; `prefix`: a prefix cache
    holding the prompt's state (no prefill: decode speed only)."""
    import mlx.core as mx

    result = None

    options = dict(depth=arm.depth, prefix=prefix, seed=seed,
                   draft=draft if arm.depth != 0 else None, **sampling)

    def batches() -> Iterator[list[int]]:
        nonlocal result
        for piece in runner.stream(ids, tokens, **options):
            if piece.result is not None:
                result = piece.result
            elif piece.tokens:
                yield piece.tokens

    def one_row() -> Iterator[list[int]]:  # a batch of one: the scheduler without its solo path
        nonlocal result
        scheduler = runner.scheduler(1, solo=False)
        request = runner.prepare(ids, tokens, **options)
        scheduler.add(request)
        for event in scheduler.run():
            if event.tokens:
                yield event.tokens
        result = request

    mx.clear_cache()
    if arm.kv_bits:
        runner.quantize_kv(arm.kv_bits, KV_GROUP, kv_start)
    try:
        out, times = _timed(one_row() if arm.one_row else batches())
    finally:
        if arm.kv_bits:
            runner.quantize_kv(None)
    assert result is not None
    stats = result.stats
    row = {"tokens": out, "ttft_s": stats.ttft_s, "prefill_s": stats.prefill_s,
           "decode_tps": steady_tps(times, drop), "peak_gb": stats.peak_memory_bytes / 1e9,
           "acceptance_by_depth": stats.acceptance_by_depth}
    if arm.mode == "auto":  # what auto chose, the paid/predicted scales it chose by, and
        # when each round ended (where a plain stretch was left and at what cost)
        row["depths"] = {str(d): n for d, n in stats.depths.items()}
        row["cost_scale"] = dict(stats.cost_scale)
        row["rounds"] = stats.rounds()
        row["paid_ms"] = {f"{r}x{w}{' piped' if p else ''}": round(1000 * statistics.median(t), 2)
                          for (r, w, p), t in sorted(runner.table().times.items()) if t}
    return row


def run_arm(setup: Setup, arm: Arm, ids: list[int], args: argparse.Namespace, run: int
            ) -> dict[str, Any]:
    if arm.mode == "mlx_lm":
        return run_mlx_lm(setup.stock, ids, args.tokens, args.drop, arm.kv_bits,
                          args.kv_start, args.sampling, run)
    prefix = setup.prefix if not arm.kv_bits else None
    return run_ours(setup.runner, arm, ids, args.tokens, args.drop, setup.draft, args.kv_start,
                    args.sampling, run, prefix)


def priced(runner: Any, context: int) -> dict[str, Any] | None:
    """The cost curve `--depth auto` prices rounds by at this context (None: not measured yet):
    the contexts it was measured at, c(1..4) and the plain step there, in ms."""
    curve = getattr(runner, "_costs", None)
    if curve is None:
        return None
    at = curve.at(context)
    return {"measured_at": curve.contexts(), "verify_ms": [v * 1e3 for v in at.verify[:4]],
            "plain_ms": at.plain * 1e3}


# -- the cost curve at a context -------------------------------------------------------------

def curve_at(runner: Any, ids: list[int], passes: int) -> dict[str, Any]:
    """c(T) for T in ROWS and a pipelined plain step, at a cache holding `ids` (synchronous
    passes rolled back after each, as decoder/tuning/costs.py times them; medians after two warm-up
    passes); with the prefill's time and peak memory (the first prefill at this context)."""
    import mlx.core as mx

    from mtpkit.decoder.cache.caches import snapshot
    from mtpkit.decoder.cache.state import rewind
    from mtpkit.decoder.rounds.session import Session
    from mtpkit.decoder.sampling import SamplingParams, greedy

    mx.clear_cache()
    mx.reset_peak_memory()
    session = Session(runner.trunk, None, SamplingParams(), 0)
    start = time.perf_counter()
    session.start(ids)
    prefill = {"seconds": time.perf_counter() - start, "peak_gb": mx.get_peak_memory() / 1e9}
    cache = session.cache

    def timed(run: Callable[[], None]) -> float:
        times = []
        for i in range(passes + 2):
            begin = time.perf_counter()
            run()
            if i >= 2:
                times.append(time.perf_counter() - begin)
        return statistics.median(times)

    def verify(rows: int) -> None:
        saved = snapshot(cache)
        _, logits = runner.trunk(mx.array(ids[:rows])[None], cache)
        mx.eval(greedy(logits[0]))
        rewind(cache, saved, rows, 0)

    def plain(count: int = 8) -> None:
        saved = snapshot(cache)
        for _ in session.plain_steps(count):
            pass
        rewind(cache, saved, count, 0)

    verify_s = {t: timed(lambda t=t: verify(t)) for t in ROWS}
    step = timed(plain) / 8
    return {"verify_ms": {str(t): 1000 * c for t, c in verify_s.items()},
            "ratios": {str(t): verify_s[t] / verify_s[1] for t in ROWS},
            "plain_step_ms": 1000 * step, "prefill": prefill}


# -- the sweep ------------------------------------------------------------------------------

class Eta:
    """Seconds left, from the seconds each unit of work took so far (a generation's work grows
    with its context and its tokens)."""

    def __init__(self, jobs: list[tuple[int, int]]) -> None:
        self.left = sum(self.weight(*j) for j in jobs)
        self.done, self.spent = 0.0, 0.0

    @staticmethod
    def weight(context: int, tokens: int) -> float:
        return context / 1024 + tokens / 16

    def tick(self, context: int, tokens: int, seconds: float) -> str:
        w = self.weight(context, tokens)
        self.left -= w
        self.done += w
        self.spent += seconds
        eta = self.spent / self.done * self.left if self.done else 0.0
        return f"{self.spent:6.0f} s spent, ETA {eta:5.0f} s"


def sweep(setup: Setup, contexts: list[int], arms: list[Arm], args: argparse.Namespace,
          done: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every context in turn: c(T) there, then the arms' runs; `done` is given the results
    after each run of every arm (ratios across contexts filled in at the end)."""
    def warm(context: int) -> bool:
        return args.warmup == "all" or (args.warmup == "first" and context == contexts[0])

    def arms_at(context: int) -> list[Arm]:
        return [a for a in arms if not a.kv_bits or args.kv_contexts is None
                or context in args.kv_contexts]

    eta = Eta([(c, args.tokens) for c in contexts for _ in arms_at(c)
               for _ in range(args.runs + warm(c))] + [(c, 0) for c in contexts if args.curve])
    out: dict[str, Any] = {}
    for context in contexts:
        ids = setup.prompt(context)
        row: dict[str, Any] = {"prompt_tokens": len(ids)}
        if args.curve:
            begin = time.perf_counter()
            row["curve"] = curve_at(setup.runner, ids, args.passes)
            log(f"L={len(ids)} c(T) ms",
                {k: round(v, 2) for k, v in row["curve"]["verify_ms"].items()},
                f"plain step {row['curve']['plain_step_ms']:.2f} ms, prefill "
                f"{row['curve']['prefill']['seconds']:.2f} s |",
                eta.tick(context, 0, time.perf_counter() - begin))
        if args.prefix:  # one untimed prefill; our float arms start from its state
            from mtpkit.decoder.cache.prefix import PrefixCache

            setup.prefix = PrefixCache(1 << 40)
            begin = time.perf_counter()
            setup.runner.generate(ids, 1, depth=0, prefix=setup.prefix)
            log(f"L={len(ids)} prompt state in the prefix cache after "
                f"{time.perf_counter() - begin:.0f} s")
        here = arms_at(context)
        runs: dict[str, list[dict[str, Any]]] = {a.name: [] for a in here}
        for run in range(-1 if warm(context) else 0, args.runs):  # -1: the warm-up
            # each run starts one arm later: an arm's place (after which arm, how late in the
            # process) is no longer the same in every run; pairs stay by run
            turn = max(run, 0) % len(here)
            for arm in here[turn:] + here[:turn]:
                expected = setup.ready(ids, args.tokens, max(run, 0))
                begin = time.perf_counter()
                got = run_arm(setup, arm, ids, args, max(run, 0))
                seconds = time.perf_counter() - begin
                got["greedy_expected"] = None if expected is None or args.sampling \
                    else got["tokens"] == expected
                if run >= 0:
                    runs[arm.name].append(got)
                log(f"L={len(ids)} {'warm-up' if run < 0 else f'run {run + 1}/{args.runs}'} "
                    f"{arm.name:10} ttft {got['ttft_s']:6.2f} s  {got['decode_tps']:7.1f} tok/s  "
                    f"peak {got['peak_gb']:6.2f} GB", got.get("acceptance_by_depth", ""), "|",
                    eta.tick(context, args.tokens, seconds))
            if run >= 0:  # the runs so far, saved: a run cut short keeps them
                row["arms"], row["runs_done"] = summarize(runs, here, args.sampling), run + 1
                row["auto_priced"] = priced(setup.runner, len(ids))
                out[str(context)] = row
                done(out)
        setup.prefix = None
    retention(out, arms)
    return out


def summarize(runs: dict[str, list[dict[str, Any]]], arms: list[Arm],
              sampling: dict[str, Any]) -> dict[str, Any]:
    """Per arm: medians and spread, ratios over mlx-lm and over our plain (same KV cache),
    ideal speedups from the measured acceptance; greedy tokens compared across arms (not
    when sampling: each arm draws its own tokens)."""
    rows: dict[str, Any] = {}
    reference: dict[int | None, list[int]] = {}  # per KV cache: quantized keys may differ
    for arm in arms:
        got = runs[arm.name]
        row: dict[str, Any] = {key: summary([g[key] for g in got])
                               for key in ("ttft_s", "prefill_s", "decode_tps", "peak_gb")}
        first = reference.setdefault(arm.kv_bits, got[0]["tokens"])
        row["greedy_tokens_identical"] = None if sampling else \
            all(g["tokens"] == first for g in got)
        expected = [g["greedy_expected"] for g in got]
        row["greedy_as_expected"] = None if None in expected else all(expected)
        accept = [g["acceptance_by_depth"] for g in got if g.get("acceptance_by_depth")]
        if accept:
            row["acceptance_by_depth"] = mean_by_position(accept)
        if arm.mode == "auto":
            row["depths"] = [g["depths"] for g in got]
            row["cost_scale"] = [g["cost_scale"] for g in got]
            row["rounds"] = [g["rounds"] for g in got]
            row["paid_ms"] = [g["paid_ms"] for g in got]
        rows[arm.name] = row
    for arm in arms:
        row, tps = rows[arm.name], [g["decode_tps"] for g in runs[arm.name]]
        kv = f":kv{arm.kv_bits}" if arm.kv_bits else ""
        for base in dict.fromkeys((f"mlx_lm{kv}", "mlx_lm", arm.baseline)):
            if base in rows and base != arm.name:
                other = [g["decode_tps"] for g in runs[base]]
                row[f"tps_over_{base}"] = statistics.median(tps) / statistics.median(other)
                row[f"tps_over_{base}_paired"] = statistics.median(
                    a / b for a, b in zip(tps, other, strict=True) if b)
        if "mlx_lm" in rows and arm.name != "mlx_lm":
            for key in ("ttft_s", "peak_gb"):
                row[f"{key}_over_mlx_lm"] = row[key]["median"] / rows["mlx_lm"][key]["median"]
    return rows


def ideal(curve: dict[str, Any], acceptance: list[float], depth: int) -> float | None:
    """E[tokens per round] / (c(depth + 1) / plain step), both at this context; the drafters
    here cost nothing (an oracle, the context)."""
    rows = str(depth + 1)
    if rows not in curve["verify_ms"] or len(acceptance) < depth:
        return None
    return (1 + sum(acceptance[:depth])) / (curve["verify_ms"][rows] / curve["plain_step_ms"])


def retention(out: dict[str, Any], arms: list[Arm]) -> None:
    """Each depth's ideal speedup at its context, measured over ideal, its speedup at each
    context over its speedup at the first (issue 49: >= 0.85 at 16K and 64K for depth 3), and a
    kv arm's speedup over the same depth's with the float cache (issue 49: within 10%)."""
    first = next(iter(out.values()))["arms"]
    for row in out.values():
        for arm in arms:
            if arm.name not in row["arms"]:  # (kv arms: --kv-contexts)
                continue
            got = row["arms"][arm.name]
            key = f"tps_over_{arm.baseline}"
            float_arm = row["arms"].get(arm.mode, {})
            if arm.kv_bits and key in got and "tps_over_plain" in float_arm:
                got["speedup_over_float_cache"] = got[key] / float_arm["tps_over_plain"]
            fixed = isinstance(arm.depth, int) and arm.depth > 0
            if fixed and not arm.kv_bits and "acceptance_by_depth" in got:  # (a float curve)
                best = ideal(row["curve"], got["acceptance_by_depth"], arm.depth) \
                    if "curve" in row else None
                got["ideal_speedup"] = best
                if best and key in got:
                    got["measured_over_ideal"] = got[key] / best
            if arm.mode != "mlx_lm" and key in got and key in first.get(arm.name, {}):
                got["speedup_over_first_context"] = got[key] / first[arm.name][key]


def report(out: dict[str, Any], arms: list[Arm]) -> None:
    """One line per context and arm on stdout."""
    for row in out.values():
        for arm in arms:
            got = row["arms"].get(arm.name)
            if got is None:
                continue
            parts = [f"L={row['prompt_tokens']:>6} {arm.name:10}",
                     f"{got['decode_tps']['median']:7.1f} tok/s "
                     f"({got['decode_tps']['min']:.1f}-{got['decode_tps']['p95']:.1f})",
                     f"ttft {got['ttft_s']['median']:6.2f} s", f"peak {got['peak_gb']['median']:6.2f} GB"]
            for key in ("tps_over_mlx_lm", f"tps_over_{arm.baseline}", "ideal_speedup",
                        "speedup_over_first_context", "speedup_over_float_cache",
                        "ttft_s_over_mlx_lm", "peak_gb_over_mlx_lm"):
                if got.get(key) is not None and not key.endswith(arm.name):
                    paired = got.get(f"{key}_paired")  # per run: what a noisy host allows
                    parts.append(f"{key} {got[key]:.2f}" + (
                        f" (paired {paired:.2f})" if paired is not None else ""))
            if "acceptance_by_depth" in got:
                parts.append("accept " + "/".join(f"{a:.2f}" for a in got["acceptance_by_depth"]))
            if got["greedy_tokens_identical"] is False or got["greedy_as_expected"] is False:
                parts.append("TOKENS DIFFER")
            print(" | ".join(parts), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trunk", choices=["llama8b", "qwen35", "smollm2"], default="llama8b")
    ap.add_argument("--bundle", type=Path, help="smollm2: the bundle (out/SmolLM2-135M-mlx)")
    ap.add_argument("--dtype", help="smollm2: load dtype (float32 on a CPU)")
    ap.add_argument("--draft", default="head", help="draft source of our MTP arms (oracle "
                    "trunks: head, the oracle; smollm2: lookup)")
    ap.add_argument("--contexts", default="1024,16384,65536", help="prompt tokens, comma-separated")
    ap.add_argument("--arms", default="mlx_lm,plain,d1,d3,auto,plain:kv8,d3:kv8,plain:kv4,d3:kv4",
                    help="mlx_lm, plain, dK, auto, each optionally :kvN (see the module doc)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--drop", type=int, default=16, help="first tokens left out of decode tok/s")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", choices=["all", "first", "none"], default="all",
                    help="a warm-up generation of each arm before the runs: at every context, "
                    "at the first only (kernels compiled; a GPU's per-shape attention graphs "
                    "then compile in the first run), or none")
    ap.add_argument("--kv-contexts", type=lambda v: [int(c) for c in v.split(",")],
                    help="the contexts the :kvN arms run at (default: every context)")
    ap.add_argument("--passes", type=int, default=7, help="timed passes per c(T) row")
    ap.add_argument("--no-curve", dest="curve", action="store_false",
                    help="skip c(T) at each context (and the ideal speedups it gives)")
    ap.add_argument("--traced", choices=["auto", "0", "1"], default="auto",
                    help="oracle trunks: verify passes traced (auto: on a GPU)")
    ap.add_argument("--prefix", action="store_true",
                    help="our float arms start from the prompt's state in a prefix cache, "
                    "prefilled once per context: decode speed without a prefill per run (their "
                    "TTFT and peak memory then say nothing of prefill)")
    ap.add_argument("--kv-start", type=int, default=0, help="kv arms' quantized_kv_start "
                    "(ours and mlx-lm's; 0: the whole context quantized)")
    ap.add_argument("--sampling", default="0", help="temperature,top_p,top_k of every arm "
                    "(e.g. 0.6,0.95,20: coding tools' settings; each run seeded by its index), or "
                    "0: greedy")
    ap.add_argument("--oracle", choices=["walk", "rows"], default="walk",
                    help="oracle trunks' drafter: bench_gpu's host-side walk, or bench_batch's "
                    "BatchOracle on the device (any rows; `:b1` arms need it)")
    ap.add_argument("--small", action="store_true", help="scaled-down oracle trunks (CPU check)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    t, *rest = args.sampling.split(",")
    args.sampling = {} if float(t) == 0 else {
        "temperature": float(t), "top_p": float(rest[0]) if rest else 1.0,
        "top_k": int(rest[1]) if len(rest) > 1 else 0}

    import mlx.core as mx

    arms = [Arm(a) for a in args.arms.split(",")]
    skipped = {}
    if not kv_supported():
        skipped = {a.name: "the decoder takes no kv_bits yet" for a in arms
                   if a.kv_bits and a.mode != "mlx_lm"}
        arms = [a for a in arms if a.name not in skipped]
    for name, why in skipped.items():
        log(f"arm {name} skipped: {why}")
    contexts = [int(c) for c in args.contexts.split(",")]
    started = time.perf_counter()
    gpu = mx.default_device().type == mx.DeviceType.gpu
    if args.trunk == "smollm2":
        if args.bundle is None:
            raise SystemExit("--trunk smollm2 needs --bundle")
        setup = smollm2_setup(args.bundle, args.dtype, args.draft)
    else:
        traced = gpu if args.traced == "auto" else args.traced == "1"
        log(f"building the {args.trunk} trunk (random weights, 4-bit)")
        setup = oracle_setup(args.trunk, args.small, traced, args.oracle == "rows")
    log(f"ready in {time.perf_counter() - started:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"context-{args.trunk}{'-small' if args.small else ''}.json"

    def save(out: dict[str, Any], done: bool) -> None:
        """The document so far (written after every run: a sweep cut short keeps those)."""
        doc = {"machine": machine(),
               "device": mx.device_info() if hasattr(mx, "device_info") else {},
               "backend": "gpu" if gpu else "cpu", "commit": commit(), "trunk": args.trunk,
               "small": args.small, "bundle": str(args.bundle) if args.bundle else None,
               "dtype": args.dtype, "draft": args.draft,
               "rates": RATES if setup.oracle else None, "tokens": args.tokens,
               "drop": args.drop, "runs": args.runs, "warmup": args.warmup,
               "prefill_step_size": PREFILL_STEP, "kv_group_size": KV_GROUP,
               "quantized_kv_start": args.kv_start, "kv_contexts": args.kv_contexts,
               "traced": setup.runner.trunk.passes is not None, "skipped_arms": skipped,
               "prefix": args.prefix, "sampling": args.sampling,
               "arms": [a.name for a in arms], "contexts": out,
               "complete": done, "wall_s": time.perf_counter() - started}
        path.write_text(json.dumps(doc, indent=2, default=str))

    out = sweep(setup, contexts, arms, args, lambda partial: save(partial, False))
    report(out, arms)
    save(out, True)
    log(f"saved {path} after {time.perf_counter() - started:.0f} s")

if __name__ == "__main__":
    main()
