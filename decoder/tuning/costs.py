"""What a round costs on this machine: the trunk's verify curve c(T), a head draft and a plain step.

Measured once per bundle, load options, backend and versions, and cached (decoder/tuning/store.py):
c(T) at a short context within a budget (BUDGET_S, $MTPKIT_COST_BUDGET: all 16 widths, else
SPARSE_ROWS interpolated; a width stops once its timings agree or the plan would overrun), then
at longer contexts as far as the budget reaches (`contexts_for`, `_longer`). A wider pass timed
PAD_GAIN cheaper than a narrower one is timed again, and a break that survives is smoothed.
Load only slows a timing down: timings DRIFT apart mark a measurement `noisy`, and a stored curve
whose plain step real steps beat by DRIFT is marked stale and measured again (`check_plain`).
Progress goes only to a callback. The whole design, with why: docs/tune.md.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from mtpkit.decoder.cache.caches import snapshot, trim
from mtpkit.decoder.cache.state import rewind
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.sampling import SamplingParams, greedy
from mtpkit.decoder.tuning import store as disk
from mtpkit.decoder.tuning.curve import (
    CONTEXT,
    GRAIN,
    MAX_ROWS,
    MIN_REPEATS,
    CostCurve,
    Point,
    breaks,
    interpolate,
    smooth,
)
from mtpkit.decoder.tuning.policy import CostTable, Shape
from mtpkit.decoder.tuning.store import cache_file, versions

if TYPE_CHECKING:
    from mtpkit.decoder.model.head import MTPHead
    from mtpkit.decoder.model.trunk import Trunk


@dataclass(frozen=True)
class Plan:
    """How a measurement spends its budget: the tunables only this module reads, in one table."""

    repeats: int = 7  # most timed passes per row (their median counts)
    steady: float = 0.05  # a row stops early once MIN_REPEATS timings spread less than this
    # (max - min) / median
    plain_warmup: int = 4  # plain steps that warm up the plain path first (its shapes, not a timing)
    plain_steps: int = 32  # plain steps timed at the first context (half where the budget is short)
    plain_batch: int = 8  # steps per timing where plain_steps would take over a second, and at a
    # longer context (one run, and one of half as many: `_Bench.plain_step`)
    long_share: float = 0.25  # of the budget, what longer contexts have at least (the first
    # context takes the rest, 15 s by default as before they were measured, and leaves them what
    # it does not use)
    prefill_share: float = 0.3  # of the budget, the most the context's prefill may take
    probe_tokens: int = 16  # measure_decoding: steps and rounds timed per repeat
    probe_repeats: int = 2  # measure_decoding: the fastest repeat counts (load only adds time)


PLAN = Plan()
SPARSE_ROWS = (1, 2, 3, 4, 6, 8, 12, MAX_ROWS)  # timed when all do not fit the budget (the widest
# always: interpolate needs it)
BUDGET_S = 20.0  # seconds a measurement aims to take ($MTPKIT_COST_BUDGET overrides)
LADDER = (4096, 16384, 65536)  # contexts measured, as far as the model and budget allow
LONGEST = LADDER[-1]  # the longest context measured (an agent's long prompt): beyond, extrapolated
CHUNK = 4 * GRAIN  # prefill tokens per timed pass on the way to a longer context (whole GRAINs, so
# each pass ends on a padded cache's step: no mask over every key)
FARTHER = 4  # a context cut short by the budget is measured if this many times the first one's
# and twice the last (the policy extrapolates its slope: a short one timed on a busy CPU misprices)
RETRY_SHARE = 0.25  # of the budget, the least a re-measurement may take beyond the budget
VERSION = 8  # bump when what is measured changes (2: bounded, checked, smoothed curves;
# 3: with what judges them; 4: at longer contexts too: a curve of one context priced a 64K
# round as a 512-token one, so older curves are measured again, not read as flat; 5: the
# first context prefilled in pieces: a first pass that compiled could cut a curve to 64 tokens;
# 6: in pairs of equal pieces, the second pricing: each new piece size compiles on a GPU;
# 7: plain steps on one stream: a GPU's stored plain step was a fifth too dear, within DRIFT;
# 8: plain steps in a stretch's stride, its start cancelled: at 16K and 64K a GPU's was 2x dear)
DRIFT = 1.5  # two timings of one thing this far apart: the slower ran on a busy machine, or (a
# first pass) built something: then each width is warmed up first (a GPU)


class Loaded(Protocol):
    """What a measurement reads of a loaded bundle (decoder/runner.py's Runner, named by its
    parts: the runner imports this module)."""

    trunk: Trunk
    head: MTPHead | None
    context: int | None  # the model's longest context (None: it declares none)
    root: Path | None  # the bundle's folder (None: not loaded from one, so nothing is cached)
    load_options: dict[str, Any]  # what else keys the cache (dtype, kv, ...)


def weights_fingerprint(root: Path) -> str:
    """A quick fingerprint of a bundle's weights: every safetensors file's name, size, mtime and
    header bytes (hashing 16 GB of data on every load would defeat the cache)."""
    digest = hashlib.sha256()
    for path in sorted(root.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
        with open(path, "rb") as fh:
            head = fh.read(8)
            size = int.from_bytes(head, "little") if len(head) == 8 else 0
            digest.update(fh.read(min(size, 100 << 20)))
    return digest.hexdigest()


def cache_key(root: Path, options: dict[str, Any]) -> dict[str, Any]:
    device = mx.default_device()
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {"weights": weights_fingerprint(root), "load": options,
            "backend": f"{device.type.name}:{info.get('device_name', '')}",
            "versions": versions(), "format": VERSION}


def cached(key: dict[str, Any]) -> CostCurve | None:
    """The stored curve of `key`, or None: none, invalid (decoder/tuning/store.py says why), another
    key, marked stale, or failing the sanity check (said on stderr: measured again)."""
    path = cache_file(key)
    doc = disk.read(path, "curve")
    if doc is None or doc["key"] != key:
        return None
    if "stale" in doc:
        disk.say(f"measuring again: {path} priced a plain step at {1000 * doc['plain']:.1f} ms "
                 f"and a later run's ran at {1000 * doc['stale']['plain_paid']:.1f} ms")
        return None
    curve = CostCurve(doc["verify"], doc["plain"], doc["draft"], key, estimate=True,
                      longer=[Point(**p) for p in doc["longer"]],
                      **{k: doc[k] for k in ("context", "timed", "remeasured", "smoothed",
                                             "seconds", "spread", "measured_at", "load")})
    if any(breaks(v) for v in (curve.verify, *(p.verify for p in curve.longer))):
        disk.say(f"measuring again: {path} prices a wider verify pass under a narrower one")
        return None
    if sorted(set(contexts := curve.contexts())) != contexts:
        disk.say(f"measuring again: {path} has its contexts out of order ({contexts})")
        return None
    return curve


def store(curve: CostCurve) -> Path:
    return disk.write(cache_file(curve.key), curve.stored(), "curve")


_STALE: set[Path] = set()  # stored curves this process judged stale already


def noisy(curve: CostCurve) -> str:
    """Why `curve` is not to be trusted as measured, in one line ("" when its repeats agree)."""
    if curve.spread <= DRIFT:
        return ""
    load = "" if curve.load is None else f", load {curve.load:.1f} per core as it began"
    return (f"measured on a busy machine (a shape's median timing {curve.spread:.1f}x its "
            f"fastest{load}): checked against the plain steps decoding takes; `mtpkit tune "
            "--refresh` on an idle machine measures it again")


def check_plain(curve: CostCurve, paid: float) -> bool:
    """Whether the stored curve `curve` was read from is stale by the module's rule: its plain
    step over DRIFT dearer than `paid`, the seconds plain steps really take in this process.
    Marks it so on disk (once, with one line on stderr): the next load measures again."""
    if not curve.key or not curve.estimate or curve.plain <= DRIFT * paid:
        return False  # (asked after every plain stretch: the file is read only when it fails)
    return _mark_stale(
        cache_file(curve.key), "curve", curve.key, {"plain_paid": paid},
        lambda doc: doc["plain"] > DRIFT * paid,
        lambda doc, path: f"the stored cost curve prices a plain step at "
        f"{1000 * doc['plain']:.1f} ms; here they take {1000 * paid:.1f} ms (it was measured on "
        f"a busy machine): priced by what rounds pay for now, measured again at the next load "
        f"({path})")


def check_batch(table: CostTable, shape: Shape) -> bool:
    """Whether the batch prices stored beside the table's curve (`tune --max-batch`) are stale
    by the module's rule, judged after a pass of `shape` (rows x width, pipelined or not):
    their plain step of as many rows priced over DRIFT dearer than MIN_REPEATS or more such
    passes take in this process (a plain step is the least work a batch's pass does; a price
    that dear keeps the batch off plain steps, so their own timings may never come). Marks the
    file so (once, with one line on stderr): the next read finds no prices there and tune times
    batches again; this process prices batches without them from now on."""
    rows = shape[0]
    plain, seen = (rows, 1, True), table.times.get(shape, ())
    if (not table.curve.key or not table.learn or plain not in table.seeded
            or len(seen) < MIN_REPEATS):
        return False
    stored, paid = table.seeded[plain] * table.prior(plain, table.curve.context), \
        statistics.median(seen)
    if stored <= DRIFT * paid:
        return False
    table.unseed()
    return _mark_stale(
        disk.batch_file(table.curve.key), "batch", table.curve.key,
        {"rows": rows, "plain_paid": paid}, lambda doc: True,
        lambda doc, path: f"the stored batch prices price a plain step of {rows} rows at "
        f"{1000 * stored:.1f} ms; passes of {rows} rows take {1000 * paid:.1f} ms here (they "
        f"were timed on a busy machine): set aside, timed again by the next `mtpkit tune "
        f"--max-batch` ({path})")


def _mark_stale(path: Path, kind: str, key: dict[str, Any], why: dict[str, Any],
                still: Callable[[dict[str, Any]], bool],
                line: Callable[[dict[str, Any], Path], str]) -> bool:
    """Mark the stored document `path` stale (`why`, and when), once per process and only
    where it is still the one judged (its key, not marked yet, `still` true of it); one line
    on stderr says so. Whether it was marked."""
    if path in _STALE:
        return False
    _STALE.add(path)
    doc = disk.read(path, kind)
    if doc is None or doc["key"] != key or "stale" in doc or not still(doc):
        return False
    disk.write(path, {**doc, "stale": {**why, "at": time.time()}}, kind)
    disk.say(line(doc, path))
    return True


@dataclass
class Tick:
    """Where a measurement stands, for a progress display. phase "start": nothing run yet (the
    budget is known, the plan not); "plan": the probes chose how many widths and passes fit;
    "step": `done_s` of about `total_s` seconds (refined as passes are timed); "done": the
    curve is measured (`curve`)."""

    phase: str
    what: str
    done_s: float = 0.0
    total_s: float = 0.0
    budget_s: float = 0.0
    curve: CostCurve | None = None

    @property
    def eta_s(self) -> float:
        return max(self.total_s - self.done_s, 0.0)


Progress = Callable[[Tick], None]
Timer = Callable[[str, int, Callable[[], object]], float]


def wall_clock(kind: str, size: int, run: Callable[[], object]) -> float:
    """The timer measure() uses: the seconds `run` took. `kind` ("probe", "prefill",
    "warm-up", "verify": a pass over `size` rows or tokens; "plain", "draft": `size` steps)
    says what it is, for a timer a test passes in place of the clock."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def budget() -> float:
    """Seconds a measurement aims at: $MTPKIT_COST_BUDGET, else BUDGET_S."""
    try:
        value = float(os.environ.get("MTPKIT_COST_BUDGET", BUDGET_S))
    except ValueError:
        return BUDGET_S
    return value if value > 0 and math.isfinite(value) else BUDGET_S


