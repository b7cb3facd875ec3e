"""Recurrent states recorded position by position during the verify pass.

mlx-lm's linear-attention layers (GatedDeltaNet) keep a conv and a recurrent state that cannot be
trimmed, and their call returns only the final state. While recording, a wrapper around the
layer's module keeps the state after every position, so committing k kept tokens picks state
k - 1, with no replay of the trunk. Two ways, the same states:

- steps: the verify tokens one at a time (the calls plain decoding makes). Cheapest where the
  pass is built op by op (T small calls against one T²-row call: 60 against 114 ms for T = 4 on
  a small Qwen3.5-shaped trunk, this CPU).
- prefixes: one call on a batch of the pass's prefixes, row i holding the T inputs with a
  length of i + 1 (mlx-lm's own batch API for right-padded rows, `ArraysCache.prepare(lengths=)`:
  positions past a row's length change neither its conv window nor its state), so row i ends
  with the state after position i and the last row's output is the pass's. The weights are read
  once and the op count does not grow with T: what a traced pass (decoder/traced.py) replays
  (H200, Qwen3.5-9B-shaped 4-bit oracle, depth 3: 1.05x of plain decoding; steps traced 0.56x).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from mtpkit.loaders.families import RECURRENT_ATTRIBUTES


class StateRecorder(nn.Module):
    """A recurrent mixer that, while `recording`, keeps its cache state after each position
    (`states[i]`: the cache's arrays after verify position i). `prefixes`: one batched call
    instead of one call per position (see the module docstring)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.recording = False
        self.prefixes = False
        self.states: list[list[mx.array]] = []
        self.cache: Any = None

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if not self.recording or cache is None:
            return self.inner(x, mask, cache)
        rows = x.shape[1]
        if not self.prefixes or rows == 1:
            outs, states = [], []
            for i in range(rows):
                step_mask = None if mask is None else mask[..., i:i + 1]
                outs.append(self.inner(x[:, i:i + 1], step_mask, cache))
                states.append(list(cache.cache))
            self.adopt(cache, states)
            return mx.concatenate(outs, axis=1)
        batch = ArraysCache(len(cache.cache))
        batch.cache = [None if c is None else mx.repeat(c, rows, axis=0) for c in cache.cache]
        batch.prepare(lengths=list(range(1, rows + 1)))
        out = self.inner(mx.repeat(x, rows, axis=0), batch.make_mask(rows), batch)
        self.adopt(cache, [[c[i:i + 1] for c in batch.cache] for i in range(rows)])
        cache.cache = list(self.states[-1])
        return out[-1:]

    def adopt(self, cache: Any, states: list[list[mx.array]]) -> None:
        """Take `states` (per position) as the ones recorded for `cache` (a traced pass hands
        them back from outside the trace)."""
        self.cache, self.states = cache, states

    def commit(self, position: int) -> None:
        """Restore the state after verify position `position` (0 = the first token)."""
        self.cache.cache = list(self.states[position])
        self.states = []


def recorded(recorders: list[Any], record: bool, run: Callable[[], mx.array]) -> mx.array:
    """run() with the recorders recording when `record` (the layers read the flag during the
    call: mlx-lm's model passes them no argument of ours)."""
    if not record or not recorders:
        return run()
    for recorder in recorders:
        recorder.recording = True
    try:
        return run()
    finally:
        for recorder in recorders:
            recorder.recording = False


def install(layers: list[nn.Module]) -> list[StateRecorder]:
    """Wrap every recurrent mixer among the trunk layers (nothing else changes)."""
    recorders = []
    for layer in layers:
        for attr in RECURRENT_ATTRIBUTES:
            if attr in layer and not isinstance(layer[attr], StateRecorder):
                recorder = StateRecorder(layer[attr])
                setattr(layer, attr, recorder)
                recorders.append(recorder)
    return recorders


def unwrapped_name(param: str) -> str:
    """A trunk parameter path with the recorder wrapping removed: the name mlx-lm stores."""
    for attr in RECURRENT_ATTRIBUTES:
        param = param.replace(f".{attr}.inner.", f".{attr}.")
    return param
