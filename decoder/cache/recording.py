"""Recurrent rollback by replay: a verify pass keeps what the recurrence consumed, a commit
replays the kept positions.

mlx-lm's linear-attention layers (GatedDeltaNet) keep a conv and a recurrent state that cannot be
trimmed, and their call returns only the final state. While recording, a `StateRecorder` around
the layer's module runs it once over the pass, as plain prefill would, and keeps the state it
started from and the outputs of the layer's linears (`Tap`s: the projections of every position,
which is where the layer reads its weights). Committing k of the pass's T positions with k < T
runs the layer again from that start state over those k positions with its linears played back
(no weight read) and keeps the cache it leaves; in a batch, whose rows keep different counts,
over all T with mlx-lm's right-padded batch API saying each row's length
(`ArraysCache.lengths`: positions past it change neither the conv window nor the state). The
layer's output of that call is never read, so MLX never computes it. A pass whose rows all keep
T positions needs nothing: it left their state.

So a verify pass costs what prefill of T tokens costs, with no T² rows and no T one-token calls
(each of which reads the weights again), and a rejection costs the recurrence over the kept
positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.loaders.families import RECURRENT_ATTRIBUTES

LINEARS = (nn.Linear, nn.QuantizedLinear)


class Tap(nn.Module):
    """One linear of a recurrent mixer: `mode` "keep" remembers its output, "play" returns it
    instead of reading the weights (a linear's rows are independent, so the kept rows are the
    ones a replay of the same positions would compute)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.tapped = layer
        self.mode = ""
        self._out: mx.array | None = None  # (underscored: not a parameter)

    def __call__(self, x: mx.array) -> mx.array:
        if self.mode == "play" and self._out is not None:
            return self._out
        out = self.tapped(x)
        if self.mode == "keep":
            self._out = out
        return out


class StateRecorder(nn.Module):
    """A recurrent mixer that, while `recording`, keeps what `commit` needs to replay a kept
    prefix of the pass (see the module docstring)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.recording = False
        self.cache: Any = None
        self._start: list[Any] = []  # the cache's arrays before the pass
        self._inputs: mx.array | None = None
        self._mask: mx.array | None = None
        self._kwargs: dict[str, Any] = {}  # the call's keywords (Ling 2.5's rope offset)
        self.exported: tuple[str, ...] = ()  # of those, the arrays a traced pass hands out
        for name, child in list(inner.children().items()):
            if isinstance(child, LINEARS):
                setattr(inner, name, Tap(child))

    @property
    def taps(self) -> list[Tap]:
        return [m for m in self.inner.children().values() if isinstance(m, Tap)]

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None,
                 **kwargs: Any) -> mx.array:
        if not self.recording or cache is None:
            return self.inner(x, mask, cache, **kwargs)
        self.adopt(cache, list(cache.cache), x, mask, kwargs=kwargs)
        return self._with_taps("keep", lambda: self.inner(x, mask, cache, **kwargs))

    def _with_taps(self, mode: str, run: Callable[[], mx.array]) -> mx.array:
        taps = self.taps
        for tap in taps:
            tap.mode = mode
        try:
            return run()
        finally:
            for tap in taps:
                tap.mode = ""

    def kept(self) -> list[mx.array]:
        """What a traced pass hands out for this layer: its input, every tap's output and
        the call's array keywords (`exported`, named while tracing)."""
        outputs = [tap._out for tap in self.taps]
        assert self._inputs is not None and all(o is not None for o in outputs)
        self.exported = tuple(k for k, v in self._kwargs.items() if isinstance(v, mx.array))
        return [self._inputs, *outputs, *(self._kwargs[k] for k in self.exported)]

    def adopt(self, cache: Any, start: list[Any], inputs: mx.array | None,
              mask: mx.array | None = None, outputs: list[mx.array] | None = None,
              kwargs: dict[str, Any] | None = None) -> None:
        """Take `cache` (and the arrays it held before the pass, the layer's input, mask and
        keywords, and, from a traced pass, each tap's output) as what this pass recorded."""
        self.cache, self._start, self._inputs, self._mask = cache, start, inputs, mask
        self._kwargs = kwargs or {}
        if outputs is not None:
            for tap, out in zip(self.taps, outputs, strict=True):
                tap._out = out

    def commit(self, keep: int | mx.array) -> None:
        """Keep the first `keep` positions of the recorded pass: an int, or one per row (B,)."""
        x, cache, mask = self._inputs, self.cache, self._mask
        if x is None or cache is None:
            return
        if isinstance(keep, int) and keep < x.shape[1]:  # one length: replay only those
            x, mask = x[:, :keep], None if mask is None else mask[:, :keep]
            for tap in self.taps:
                tap._out = None if tap._out is None else tap._out[:, :keep]
            cache.cache = list(self._start)
            self._with_taps("play", lambda: self.inner(x, mask, cache, **self._kwargs))
        elif not isinstance(keep, int):  # a length per row: mlx-lm's right-padded batch
            after = cache.left_padding, cache.lengths
            cache.cache, cache.left_padding = list(self._start), None
            cache.lengths = mx.broadcast_to(keep, (x.shape[0],))
            held = cache.make_mask(x.shape[1])
            try:
                self._with_taps("play", lambda: self.inner(
                    x, held if mask is None else held & mask, cache, **self._kwargs))
            finally:
                cache.left_padding, cache.lengths = after
        self.release()

    def release(self) -> None:
        """Forget the pass (a trace's stand-ins must not outlive it)."""
        self.adopt(None, [], None)
        for tap in self.taps:
            tap._out = None


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
        for attr, kind in RECURRENT_ATTRIBUTES.items():
            if attr in layer and not isinstance(layer[attr], StateRecorder) and (
                    kind is None or getattr(layer, kind[0], None) == kind[1]):
                recorder = StateRecorder(layer[attr])
                setattr(layer, attr, recorder)
                recorders.append(recorder)
    return recorders


def unwrapped_name(param: str) -> str:
    """A trunk parameter path with the recorder wrapping removed: the name mlx-lm stores."""
    for attr in RECURRENT_ATTRIBUTES:
        param = param.replace(f".{attr}.inner.", f".{attr}.")
    return param.replace(".tapped.", ".")