class _Clock:
    """A measurement's time: what the timer reported so far and what the plan has left (both
    seconds), told to the progress callback after every timed call."""

    def __init__(self, timer: Timer, progress: Progress | None, budget_s: float) -> None:
        self.timer, self.progress, self.budget_s = timer, progress, budget_s
        self.spent = self.left = 0.0
        self.planned = self.took = 0.0  # of the calls the plan had estimated: both sums

    def tell(self, phase: str, what: str, curve: CostCurve | None = None) -> None:
        if self.progress is not None:
            self.progress(Tick(phase, what, self.spent, self.spent + self.left, self.budget_s,
                               curve))

    def time(self, kind: str, size: int, run: Callable[[], object], planned: float = 0.0,
             what: str = "") -> float:
        took = self.timer(kind, size, run)
        self.spent += took
        if planned > 0:
            self.planned, self.took = self.planned + planned, self.took + took
        self.left = max(self.left - planned, 0.0)
        self.tell("step", what or f"{kind} {size}")
        return took

    def skip(self, seconds: float) -> None:
        """Planned calls worth `seconds` will not run (a row stopped early)."""
        self.left = max(self.left - seconds, 0.0)

    def over(self, limit: float) -> bool:
        """The projected end is past `limit`: what is left, at the rate planned calls have run
        over their estimates so far (load arrived after the probes). Rows then take fewer passes."""
        slower = max(1.0, self.took / self.planned) if self.planned > 0 else 1.0
        return self.spent + self.left * slower > limit


