"""What a batch's rounds cost here, timed up front (`mtpkit tune --max-batch N`) and kept on disk.

`tune --max-batch N` runs the real engine (Scheduler, Batch, the cost table's own `observe`) on
synthetic prompts at 2, 4, ... N rows, choosing each shape still untimed (plain steps, every
depth up to DEEPEST) until each has ROUNDS times, and stores them beside the cost curve (same
key): later runners' cost tables start from those prices (`seed`). A traced trunk's shapes are
timed both ways, traced and stock, and the faster way is kept per (rows, width) (`choose`).
Stored keys: (rows, K) for a synchronous round at depth K, (rows, -1 - K) for a pipelined one
(-1: plain steps). Why: docs/tune.md, "Batched rounds".
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mtpkit.decoder.cache.caches import is_recurrent
from mtpkit.decoder.rounds.scheduler import Request, Scheduler
from mtpkit.decoder.tuning import store as disk
from mtpkit.decoder.tuning.policy import CostTable, Shape, memory

if TYPE_CHECKING:
    from mtpkit.decoder.model.head import MTPHead
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.options import Depth
    from mtpkit.decoder.tuning.curve import CostCurve
    from mtpkit.decoder.tuning.policy import DepthPolicy

ROUNDS = 5  # times per shape: their median seeds the table (a first one that compiled cannot move it)
DEEPEST = 3  # depths timed up front; deeper ones the prior prices and decoding corrects
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

    def scheduler(self, most: int, table: CostTable | None = None,
                  solo: bool = True) -> Scheduler: ...


def key(shape: Shape) -> int:
    """A pass shape's stored key at its rows (the module's doc)."""
    _, width, piped = shape
    return -width if piped else width - 1


def shape_of(rows: int, stored: int) -> Shape:
    """The pass shape a stored key stands for."""
    return (rows, -stored, True) if stored < 0 else (rows, stored + 1, False)


def seed(table: CostTable, paid: Paid) -> None:
    """Stored round times into a runner's cost table, as its first corrections."""
    for (rows, stored), times in paid.items():
        shape = shape_of(rows, stored)
        table.seed(shape, times, (shape[1] - 1) * table.draft)  # (head rounds)


def deepest(runner: Preparing) -> int:
    """The deepest depth timed up front: the runner's, at most DEEPEST."""
    return min(runner.policy("auto")[0], DEEPEST)


def shapes(max_depth: int) -> list[int]:
    """The depths timed at each size, in order (0: plain steps)."""
    return list(range(max_depth + 1))


def missing(paid: Paid, rows: int, max_depth: int) -> int | None:
    """The first depth at `rows` rows with fewer than ROUNDS times (0: plain steps; a round's
    pipelined or not), None when every one has them."""
    def have(depth: int) -> int:
        keys = (depth, -1 - depth) if depth > 0 else (key((rows, 1, True)),)
        return max(len(paid.get((rows, k), ())) for k in keys)

    return next((depth for depth in shapes(max_depth) if have(depth) < ROUNDS), None)


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
    DEEPEST. A traced trunk's shapes
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
    """Every shape at every size, through a Scheduler whose depths are the untimed shapes'."""
    curve = runner.costs()
    max_depth = deepest(runner)
    vocab = runner.trunk.args.vocab_size
    rng = random.Random(seed)
    order = shapes(max_depth)
    for size in sizes:
        table = CostTable(curve)
        scheduler = runner.scheduler(size, table, solo=False)
        finished: list[bool] = []

        def timed(size: int = size, table: CostTable = table) -> Paid:
            return {(size, key(shape)): times for shape, times in table.times.items()
                    if shape[0] == size}

        def depth(rows: list[Request], size: int = size, timed: Callable[[], Paid] = timed,
                  finished: list[bool] = finished) -> int:
            if len(rows) != size:
                return 0
            wanted = missing(timed(), size, max_depth)
            if wanted is None:
                finished.append(True)
            return wanted or 0

        scheduler.decider = depth
        for _ in range(size):
            ids = [rng.randrange(vocab) for _ in range(curve.context)]
            scheduler.add(runner.prepare(ids, MAX_TOKENS, depth="auto", draft="head"))
        last = None
        while scheduler and not finished:
            scheduler.step()
            now = missing(timed(), size, max_depth) if len(scheduler.active) == size else last
            if told is not None and now != last and now is not None:
                told(f"{size} rows, {_name(now)}{how}", done + order.index(now), total)
            last = now
        paid.update({k: deque(v, maxlen=memory()) for k, v in timed().items()})
        done += len(order)


def width(shape: int) -> int:
    """The positions per row of a pass of `shape` (plain: 1; depth K, pipelined or not: K+1)."""
    return shape_of(0, shape)[1]


def choose(traced: Paid, stock: Paid, margin: float = 0.95) -> Stock:
    """Per (rows, width) timed both ways: whether the stock passes' shapes of that width
    (plain steps and rounds share width 1) cost under `margin` x the traced ones in sum of
    medians (near a tie tracing stays: by default the stock pass must be 5% cheaper)."""
    sums: dict[tuple[int, int], list[float]] = {}
    for (rows, shape), times in traced.items():
        other = stock.get((rows, shape))
        if times and other:
            both = sums.setdefault((rows, width(shape)), [0.0, 0.0])
            both[0] += statistics.median(times)
            both[1] += statistics.median(other)
    return {key: s < margin * t for key, (t, s) in sums.items()}


def _name(depth: int) -> str:
    return "plain steps" if depth == 0 else f"depth {depth}"


def store(key: dict[str, Any], paid: Paid, stock: Stock | None = None) -> Path:
    """Atomically, beside the cost curve of the same key."""
    return disk.write(disk.batch_file(key), {
        "key": key, "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "paid": {f"{rows},{shape}": list(times) for (rows, shape), times in paid.items()},
        "stock": {f"{rows},{w}": bool(faster) for (rows, w), faster in (stock or {}).items()}},
        "batch")


def _pairs(table: dict[str, Any]) -> dict[tuple[int, int], Any]:
    """{"rows,shape": v} (the schema's names) as {(rows, shape): v}."""
    return {(int(a), int(b)): v for a, b, v in ((*name.split(","), v) for name, v in table.items())}


def read(key: dict[str, Any]) -> tuple[Paid, Stock]:
    """The round times stored for `key` and which batch pass shapes were timed faster
    untraced, from one read of the store; {} for none, invalid (decoder/tuning/store.py says why) or
    another key's, or judged stale by a later process (decoder/tuning/costs.py's check_batch; no
    choice either from a store from before the comparison, or one interrupted during it: every
    shape stays traced)."""
    doc = disk.read(disk.batch_file(key), "batch")
    doc = doc if doc is not None and doc["key"] == key and "stale" not in doc else {}
    paid = {shape: deque(map(float, times), maxlen=memory())
            for shape, times in _pairs(doc.get("paid", {})).items()}
    return paid, _pairs(doc.get("stock", {}))
