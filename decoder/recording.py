"""Recurrent states recorded position by position during the verify pass.

mlx-lm's linear-attention layers (GatedDeltaNet) keep a conv and a recurrent state that cannot be
trimmed, and their chunked call returns only the final state. Wrapping the layer's module so that,
while recording, it steps through the verify tokens one at a time (the same calls plain decoding
makes) yields the state after every position; committing k kept tokens then picks state k, with no
replay of the trunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.loaders.families import RECURRENT_ATTRIBUTES


class StepRecorder(nn.Module):
    """A recurrent mixer that, while `recording`, keeps its cache state after each position."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.recording = False
        self.states: list[list[Any]] = []
        self.cache: Any = None

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        if not self.recording or cache is None:
            return self.inner(x, mask, cache)
        self.cache, self.states, outs = cache, [], []
        for i in range(x.shape[1]):
            step_mask = None if mask is None else mask[..., i:i + 1]
            outs.append(self.inner(x[:, i:i + 1], step_mask, cache))
            self.states.append(list(cache.cache))
        return mx.concatenate(outs, axis=1)

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


def install(layers: list[nn.Module]) -> list[StepRecorder]:
    """Wrap every recurrent mixer among the trunk layers (nothing else changes)."""
    recorders = []
    for layer in layers:
        for attr in RECURRENT_ATTRIBUTES:
            if attr in layer and not isinstance(layer[attr], StepRecorder):
                recorder = StepRecorder(layer[attr])
                setattr(layer, attr, recorder)
                recorders.append(recorder)
    return recorders


def unwrapped_name(param: str) -> str:
    """A trunk parameter path with the recorder wrapping removed: the name mlx-lm stores."""
    for attr in RECURRENT_ATTRIBUTES:
        param = param.replace(f".{attr}.inner.", f".{attr}.")
    return param
