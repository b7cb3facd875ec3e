"""Where a batch's time goes (diagnostic): per scheduler step kind, wall ms, at N rows, split
into the start (until every row decodes), the steady part and the tail; mlx-lm's
BatchGenerator step by step beside it (`--mlx-lm`). `--depths 0,1,auto` picks the arms."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import bench_batch as bb  # noqa: E402


def _summary(steps: list[tuple[str, float]]) -> dict[str, tuple[int, float, float, int]]:
    """(count, median ms, max ms, total ms) per kind."""
    kinds: dict[str, list[float]] = {}
    for kind, ms in steps:
        kinds.setdefault(kind, []).append(ms)
    return {k: (len(v), round(statistics.median(v), 2), round(max(v), 1), round(sum(v)))
            for k, v in kinds.items()}


DEPTH = [0]  # the depth of the pipelined stretch running (its steps' kind says it)


def _log_depths() -> None:
    """Label each pipelined stretch's steps with its depth (Batch.spec_rounds)."""
    from mtpkit.decoder.rounds.batch import Batch

    stock = Batch.spec_rounds

    def labelled(self, depth, *args, **kwargs):
        DEPTH[0] = depth
        yield from stock(self, depth, *args, **kwargs)

    Batch.spec_rounds = labelled


PASSES: list[tuple] = []  # each trunk pass under `--shapes`: (rows, width, key buffer,
# stock, ms building it, ms evaluating it)


def _log_passes() -> None:
    """Record every batch pass's shape and its build and device time (diagnostic: what the
    slow steps ran; evaluating each pass at once serializes pipelined rounds)."""
    import mlx.core as mx

    from mtpkit.decoder.rounds.batch import Batch

    stock = Batch._pass

    def logged(self, tokens, real, width):
        t0 = time.perf_counter()
        out = stock(self, tokens, real, width)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        PASSES.append((*tokens.shape[:2], self.cache[0].keys.shape[2], self.stock_pass,
                       round((t1 - t0) * 1000, 1), round((t2 - t1) * 1000, 1)))
        return out

    Batch._pass = logged


def run(runner, prompts, tokens, depth, label, shapes=False):
    """Decode `prompts` together twice (the first warms up) and print where the second's time
    went; returns its requests' statistics."""
    for _warm in (True, False):
        sch = runner.scheduler(len(prompts), runner.table())
        requests = [runner.prepare(p, tokens, depth=depth) for p in prompts]
        for request in requests:
            sch.add(request)
        parts: dict[str, list[tuple[str, float]]] = {"start": [], "steady": [], "tail": []}
        part, total = "start", 0
        start = time.perf_counter()
        while sch:
            kind = ("spec" if sch.spec is not None else "piped" if sch.stretch is not None
                    else "other")
            PASSES.clear()
            t0 = time.perf_counter()
            events = sch.step()
            dt = time.perf_counter() - t0
            if shapes and not _warm and (part == "tail" or dt > 0.03):
                print(f"    {part} {kind}/{sch.rows} {dt * 1000:.1f} ms passes {PASSES[:3]}"
                      f"{'...' if len(PASSES) > 3 else ''} ({len(PASSES)})", flush=True)
            kind = (f"spec{DEPTH[0]}" if sch.spec is not None
                    else "piped" if sch.stretch is not None else kind)
            total += sum(len(e.tokens) for e in events)
            if part == "start" and sch.rows == len(prompts):
                part = "steady"
            elif part == "steady" and any(e.done for e in events):
                part = "tail"
            parts[part].append((f"{kind}/{sch.rows}", dt * 1000))
        wall = time.perf_counter() - start
    print(label, f"{total / wall:.1f} tok/s wall {wall:.2f}s", flush=True)
    for name, steps in parts.items():
        print(f"  {name}: {sum(ms for _, ms in steps):.0f} ms", _summary(steps), flush=True)
        slow = [(i, k, round(ms)) for i, (k, ms) in enumerate(steps)
                if ms > 1.5 * statistics.median(m for _, m in steps)]
        if slow:
            print(f"    slow steps (index, kind, ms): {slow[:24]}", flush=True)
    return [r.stats for r in requests]


