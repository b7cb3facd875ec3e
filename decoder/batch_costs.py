"""What a batch's rounds cost here, timed up front (`mtpkit tune --batch N`) and kept on disk.

`tune --batch N` runs the real engine (Scheduler, Batch, the policy's own `observe`) on
synthetic prompts at 2, 4, ... N rows with a policy that asks for each shape still untimed (a
plain stretch, a plain round, every depth up to EXPLORE) until each has ROUNDS times, and stores
them beside the cost curve (same key): later runners start from those prices. A traced trunk's
shapes are timed both ways, traced and stock, and the faster way is kept per (rows, width)
(`choose`). Why: docs/tune.md, "Batched rounds".
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mtpkit.decoder import store as disk
from mtpkit.decoder.batch import Batch
from mtpkit.decoder.batch_policy import EXPLORE, PIPED, BatchPolicy, Row, piped
from mtpkit.decoder.caches import is_recurrent
from mtpkit.decoder.policy import MIN_OBSERVED, WINDOW
from mtpkit.decoder.scheduler import Request, Scheduler

if TYPE_CHECKING:
    from mtpkit.decoder.curve import CostCurve
    from mtpkit.decoder.head import MTPHead
    from mtpkit.decoder.options import Depth
    from mtpkit.decoder.policy import DepthPolicy
    from mtpkit.decoder.trunk import Trunk

ROUNDS = MIN_OBSERVED + 2  # times per shape: the first may have compiled something (a GPU)
MARGIN = 0.95  # the stock pass takes a shape only where its rounds cost under 0.95x traced ones
MAX_TOKENS = 100_000  # the requests never end by length: the timing policy ends the run

Paid = dict[tuple[int, int], deque]
Stock = dict[tuple[int, int], bool]  # (rows, width) -> the stock pass is the faster one
Told = Callable[[str, int, int], None]  # (what, shapes done, shapes in all)


class Preparing(Protocol):
    """What timing batches uses of a runner (decoder/runner.py's Runner, named by its parts:
    the runner imports this module): its model, its curve and policy, and its requests."""

    trunk: Trunk
    head: MTPHead | None

    def costs(self) -> CostCurve: ...

    def policy(self, depth: Depth) -> tuple[int, DepthPolicy | None]: ...

    def prepare(self, prompt: list[int], max_tokens: int, *, depth: Depth, draft: str
                ) -> Request: ...


@dataclass
class _Timing(BatchPolicy):
    """A batch policy that asks for the first shape at the batch's size with fewer than ROUNDS
    times (a plain stretch, a plain round, then depths 1..max_depth) and says when all have
    them (`done`)."""

    size: int = 0  # the batch's full size: shapes are asked for only once every row joined
    done: bool = False

    def wanted(self, rows: int) -> int | None:
        return missing(self.paid, rows, self.max_depth)

    def depth(self, requests: list[Row], rows: int | None = None) -> int:
        self.decided = False
        if self.plain_left > 0:
            self.plain_left -= 1
            return 0
        rows = len(requests) if rows is None else rows
        shape = self.wanted(rows) if rows == self.size else 0
        if shape is None:
            self.done = True
            return 0
        if shape == PIPED:
            self.plain_left = ROUNDS + 2  # as a stretch runs: pipelined where the batch can
            return 0
        self.decided = shape > 0  # chosen "on prices": the scheduler may pipeline it
        return shape


def deepest(runner: Preparing) -> int:
    """The deepest depth timed up front: the runner's, at most EXPLORE."""
    return min(runner.policy("auto")[0], EXPLORE)


def shapes(max_depth: int) -> list[int]:
    """The shapes timed at each size, in order: a plain stretch (PIPED), a plain round (0),
    then each depth."""
    return [PIPED, 0, *range(1, max_depth + 1)]


def missing(paid: Paid, rows: int, max_depth: int) -> int | None:
    """The first shape at `rows` rows with fewer than ROUNDS times (a depth's, pipelined or
    not), None when every one has them."""
    def have(shape: int) -> int:
        keys = (shape, piped(shape)) if shape > 0 else (shape,)
        return max(len(paid.get((rows, k), ())) for k in keys)

    return next((shape for shape in shapes(max_depth) if have(shape) < ROUNDS), None)


def sizes_up_to(most: int) -> list[int]:
    """2, 4, 8, ... up to `most`, and `most` itself."""
    out, size = [], 2
    while size < most:
        out.append(size)
        size *= 2
    return [*out, most] if most >= 2 else []


