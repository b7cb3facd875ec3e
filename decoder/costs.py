"""What a round costs on this machine: the trunk's verify curve c(T), a head draft and a plain step.

Speculation pays only where E[tokens per round] / (K * draft + c(K + 1)) beats one token per plain
step, and c(T) is a property of the machine, the backend and the weights (a GPU verifies a few rows
for about the price of one only when its kernels cooperate). So it is measured, not assumed: once
per bundle, load options, backend and versions, and cached on disk (`mtpkit tune` prints it).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mtpkit.decoder.state import rewind, snapshot

if TYPE_CHECKING:
    from mtpkit.decoder.runner import Runner

MAX_ROWS = 16
CONTEXT = 512  # cache length the curve is measured at (a typical verify position)
REPEATS = 7
PLAIN_STEPS = 32
VERSION = 1  # bump when what is measured changes
PAD_GAIN = 0.9  # pad a verify to a wider width only when that is 10% cheaper: a real kernel
# switch (MLX's quantized matmul from 8 rows on), not the noise between two medians


@dataclass
class CostCurve:
    """Seconds: verify[T - 1] is one trunk pass over T rows (logits for all, synchronous);
    plain is one pipelined plain-decoding step; draft one chained head step (0: no head)."""

    verify: list[float]
    plain: float
    draft: float
    key: dict[str, Any] = field(default_factory=dict)
    estimate: bool = False  # timed on this machine: an estimate generations correct as they go
    # (decoder/policy.py); False: given by hand, a what-if taken as it is

    def width(self, rows: int) -> int:
        """The verify width to run `rows` rows at: the cheapest measured width >= rows where it
        is PAD_GAIN cheaper, else rows (extra rows are padding whose outputs are ignored)."""
        if rows > len(self.verify):
            return rows
        return self._widths[rows - 1]

    @cached_property
    def _widths(self) -> list[int]:  # asked for several times per round: computed once
        n, out = len(self.verify), []
        for rows in range(1, n + 1):
            wider = min(range(rows, n + 1), key=lambda t: (self.verify[t - 1], t))
            cheaper = self.verify[wider - 1] < PAD_GAIN * self.verify[rows - 1]
            out.append(wider if cheaper else rows)
        return out

    def round_cost(self, depth: int, drafted: int | None = None) -> float:
        """Seconds for one round of `depth` drafts, `drafted` of them by the head (default:
        all; context drafts are free) (0: one plain step)."""
        if depth == 0:
            return self.plain
        drafted = depth if drafted is None else drafted
        return drafted * self.draft + self.verify[self.width(depth + 1) - 1]

    def ratios(self) -> list[float]:
        """c(T) / c(1)."""
        return [c / self.verify[0] for c in self.verify]

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "estimate"}  # how it is used,
        # not what was measured
        return {**data, "ratios": self.ratios(),
                "widths": [self.width(t) for t in range(1, len(self.verify) + 1)]}


def _versions() -> dict[str, str | None]:
    out = {}
    for package in ("mlx", "mlx-lm", "mtpkit"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


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
            "versions": _versions(), "format": VERSION}


def cache_dir() -> Path:
    base = os.environ.get("MTPKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mtpkit")
    return Path(base) / "costs"


def _cache_path(key: dict[str, Any]) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / f"{name}.json"


def cached(key: dict[str, Any]) -> CostCurve | None:
    path = _cache_path(key)
    try:
        data = json.loads(path.read_text())
        curve = CostCurve(list(map(float, data["verify"])), float(data["plain"]),
                          float(data["draft"]), data["key"], estimate=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return curve if curve.key == key and len(curve.verify) == MAX_ROWS else None


def store(curve: CostCurve) -> Path:
    """Write atomically (a temp file renamed over): concurrent processes never read half."""
    path = _cache_path(curve.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(curve.to_dict(), indent=1))
    os.replace(tmp, path)
    return path


def _median_time(run: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(runner: Runner, context: int = CONTEXT, repeats: int = REPEATS,
            bounded: bool | None = None) -> CostCurve:
    """Time the trunk at T = 1..MAX_ROWS rows at a `context`-token cache (each shape warmed up
    first, so compiles are not counted), a pipelined plain step and a head draft step.
    bounded: the session's attention shapes (default: as decoding runs on this backend)."""
    from mtpkit.decoder.sampling import SamplingParams, greedy
    from mtpkit.decoder.session import Session

    vocab = runner.trunk.args.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(context)]
    session = Session(runner.trunk, runner.head, SamplingParams(), 1 if runner.head else 0,
                      bounded=bounded)
    session.start(ids)
    cache = session.cache

    def verify(rows: int) -> None:
        saved = snapshot(cache)
        _, logits = runner.trunk(mx.array(ids[:rows])[None], cache)
        mx.eval(greedy(logits[0]))
        rewind(cache, saved, rows, 0)

    curve = []
    for rows in range(1, MAX_ROWS + 1):
        verify(rows)  # warm-up: the first use of a shape may compile
        curve.append(_median_time(lambda rows=rows: verify(rows), repeats))

    def plain() -> None:
        saved = snapshot(cache)
        for _ in session.plain_steps(PLAIN_STEPS):
            pass
        rewind(cache, saved, PLAIN_STEPS, 0)

    plain()
    step = _median_time(plain, max(3, repeats // 2)) / PLAIN_STEPS
    draft = session.draft_step_time(repeats) if runner.head is not None else 0.0
    return CostCurve(curve, step, draft, estimate=True)


def costs_for(runner: Runner, refresh: bool = False) -> CostCurve:
    """The runner's cost curve: cached for a bundle-loaded runner, else measured now."""
    key = cache_key(runner.root, runner.load_options) if runner.root is not None else None
    if key is not None and not refresh and (found := cached(key)) is not None:
        return found
    curve = measure(runner)
    if key is not None:
        curve.key = key
        store(curve)
    return curve