def _plain_ms(runner, prompts, tokens, pipelined=None):
    """Median ms per plain step of every row (scheduler steps that ran all rows)."""
    sch = runner.scheduler(len(prompts), runner.table())
    if pipelined is not None:
        sch.batch.pipelined = pipelined
    for p in prompts:
        sch.add(runner.prepare(p, tokens, depth=0))
    per_token = []
    while sch:
        t0 = time.perf_counter()
        events = sch.step()
        dt = (time.perf_counter() - t0) * 1000
        made = sum(len(e.tokens) for e in events)
        if sch.rows == len(prompts) and made >= len(prompts):
            per_token.append(dt * len(prompts) / made)
    return statistics.median(per_token)


def variants(runner, baseline, model, n, tokens, reps):
    """Our batched plain step under each configuration that might cost it (traced or not,
    pipelined or not, the verify kernel or MLX's matmul for n-row products) beside mlx-lm's
    BatchGenerator (stock, and on `model`, whose layers are our twins), interleaved: median ms
    per step, each configuration's runs listed."""
    import mlx.core as mx

    from mtpkit.decoder.model.rows import _KernelTwin

    vocab = runner.trunk.args.vocab_size
    prompts = [[(13 * i + 7 + 101 * s) % vocab for i in range(bb.PROMPT)] for s in range(n)]
    passes = runner.trunk.passes
    twins = [m for _, m in runner.trunk.text.named_modules() if isinstance(m, _KernelTwin)]
    rows0 = [t.kernel_rows for t in twins]
    # a trace keeps the products it saw: one compiled function per linear configuration
    fns = {True: passes._rows, False: mx.compile(passes._forward_rows)} if passes else {}

    def configure(traced, kernel):
        if passes is not None:
            passes.stock_everywhere = not traced
            passes._rows = fns[kernel]
        for t, r in zip(twins, rows0, strict=True):
            t.kernel_rows = r if kernel else frozenset(r - {n})

    arms = {"traced piped": (True, True, None), "traced sync": (True, True, False),
            "untraced piped": (False, True, None), "untraced sync": (False, True, False),
            "traced piped, MLX matmul": (True, False, None),
            "untraced piped, MLX matmul": (False, False, None)}
    got = {name: [] for name in [*arms, "mlx-lm", "mlx-lm on our twins"]}
    for rep in range(reps + 1):
        for name, (traced, kernel, piped) in arms.items():
            configure(traced, kernel)
            ms = _plain_ms(runner, prompts, tokens if rep else 16, piped)
            if rep:
                got[name].append(round(ms, 2))
        configure(True, True)
        for name, m in (("mlx-lm", baseline), ("mlx-lm on our twins", model)):
            t = _theirs_ms(m, prompts, tokens if rep else 16)
            if rep:
                got[name].append(round(t, 2))
    for name, runs in got.items():
        print(f"{n} rows {name}: median {statistics.median(runs):.2f} ms {runs}", flush=True)


def _their_steps(model, prompts, tokens) -> tuple[list[tuple[int, float]], float]:
    """mlx-lm's BatchGenerator over `prompts` at once: (rows answered, ms) per call, and the
    wall seconds."""
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=n,
                         prefill_batch_size=n)
    start = time.perf_counter()
    gen.insert(prompts, [tokens] * n)
    steps: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    while responses := gen.next_generated():
        now = time.perf_counter()
        steps.append((len(responses), (now - t0) * 1000))
        t0 = now
    wall = time.perf_counter() - start
    gen.close()
    return steps, wall


def _theirs_ms(model, prompts, tokens):
    """Median ms of mlx-lm's steps that ran every row."""
    steps, _ = _their_steps(model, prompts, tokens)
    return statistics.median([ms for k, ms in steps[1:] if k == len(prompts)])


def theirs(model, prompts, tokens, label):
    n = len(prompts)
    for _warm in (True, False):
        steps, wall = _their_steps(model, prompts, tokens)
    full = [ms for k, ms in steps[1:] if k == n]
    print(label, f"{n * tokens / wall:.1f} tok/s wall {wall:.2f}s; first call {steps[0][1]:.0f} "
          f"ms; {len(full)} steps of {n} rows: median {statistics.median(full):.2f} ms, total "
          f"{sum(full):.0f} ms; the rest {sum(ms for _, ms in steps[1:]) - sum(full):.0f} ms",
          flush=True)


