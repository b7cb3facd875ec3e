"""Traced verify passes (decoder/model/traced.py): the traced pass computes what the stock bounded pass
computes, decoding with it is greedy-identical and keeps the sampled law, it is traced once per
shape (not once per round), and a trunk or cache it cannot take gets the stock pass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2
from test_exactness import ALPHA, markov_statistic
from test_shapes import PROMPT, verify_passes

import mtpkit
from fixtures.drive import generate_ids
from mtpkit.decoder.model.trunk import Trunk
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import SamplingParams

TRACEABLE = ("llama", "mimo", "deepseek_v3")  # deepseek_v3's attention selects with a bool mask


def _traced(trunk: Trunk) -> list[tuple[int, ...]]:
    """Turn traced passes on; the returned list collects the token shape of each traced call."""
    trunk.use_traced()
    assert trunk.passes is not None
    calls: list[tuple[int, ...]] = []

    def spy(fn: Callable[..., tuple[mx.array, ...]]) -> Callable[..., tuple[mx.array, ...]]:
        def called(*args: mx.array) -> tuple[mx.array, ...]:
            calls.append(tuple(args[0].shape))
            return fn(*args)
        return called

    trunk.passes._fns = {record: spy(fn) for record, fn in trunk.passes._fns.items()}
    return calls


@pytest.mark.parametrize("family", TRACEABLE)
def test_traced_passes_compute_what_stock_passes_compute(built: Callable[..., Path],
                                                         family: str) -> None:
    """float32, after rollbacks that leave stale rows past the offset: a traced pass that wrote
    at the wrong position, or attended to a stale or future row, moves logits by tenths."""
    runner = mtpkit.load(built(family), dtype="float32")
    want = verify_passes(runner.trunk, runner.trunk.make_cache(bounded=True))
    calls = _traced(runner.trunk)
    got = verify_passes(runner.trunk, runner.trunk.make_cache(bounded=True))
    assert calls == [(1, 3), (1, 1), (1, 5), (1, 1), (1, 2), (1, 1), (1, 4), (1, 1)]
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def recorded_passes(trunk: Trunk) -> list[np.ndarray]:
    """Prefill, then recording verify passes of several widths, each committing a kept prefix
    by replay (recurrent layers) and trims (attention), then one-row steps: every logits, and
    every recurrent state after each commit."""
    from mtpkit.decoder.cache.state import commit_recorded

    cache = trunk.make_cache(bounded=True)
    out = []
    _, logits = trunk(mx.array([PROMPT]), cache)
    out.append(np.array(logits[0, -1]))
    for width, keep in ((3, 1), (5, 5), (2, 1), (4, 2), (4, 3)):
        _, logits = trunk(mx.array([[9, 4, 11, 2, 8][:width]]), cache, record=True)
        out.append(np.array(logits[0]))
        commit_recorded(cache, trunk.recorders, width, keep)
        out += [np.array(a) for c in cache if not c.is_trimmable() for a in c.cache]
        _, logits = trunk(mx.array([[6]]), cache)
        out.append(np.array(logits[0]))
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_traced_recording_passes_compute_what_stock_passes_compute(
        built: Callable[..., Path], family: str) -> None:
    """Hybrid trunks (GatedDeltaNet and attention), float32: traced recording passes give the
    stock pass's logits and, after each commit of a kept prefix, the stock replayed conv and
    recurrent states (a state replayed over the wrong positions or layer moves them by far
    more)."""
    runner = mtpkit.load(built(family), dtype="float32")
    want = recorded_passes(runner.trunk)
    calls = _traced(runner.trunk)
    got = recorded_passes(runner.trunk)
    assert calls == [(1, width) for w in (3, 5, 2, 4, 4) for width in (w, 1)]
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mimo", "deepseek_v3", "qwen3_5"])
def test_traced_decoding_is_greedy_identical(built: Callable[..., Path], family: str) -> None:
    """The same tokens as unbounded plain decoding at depths 0, 1 and 3, every round traced
    (qwen3_5's recurrent layers too)."""
    loaded = mtpkit.load(built(family), dtype="float32")
    runner = Runner(loaded.trunk, loaded.head, None)
    plain = Session(runner.trunk, runner.head, SamplingParams(), 0, bounded=False)
    want = [t for b in generate_ids(plain, PROMPT, 48, set()) for t in b]
    calls = _traced(runner.trunk)
    for depth in (0, 1, 3):
        session = Session(runner.trunk, runner.head, SamplingParams(), depth)
        assert session.bounded  # traced passes bring bounded caches with them
        got = [t for b in generate_ids(session, PROMPT, 48, set()) for t in b]
        assert got == want, (family, depth)
    assert calls


def test_one_trace_per_shape_not_per_round(built: Callable[..., Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Depth-2 rounds over 60 tokens: every round is a traced call, but the forward runs in
    Python (is traced) only once per (rows, key buffer) shape."""
    loaded = mtpkit.load(built("mimo"), dtype="float32")
    runner = Runner(loaded.trunk, loaded.head, None)
    calls = _traced(runner.trunk)
    traces: list[int] = []
    forward = runner.trunk.forward

    def counted(tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        traces.append(tokens.shape[1])
        return forward(tokens, cache)

    monkeypatch.setattr(runner.trunk, "forward", counted)
    session = Session(runner.trunk, runner.head, SamplingParams(), 2)
    list(generate_ids(session, PROMPT, 60, set()))
    assert len(calls) >= session.stats.verify_calls >= 20  # (a last one-token round is not
    # counted as a verify)
    # the prompt and the output fit one 512-key buffer: one trace per width (3, and the last
    # rounds' 2 and 1, where fewer tokens are left than the depth drafts)
    assert sorted(traces) == [1, 2, 3], traces


def test_an_untraceable_forward_falls_back_for_good(built: Callable[..., Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A family whose forward reads the cache offset as a Python number cannot be traced: the
    first pass falls back to the stock pass (same logits, caches untouched by the attempt) and
    later passes do not try again."""
    runner = mtpkit.load(built("llama"), dtype="float32")
    want = verify_passes(runner.trunk, runner.trunk.make_cache(bounded=True))
    calls = _traced(runner.trunk)
    forward = runner.trunk.forward

    def reads_offset(tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        if int(cache[0].offset) < 0:  # a number only the host can know
            raise AssertionError
        return forward(tokens, cache)

    monkeypatch.setattr(runner.trunk, "forward", reads_offset)
    got = verify_passes(runner.trunk, runner.trunk.make_cache(bounded=True))
    assert runner.trunk.passes is not None and runner.trunk.passes.broken
    assert calls == [(1, 3)]  # tried once
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_traced_rounds_emit_the_target_law() -> None:
    """The Markov chi-square of test_exactness (depths 2, 3 and 4, top-p with min-p), with the
    trunk's verify passes traced."""
    stat, df = markov_statistic("top_p_min_p", traced=True)
    assert chi2.sf(stat, df) > ALPHA, (stat, df)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_traced_write_puts_the_rows_where_slice_update_does(dtype: mx.Dtype) -> None:
    """The traced passes scatter a pass's rows into the key and value buffers (MLX's CUDA
    backend copies the whole buffer for `mx.slice_update` at an array offset): the result is
    mlx's own op's, bit for bit, eagerly and inside `mx.compile`, at the start, middle and end
    of the buffer, and rows of another dtype are cast as slice_update casts them."""
    from mtpkit.decoder.model.traced import _write

    buffer = mx.random.normal((2, 3, 64, 8)).astype(dtype)
    rows = mx.random.normal((2, 3, 4, 8))  # float32: cast on the way in
    traced = mx.compile(_write)
    for at in (0, 29, 60):
        start = mx.array(at, mx.int32)
        want = mx.slice_update(buffer, rows, start[None], axes=(2,))
        for got in (_write(buffer, rows, start), traced(buffer, rows, start)):
            assert got.dtype == dtype
            assert mx.array_equal(got, want).item(), at