def _plan(c1: float, c16: float, left_s: float, repeats: int, head: bool, warm: bool
          ) -> tuple[tuple[int, ...], int, int, float]:
    """(rows to time, passes per row, plain steps per timing, estimated seconds) that fit
    `left_s`, from the probe passes at 1 and 16 rows: every row at MIN_REPEATS or more if that
    fits, else SPARSE_ROWS at as many as fit (at least one, and half the plain steps).
    warm: each new width takes a warm-up pass first (the probes saw one compile)."""
    def cost(rows: tuple[int, ...], n: int, steps: int) -> float:
        verify = sum((n - 1 if t in (1, MAX_ROWS) else n + warm) * _linear(c1, c16, t)
                     for t in rows)  # a probe was a row's first pass
        return verify + _rest(c1, n, head, steps)

    every = tuple(range(1, MAX_ROWS + 1))
    for n in range(repeats, MIN_REPEATS - 1, -1):
        if cost(every, n, PLAN.plain_steps) <= left_s:
            return every, n, PLAN.plain_steps, cost(every, n, PLAN.plain_steps)
    for steps in (PLAN.plain_steps, PLAN.plain_steps // 2):
        for n in range(repeats, 0, -1):
            if cost(SPARSE_ROWS, n, steps) <= left_s:
                return SPARSE_ROWS, n, steps, cost(SPARSE_ROWS, n, steps)
    return SPARSE_ROWS, 1, PLAN.plain_steps // 2, cost(SPARSE_ROWS, 1, PLAN.plain_steps // 2)


def _rest(c1: float, passes: int, head: bool, steps: int = PLAN.plain_steps) -> float:
    """Estimated seconds of the plain and draft timings (a plain step costs about c(1), a head
    step a fraction of it)."""
    return ((PLAN.plain_warmup + max(1, passes // 2) * steps) * c1
            + ((passes + 2) * c1 / 4 if head else 0.0))


def _linear(c1: float, c16: float, rows: int) -> float:
    return c1 + (c16 - c1) * (rows - 1) / (MAX_ROWS - 1)


def contexts_for(runner: Loaded, first: int) -> list[int]:
    """The longer contexts measure() aims at, shortest first: LADDER's below the longest the
    model takes (its context less GRAIN of room for the passes, at most LONGEST), then that."""
    top = LONGEST if runner.context is None else min(runner.context - GRAIN, LONGEST)
    top = top // GRAIN * GRAIN
    return [c for c in LADDER if first < c < top] + ([top] if top > first else [])


class _Bench:
    """What measure() times at the context the session's trunk cache holds: verify passes over
    T rows and pipelined plain steps (each put back after it), and prefill on to a longer
    context; with what prefill has paid so far, per token by position (`rates`)."""

    def __init__(self, runner: Loaded, session: Session, ids: list[int], clock: _Clock) -> None:
        self.runner, self.session, self.ids, self.clock = runner, session, ids, clock
        self.warm = False  # each new shape's first pass compiles (a GPU): warm it up first
        self.rates: list[tuple[float, float]] = []  # (mean position, seconds per token)
        self.sizes: set[int] = set()  # piece sizes prefilled so far
        self.repeats: list[list[float]] = []  # every shape's timings, for the spread

    def verify(self, rows: int) -> None:
        cache = self.session.cache
        saved = snapshot(cache, rows)
        _, logits = self.runner.trunk(mx.array(self.ids[:rows])[None], cache)
        mx.eval(greedy(logits[0]))
        rewind(cache, saved, rows, 0)

    def plain(self, count: int) -> None:
        saved = snapshot(self.session.cache, count)
        for _ in self.session.plain_steps(count):
            pass
        rewind(self.session.cache, saved, count, 0)

    def prefill(self, start: int, end: int, what: str) -> None:
        """The trunk's cache from `start` to `end` tokens (the head's stays short: one layer).
        The first piece of a size prices nothing where another piece does: on a GPU it compiles
        that shape's kernels, seconds that the next piece of its size does not pay."""
        took = self.clock.time("prefill", end - start, lambda: mx.eval(self.runner.trunk(
            mx.array(self.ids[start:end])[None], self.session.cache)[1]), what=what)
        if end - start in self.sizes or not self.rates:
            self.rates.append(((start + end) / 2, took / (end - start)))
        self.sizes.add(end - start)

    def slope(self) -> float:
        """Seconds per token per position of context, as prefill paid it (at least 0)."""
        (a, ra), (b, rb) = self.rates[0], self.rates[-1]
        return max((rb - ra) / (b - a), 0.0) if b > a else 0.0

    def prefill_s(self, start: int, end: int) -> float:
        at, rate = self.rates[-1]
        return (end - start) * max(rate + self.slope() * ((start + end) / 2 - at), rate)

    def row(self, rows: int, got: list[float], passes: int, est: float, limit: float,
            warm: bool, where: str = "") -> float:
        """Passes over `rows` rows into `got` (after a warm-up where `warm`) up to `passes`,
        fewer once MIN_REPEATS agree within PLAN.steady or the projected end passes `limit`; their
        median."""
        clock = self.clock
        if warm:
            clock.time("warm-up", rows, lambda: self.verify(rows), est, f"warm-up T={rows}{where}")
        while len(got) < passes:
            got.append(clock.time("verify", rows, lambda: self.verify(rows), est,
                                  f"verify T={rows}{where}"))
            steady = (len(got) >= MIN_REPEATS
                      and (max(got) - min(got)) / statistics.median(got) < PLAN.steady)
            if steady or clock.over(limit):
                clock.skip((passes - len(got)) * est)
                break
        self.repeats.append(got)
        return statistics.median(got)

    def plain_step(self, total: int, batch: int, step: float, limit: float,
                   where: str = "") -> float:
        """The median seconds of a plain step in a stretch's stride: a run of `batch` steps
        less one of half as many, over the steps between (a stretch's start cancels out: the
        device idles while its first step is built, and its first steps read slower; in one
        run of 8 steps after a long prefill a GPU's step was priced at twice what decoding
        paid), runs of both about `total` steps in all (fewer where the projected end passes
        `limit`); `step`: what one is expected to take."""
        half = batch // 2
        runs: list[float] = []
        for i in range(0, max(total - half, 1), batch + half):
            short, full = (self.clock.time("plain", n, lambda n=n: self.plain(n), n * step,
                                           f"plain steps {i + 1}-{i + n}{where}")
                           for n in (half, batch))
            runs.append((full - short) / (batch - half) if full > short else full / batch)
            if self.clock.over(limit):
                self.clock.skip(max(total - i - batch - half, 0) * step)
                break
        self.repeats.append(runs)
        return statistics.median(runs)

    def passes_s(self, context: int, last: Point, passes: int) -> float:
        """What `point` would take at `context`: `last`'s costs, each row's grown by the
        attention prefill paid per token over the keys added."""
        more = self.slope() * (context - last.context)
        rows = sum(passes * (last.verify[t - 1] + t * more) for t in SPARSE_ROWS)
        steps = PLAN.plain_batch + PLAN.plain_batch // 2  # a run and its half (plain_step)
        return rows * (1 + self.warm) + steps * (last.plain + more)

    def point(self, context: int, last: Point, passes: int, limit: float) -> Point:
        """The curve at the context the cache holds (`context`), SPARSE_ROWS timed."""
        began, more, where = self.clock.spent, self.slope() * (context - last.context), \
            f" at {context}"
        self.clock.left = self.passes_s(context, last, passes)
        timed = {t: self.row(t, [], passes, last.verify[t - 1] + t * more, limit, self.warm,
                             where) for t in SPARSE_ROWS}
        verify, lowered = smooth(interpolate(timed))
        step = self.plain_step(PLAN.plain_batch, PLAN.plain_batch, last.plain + more, limit, where)
        return Point(context, verify, step, sorted(timed), lowered, self.clock.spent - began)


def _longer(bench: _Bench, targets: list[int], first: Point, passes: int) -> list[Point]:
    """The curve at each of `targets` (longer contexts, shortest first) the budget reaches:
    the cache prefilled on CHUNK tokens a pass while that and the passes after it fit the
    budget (priced by what prefill paid, linear in the position), so where the budget ends
    short of a target the context reached is measured instead, if far enough (FARTHER)."""
    clock, points, last, at = bench.clock, [], first, first.context
    for target in targets:
        while at < target:
            end = min(at + CHUNK - at % CHUNK, target)
            clock.left = min(bench.prefill_s(at, target) + bench.passes_s(target, last, passes),
                             max(clock.budget_s - clock.spent, 0.0))
            if (clock.spent + bench.prefill_s(at, end) + bench.passes_s(end, last, passes)
                    > clock.budget_s):
                break
            bench.prefill(at, end, f"prefill to {end} of {target} tokens")
            at = end
        if at < max(FARTHER * first.context, 2 * last.context):
            break
        last = bench.point(at, last, passes, clock.budget_s)
        points.append(last)
        if at < target:
            break
    return points


def measure(runner: Loaded, context: int = CONTEXT, repeats: int = PLAN.repeats,
            bounded: bool | None = None, *, budget_s: float | None = None,
            progress: Progress | None = None, timer: Timer = wall_clock,
            longer: list[int] | None = None) -> CostCurve:
    """Time the trunk over T rows at a `context`-token cache (each shape warmed up first where
    that compiles, so compiles are not counted), a pipelined plain step and a head draft step,
    in about 1 - PLAN.long_share of `budget_s` (default budget()); then the same at `longer`
    contexts (default contexts_for: the model's) in what is left (`_longer`). The cache is
    prefilled from 64 tokens in pairs of equal pieces, doubling, each pair's second piece saying
    what the next pair would cost: where `context` tokens would take more than
    PLAN.prefill_share of that share (bf16 on a CPU), the curve is measured at the shorter
    context reached (`CostCurve.context`), the plain step with it, so what decides (a round
    against plain steps) stays like for like. Then the passes at 1 and 16 rows plan how many
    rows and passes fit. Suspect breaks are timed again, then smoothed (see the module's doc).
    bounded: the session's attention shapes (default: as decoding runs on this backend).
    progress: told what is measured and how long is left (nothing is printed). timer: how a
    call is timed (wall_clock; a test passes its own)."""
    began, load = time.time(), _load()
    clock = _Clock(timer, progress, budget() if budget_s is None else budget_s)
    share = (1 - PLAN.long_share) * clock.budget_s  # the first context's
    clock.left = clock.budget_s  # until the probes plan it: at most the budget
    clock.tell("start", "verify costs")
    targets = contexts_for(runner, context) if longer is None else longer
    vocab = runner.trunk.args.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(max([context, *targets]))]
    session = Session(runner.trunk, runner.head, SamplingParams(), 1 if runner.head else 0,
                      bounded=bounded)
    bench = _Bench(runner, session, ids, clock)
    head_start = min(64, context)  # a real prefill first: its first token is committed
    clock.time("prefill", head_start, lambda: session.start(ids[:head_start]),
               what=f"{head_start}-token prefill")
    held, size = head_start, head_start  # on to `context` in pairs of equal pieces, doubling:
    # on a GPU the first pass of a process compiles every kernel (seconds), and each new piece
    # size compiles its own: a pair's first piece pays that, its twin is timed warm and prices
    # the next pair, while the whole prefill up to that pair's end fits PLAN.prefill_share
    while held < context:
        for _ in range(2):
            if held < context:
                end = min(context, held + size)
                bench.rates.clear()  # (each pair prices the next)
                bench.prefill(held, end, f"{end}-token prefill")
                held = end
        size *= 2
        if min(context, held + 2 * size) * bench.rates[-1][1] > PLAN.prefill_share * share:
            break
    context = held
    targets = [t for t in targets if t > context]
    first, passes = _first(bench, context, share, repeats, targets)
    points = _longer(bench, targets, Point(context, first.verify, first.plain), passes)
    clock.left = 0.0
    result = replace(first, longer=points, seconds=clock.spent,
                     spread=max((statistics.median(t) / min(t) for t in bench.repeats
                                 if len(t) > 1), default=1.0), measured_at=began, load=load)
    clock.tell("done", "verify costs", result)
    return result


def _first(bench: _Bench, context: int, share: float, repeats: int, targets: list[int]
           ) -> tuple[CostCurve, int]:
    """The curve at the first `context` (the cache holds it) in about `share` seconds, and the
    passes per row its plan chose."""
    clock, head = bench.clock, bench.runner.head is not None
    samples: dict[int, list[float]] = {}
    first: dict[int, float] = {}
    for rows in (1, MAX_ROWS):  # the probes: each shape's first pass may compile
        first[rows] = clock.time("warm-up", rows, lambda rows=rows: bench.verify(rows),
                                 what=f"warm-up T={rows}")
        samples[rows] = [clock.time("verify", rows, lambda rows=rows: bench.verify(rows),
                                    what=f"verify T={rows}")]
    c1, c16 = samples[1][0], samples[MAX_ROWS][0]
    bench.warm = any(first[t] > DRIFT * samples[t][0] for t in first)  # else a first pass counts
    rows_timed, passes, steps, planned = _plan(c1, c16, share - clock.spent, repeats, head,
                                               bench.warm)
    later = PLAN.long_share * clock.budget_s if targets else 0.0  # at most: see _longer
    clock.left = planned + later
    clock.tell("plan", f"{len(rows_timed)} widths x {passes} passes"
               + (f"; then up to {targets[-1]} tokens" if targets else ""))
    hard = share * (1 + RETRY_SHARE)  # the most it takes, give or take a pass

    def time_row(rows: int, passes: int, fresh: bool) -> float:
        est = _linear(c1, c16, rows) if fresh else statistics.median(samples[rows])
        warm = fresh and bench.warm and rows not in samples
        return bench.row(rows, samples.setdefault(rows, []) if fresh else [], passes, est,
                         share if fresh else hard, warm)

    timed = {rows: time_row(rows, passes, True) for rows in rows_timed}
    curve = interpolate(timed)
    retimed: list[int] = []
    if suspect := breaks(curve):  # from each break to the cheaper width: timed again, once
        region = sorted({t for b in suspect for t in rows_timed
                         if max(r for r in rows_timed if r <= b) <= t
                         <= min(r for r in rows_timed if r >= _cheapest(curve, b))})
        again = sum(max(passes, MIN_REPEATS) * timed[t] for t in region)
        if again <= max(share - clock.spent - _rest(c1, passes, head, steps),
                        RETRY_SHARE * share):
            clock.left += again
            for t in region:  # load only slows a pass: the lower median is nearer the truth
                timed[t] = min(timed[t], time_row(t, max(passes, MIN_REPEATS), False))
            retimed = region
            curve = interpolate(timed)
    curve, lowered = smooth(curve)
    step, draft = _steps(bench, passes, steps, c1, hard, later)
    return CostCurve(curve, step, draft, estimate=True, context=context, timed=sorted(timed),
                     remeasured=retimed, smoothed=lowered), passes


def _steps(bench: _Bench, passes: int, steps: int, c1: float, limit: float, later: float
           ) -> tuple[float, float]:
    """(a plain step, a head draft step: 0 without a head) at the first context, in runs of
    steps (a bar moves every second); `later`: the seconds planned after them."""
    clock = bench.clock
    warmup = PLAN.plain_warmup
    clock.time("plain", warmup, lambda: bench.plain(warmup), warmup * c1,
               "plain warm-up")  # its shapes, not a timing
    step = bench.plain_step(max(1, passes // 2) * steps,
                            steps if steps * c1 <= 1.0 else PLAN.plain_batch, c1, limit)
    draft = 0.0
    if bench.runner.head is not None:
        def head_steps() -> None:
            nonlocal draft
            draft = _draft_step(bench.session, passes)

        clock.time("draft", passes, head_steps, clock.left - later, "head draft steps")
    clock.left = later
    return step, draft


def _load() -> float | None:
    """The 1-minute load average per core (None where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def _draft_step(session: Session, repeats: int) -> float:
    """Median seconds of one chained head draft step (after a started session)."""
    head = session.head
    assert head is not None
    session.head_draft(1)  # consume the owed pairs (greedy: no draws)
    hidden = mx.zeros((1, 1, session.trunk.args.hidden_size))
    token = mx.array([[session.last]])
    chained = [int(b == 1 % head.blocks) for b in range(head.blocks)]
    times = []
    for _ in range(repeats + 1):
        begin = time.perf_counter()
        logits, _ = head(hidden, token, session.mtp_cache, 1, last_only=True)
        mx.eval(greedy(logits[:, -1]))
        times.append(time.perf_counter() - begin)
        trim(session.mtp_cache, chained)
    return statistics.median(times[1:])


@dataclass(frozen=True)
class DecodeCosts:
    """Seconds per plain decode step, per depth-1 round (draft, 2-token verify, rollback,
    the round's host sync) and per prefilled prompt token, on this machine."""

    step_s: float
    round_s: float
    prefill_s: float

    @property
    def round_steps(self) -> float:
        return self.round_s / self.step_s

    def prompt_s(self, length: int, tokens: int) -> float:
        """An upper bound on scoring one prompt: every round commits at least one token."""
        return length * self.prefill_s + (tokens - 1) * self.round_s

    def probe_s(self, length: int) -> float:
        return PLAN.probe_repeats * (2 * length * self.prefill_s
                                + PLAN.probe_tokens * (self.step_s + self.round_s))

    def to_dict(self) -> dict[str, float]:
        return {"step_ms": 1000 * self.step_s, "round_ms": 1000 * self.round_s,
                "round_steps": self.round_steps, "prefill_ms_per_token": 1000 * self.prefill_s}


def measure_decoding(trunk: Trunk, head: MTPHead, ids: list[int]) -> DecodeCosts:
    """Time whole plain steps and depth-1 rounds as decoding runs them, after prefilling `ids`
    (greedy; end of text does not stop them), PLAN.probe_repeats times; the fastest of each (graft's
    budget and its "will the head pay": what a user's first rounds cost, not the curve)."""
    greedy = SamplingParams()
    step = rnd = prefill = math.inf
    for _ in range(PLAN.probe_repeats):
        plain = Session(trunk, head, greedy, 0)
        tokens = plain.plain(ids, PLAN.probe_tokens + 1)
        next(tokens)
        begin = time.perf_counter()
        for _ in tokens:
            pass
        step = min(step, (time.perf_counter() - begin) / PLAN.probe_tokens)
        prefill = min(prefill, plain.stats.prefill_s / len(ids))
        spec = Session(trunk, head, greedy, 1)
        spec.start(ids)
        begin = time.perf_counter()
        for _ in range(PLAN.probe_tokens):
            spec.round(spec.head_draft(1))
        rnd = min(rnd, (time.perf_counter() - begin) / PLAN.probe_tokens)
    return DecodeCosts(step, rnd, prefill)


def _cheapest(curve: list[float], rows: int) -> int:
    """The narrowest width > rows at the cheapest cost of the wider ones."""
    return min(range(rows + 1, len(curve) + 1), key=lambda t: (curve[t - 1], t))


def costs_for(runner: Loaded, refresh: bool = False, progress: Progress | None = None,
              budget_s: float | None = None) -> CostCurve:
    """The runner's cost curve: cached for a bundle-loaded runner, else measured now (telling
    `progress`, within `budget_s`)."""
    key = cache_key(runner.root, runner.load_options) if runner.root is not None else None
    if key is not None and not refresh and (found := cached(key)) is not None:
        return found
    curve = measure(runner, progress=progress, budget_s=budget_s)
    if key is not None:
        curve.key = key
        store(curve)
    return curve