def real(args: argparse.Namespace) -> None:
    """`--bundle B [--dtype D] [--tokens N]`: a real bundle on the serve bench's four loads
    (held_code, held_memo, edit, code; chat ones templated), batched at depth auto, then each
    alone (what a one-at-a-time server spends on them), and what each drafted either way."""
    import mtpkit
    from mtpkit.verify.loads import real_loads

    runner = mtpkit.load(args.bundle, dtype=args.dtype)
    tokens = args.tokens
    loads = real_loads(["held_code", "held_memo", "edit", "code"])
    prompts = [[{"role": "user", "content": load.fresh(None)}] if load.chat
               else load.fresh(None) for load in loads.values()]
    ids = [runner.encode(p) for p in prompts]
    batched = run(runner, ids, tokens, "auto", f"{len(ids)} prompts batched, depth auto")
    for _warm in (True, False):
        start = time.perf_counter()
        alone = [runner.generate(p, max_tokens=tokens, depth="auto").stats for p in ids]
        wall = time.perf_counter() - start
    print(f"one at a time: wall {wall:.2f}s", flush=True)
    for name, b, a in zip(loads, batched, alone, strict=True):  # what each row drafted
        for way, stats in (("batched", b), ("alone", a)):
            kept = {source: (c["rounds"], c["proposed"], c["accepted"])
                    for source, c in stats.sources.items()}
            print(f"  {name} {way}: rounds by depth {stats.depths}; per source (rounds,"
                  f" proposed, kept per position) {kept}", flush=True)


def main() -> None:
    import mlx.core as mx
    from bench_gpu import SUCCESSOR, llama8b, stock

    from mtpkit.decoder.cache.shapes import bounded_by_default
    from mtpkit.decoder.model.kernels import cuda_available
    from mtpkit.decoder.model.rows import use_kernel_linears
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.runner import Runner
    from mtpkit.decoder.tuning.costs import measure

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bundle", help="a real bundle on the serve loads (else the oracle)")
    parser.add_argument("--dtype")
    parser.add_argument("--tokens", type=int, default=192, help="with --bundle")
    parser.add_argument("--depths", default="0,1,2,3,auto", help="the oracle's arms")
    parser.add_argument("--mlx-lm", action="store_true", help="mlx-lm's steps beside ours")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--shapes", action="store_true",
                        help="print the pass shapes of the tail's and every slow step")
    parser.add_argument("--tuned", action="store_true",
                        help="the batch's round prices timed first (tune --max-batch 8)")
    parser.add_argument("--untraced", action="store_true",
                        help="no traced passes (to tell their share of a step)")
    parser.add_argument("--stock-linears", action="store_true",
                        help="MLX's quantized matmul for every row count, not the verify kernel")
    parser.add_argument("--variants", type=int, default=0, metavar="RUNS",
                        help="only the plain step under each configuration, RUNS runs each")
    args = parser.parse_args()
    if args.bundle:
        return real(args)
    depths = args.depths.split(",")
    if args.shapes:
        _log_passes()
    _log_depths()
    model = llama8b(4, small=args.small)
    trunk = Trunk(model)
    if cuda_available() and not args.stock_linears:
        use_kernel_linears(trunk.text)
    if bounded_by_default() and not args.untraced:
        trunk.use_traced()
    vocab = trunk.args.vocab_size
    runner = Runner(trunk, bb.BatchOracle(SUCCESSOR[id(model)], bb.RATES, seed=0), None)
    runner._costs = measure(runner)
    if args.tuned:
        from mtpkit.verify.tune import batch_lines

        runner.batch_costs(8, told=batch_lines())
        if trunk.passes is not None:
            print("untraced:", sorted(k for k, s in trunk.passes.stock_rows.items() if s))
    baseline = stock(model)  # mlx-lm's arms run its own layers, not our kernel twins
    if args.variants:
        for n in (8, 4):
            variants(runner, baseline, model, n, 128, args.variants)
        return
    for n in (4, 8):
        prompts = [[(13 * i + 7 + 101 * s) % vocab for i in range(bb.PROMPT)] for s in range(n)]
        for depth in depths:
            run(runner, prompts, 256, depth if depth == "auto" else int(depth),
                f"{n} rows depth {depth}", args.shapes)
        if args.mlx_lm:
            theirs(baseline, prompts, 256, f"{n} rows mlx-lm")
        mx.clear_cache()


if __name__ == "__main__":
    main()