def measure(runner: Preparing, most: int, told: Told | None = None, paid: Paid | None = None,
            seed: int = 0, stock: Stock | None = None) -> Paid:
    """Round times by (rows, shape) at every size of sizes_up_to(most), through the real
    engine, into `paid` (so an interrupted run leaves what it timed there); depths up to
    EXPLORE (deeper ones the policy extends, then times as it runs). A traced trunk's shapes
    are then timed stock too: `stock` gets the choice, `paid` the faster way's times."""
    passes = runner.trunk.passes
    if passes is not None and any(is_recurrent(c) for c in runner.trunk.make_cache()):
        passes = None  # recurrent layers' batch passes are never traced: nothing to compare
    sizes, order = sizes_up_to(most), shapes(deepest(runner))
    total = len(sizes) * len(order) * (2 if passes is not None else 1)
    paid = {} if paid is None else paid
    if told is not None:
        told("start", 0, total)
    if passes is not None:
        passes.stock_rows = {}  # traced first: every shape, whatever an older store chose
    _time(runner, sizes, paid, told, 0, total, seed)
    if passes is not None:
        untraced: Paid = {}
        passes.stock_everywhere = True
        try:
            _time(runner, sizes, untraced, told, total // 2, total, seed, " untraced")
        finally:
            passes.stock_everywhere = False
        chosen = choose(paid, untraced)
        paid.update({key: times for key, times in untraced.items()
                     if chosen.get((key[0], width(key[1])))})
        if stock is not None:
            stock.update(chosen)
    if told is not None:
        told("done", total, total)
    return paid


def _time(runner: Preparing, sizes: list[int], paid: Paid, told: Told | None, done: int,
          total: int, seed: int, how: str = "") -> None:
    """Every shape at every size, through a Scheduler driven by the timing policy."""
    curve = runner.costs()
    max_depth = deepest(runner)
    vocab = runner.trunk.args.vocab_size
    rng = random.Random(seed)
    order = shapes(max_depth)
    for size in sizes:
        policy = _Timing(curve, max_depth, paid=paid, size=size)
        scheduler = Scheduler(Batch(runner.trunk, runner.head), size, paid, solo=False)
        scheduler.policy = policy
        for _ in range(size):
            ids = [rng.randrange(vocab) for _ in range(curve.context)]
            scheduler.add(runner.prepare(ids, MAX_TOKENS, depth="auto", draft="head"))
        last = None
        while scheduler and not policy.done:
            scheduler.step()
            now = policy.wanted(size) if len(scheduler.active) == size else last
            if told is not None and now != last and now is not None:
                told(f"{size} rows, {_name(now)}{how}", done + order.index(now), total)
            last = now
        done += len(order)


def width(shape: int) -> int:
    """The positions per row of a pass of `shape` (plain: 1; depth K, pipelined or not: K+1)."""
    return shape + 1 if shape >= 0 else -shape  # (piped(K) = -1 - K; PIPED = piped(0))


def choose(traced: Paid, stock: Paid, margin: float = MARGIN) -> Stock:
    """Per (rows, width) timed both ways: whether the stock passes' shapes of that width
    (plain steps and rounds share width 1) cost under `margin` x the traced ones in sum of
    medians (near a tie tracing stays)."""
    sums: dict[tuple[int, int], list[float]] = {}
    for (rows, shape), times in traced.items():
        other = stock.get((rows, shape))
        if times and other:
            both = sums.setdefault((rows, width(shape)), [0.0, 0.0])
            both[0] += statistics.median(times)
            both[1] += statistics.median(other)
    return {key: s < margin * t for key, (t, s) in sums.items()}


def _name(shape: int) -> str:
    return "plain steps" if shape == PIPED else "plain rounds" if shape == 0 else f"depth {shape}"


def _path(key: dict[str, Any]) -> Path:
    return disk.cache_file({**key, "kind": "batch"}, ".batch.json")


def store(key: dict[str, Any], paid: Paid, stock: Stock | None = None) -> Path:
    """Atomically, beside the cost curve of the same key."""
    return disk.write(_path(key), {
        "key": key, "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "paid": {f"{rows},{shape}": list(times) for (rows, shape), times in paid.items()},
        "stock": {f"{rows},{w}": bool(faster) for (rows, w), faster in (stock or {}).items()}},
        "batch")


def _pairs(table: dict[str, Any]) -> dict[tuple[int, int], Any]:
    """{"rows,shape": v} (the schema's names) as {(rows, shape): v}."""
    return {(int(a), int(b)): v for a, b, v in ((*name.split(","), v) for name, v in table.items())}


def read(key: dict[str, Any]) -> tuple[Paid, Stock]:
    """The round times stored for `key` and which batch pass shapes were timed faster
    untraced, from one read of the store; {} for none, invalid (decoder/store.py says why) or
    another key's (and no choice from a store from before the comparison, or one interrupted
    during it: every shape stays traced)."""
    doc = disk.read(_path(key), "batch")
    doc = doc if doc is not None and doc["key"] == key else {}
    paid = {shape: deque(map(float, times), maxlen=WINDOW)
            for shape, times in _pairs(doc.get("paid", {})).items()}
    return paid, _pairs(doc.get("stock", {}))
