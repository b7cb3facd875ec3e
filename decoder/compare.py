"""MTP against plain decoding on the same runner and prompt: the speedup a user actually gets.

Both paths are warmed up first, plain runs before MTP, and both speeds are decode tok/s over the
decode window (never chunks per second), so the ratio is the honest one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtpkit.decoder.runner import Prompt, Result, Runner


@dataclass
class Comparison:
    plain: Result
    mtp: Result
    greedy: bool

    @property
    def speedup(self) -> float:
        base = self.plain.stats.decode_tps
        return self.mtp.stats.decode_tps / base if base > 0 else 0.0

    @property
    def identical(self) -> bool | None:
        """Greedy MTP output equals plain output (None when sampling: runs draw differently)."""
        return self.mtp.tokens == self.plain.tokens if self.greedy else None

    def to_dict(self) -> dict[str, Any]:
        return {"plain_decode_tps": self.plain.stats.decode_tps, "speedup": self.speedup,
                "tokens_identical": self.identical}


def _warm_up(runner: Runner, prompt: Prompt, depth: int, tokens: int = 8, **sampling: Any) -> None:
    """Decode `tokens` of `prompt` at `depth` and drop them, so that a timed run that follows
    pays no first-call costs (compiling its shapes); `tokens`: a few steps or rounds suffice,
    more only take longer."""
    runner.generate(prompt, tokens, depth=depth, **sampling)


Told = Callable[[int, int], None]  # (tokens decoded, of at most) of the reference run
Staged = Callable[[str, float | None], None]  # (what starts, the seconds it should take or None)


def baseline(runner: Runner, prompt: Prompt, max_tokens: int, depth: int,
             progress: Told | None = None, stage: Staged | None = None,
             **sampling: Any) -> Result:
    """Warm up plain and MTP decoding, then run plain decoding: the reference for `depth`.
    progress: told as the reference run's tokens come; stage: told as each warm-up and the
    reference's prefill start, with what the first warm-up took (each prefills the same
    prompt), so the seconds before the first token are not silent either."""
    took = None
    for i, d in enumerate((0, depth)):
        if stage is not None:
            stage(f"warm-up {i + 1} of 2 ({'plain' if d == 0 else f'depth {d}'})", took)
        start = time.perf_counter()
        _warm_up(runner, prompt, d, **sampling)
        took = time.perf_counter() - start if took is None else took
    if stage is not None:
        stage("the reference's prefill", took)
    done = 0
    for piece in runner.stream(prompt, max_tokens, depth=0, **sampling):
        done += len(piece.tokens)
        if progress is not None:
            progress(done, max_tokens)
        if piece.result is not None:
            return piece.result
    raise AssertionError("stream ended without a result")


def compare(runner: Runner, prompt: Prompt, max_tokens: int, depth: int,
            **sampling: Any) -> Comparison:
    plain = baseline(runner, prompt, max_tokens, depth, **sampling)
    mtp = runner.generate(prompt, max_tokens, depth=depth, **sampling)
    return Comparison(plain, mtp, sampling.get("temperature", 0.0) == 0.0)


def sweep(runner: Runner, prompt: Prompt, max_tokens: int, depths: list[int],
          **sampling: Any) -> dict[int, Comparison]:
    """MTP at each depth against one warmed plain run (depth -> Comparison)."""
    plain = baseline(runner, prompt, max_tokens, max(depths), **sampling)
    greedy = sampling.get("temperature", 0.0) == 0.0
    out = {}
    for depth in depths:
        _warm_up(runner, prompt, depth, **sampling)
        out[depth] = Comparison(plain, runner.generate(prompt, max_tokens, depth=depth,
                                                       **sampling), greedy)
    return out


def best_depth(comparisons: dict[int, Comparison]) -> int:
    """The fastest depth, or 0 when no depth beats plain decoding on this machine."""
    depth, best = max(comparisons.items(), key=lambda kv: kv[1].speedup)
    return depth if best.speedup > 1.0 else 0
