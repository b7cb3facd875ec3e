"""Batches of sliding windows and DSA caches (decoder/cache/batch_cache.py): each row decodes as alone.

A sliding window (mlx-lm's RotatingKVCache) joins a batch as mlx-lm's BatchRotatingKVCache,
whose rows roll their rejected positions into their left padding after each pass
(`RowRotatingKVCache.settle`); a DSA layer's CacheList holds a RowKVCache of its latent KV and
one of its indexer keys; the MTP head's window blocks mask their window over holes.

1. The batched window itself, against full-history attention: rows joining and leaving, one-
   position passes rotating in place and longer ones rolling each row's rejected positions by
   its own count, every kept query attends to exactly its row's last `window` keys; a row's
   view (what Gemma 4's assistant reads) and its extraction hold what its cache alone holds.
2. Whole batches, for a Gemma-4-shaped trunk (an 8-position window), a MiMo-V2-Flash-shaped
   one (128) with its head, GLM-5 and DeepSeek-V3.2 (DSA): prompts longer than the window,
   rows at different depths and sources joining as others leave and the last one decoding
   solo again; every row's tokens and acceptance counts equal its lone decoding. These
   batches were refused before (options.invalid); the refusal holds for what still cannot
   batch (a window that keeps a prefix).
3. Forced rejections: an oracle head wrong at a fifth of each row's positions, so rows keep
   0..K drafts in one pass and the windows wrap within rounds; every row decodes its plain
   greedy tokens, synchronous and pipelined (rounds queued before the last one's verdicts).
4. Seeded rows at temperature 0.6 (top-p 0.95, top-k 20) sample the same text alone and
   batched.

Mutants these tests kill (each applied by hand to a copy of the tree, 2026-11-29):
- the window's rollback rolling every row by the batch's widest rejection (`width -
  keep.min()`), or by one position less (`width - keep - 1`): the randomized window test
  (every seed) and the forced rejections of the Gemma 4 and MiMo-V2 trunks;
- a join adding its padding to a wrapped row's negative left padding (mlx-lm's own extend):
  `test_a_wrapped_row_gains_no_key_when_a_longer_row_joins` (and one randomized seed);
- the mask of a pass over a rotated buffer taken as mlx-lm takes it: two randomized seeds and
  the seeded MiMo-V2 batch;
- the head's window blocks masked without their window: the seeded MiMo-V2 batch (where the
  MiMo-V2 head runs).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import RotatingKVCache
from test_batch import _oracle_batch, _pipelined_seen, _same, _streamed

import mtpkit
from fixtures.gemma4 import build_target
from fixtures.heads import build_head_hf
from mtpkit.convert.convert import ConvertOptions, convert
from mtpkit.convert.sidecar import SidecarOptions
from mtpkit.convert.trunk import QuantOptions
from mtpkit.decoder.cache.batch_cache import RowRotatingKVCache
from mtpkit.decoder.cache.caches import batchable
from mtpkit.decoder.options import OptionError
from mtpkit.decoder.runner import Runner

WINDOWS = {"gemma4": 8, "mimo_v2_flash": 128}  # the fixtures' sliding windows
FAMILIES = ("gemma4", "mimo_v2_flash", "glm_moe_dsa", "deepseek_v32")


def _text(n: int, step: int) -> list[int]:
    """n token ids in a short cycle: context drafts find matches."""
    return [(step * i + 3) % 97 + 2 for i in range(n)]


# -- 1. the batched window ---------------------------------------------------------------

def _key(row: int, position: int, attempt: int, width: int = 4) -> np.ndarray:
    """The key (and value) a row writes at a position in one pass: a rejected position's
    differs from the one kept there later."""
    return np.random.default_rng([row, position, attempt]).standard_normal(width, np.float32)


def _windowed(q: np.ndarray, keys: list[np.ndarray], p: int, window: int) -> np.ndarray:
    """Attention of the query at position p over keys (p - window, p] (mlx-lm's window)."""
    k = np.array(keys[max(0, p - window + 1):p + 1])
    s = np.exp(k @ q - (k @ q).max())
    return (s / s.sum()) @ k


class _Rows:
    """Rows of a RowRotatingKVCache beside each row's committed keys and what its cache alone
    would hold (`held`: mlx-lm's RotatingKVCache keeps window - 1 keys plus a longer pass's)."""

    def __init__(self, window: int, rng: random.Random) -> None:
        self.window, self.rng = window, rng
        self.cache: RowRotatingKVCache | None = None
        self.keys: list[list[np.ndarray]] = []
        self.held: list[int] = []
        self.ids: list[int] = []
        self.passes = self.joined = 0

    def join(self, prompt: int | None = None, steps: int | None = None) -> None:
        """A row prefilled alone (one pass of `prompt` positions, then `steps` one-position
        steps; random where not given) joins."""
        row, alone = self.joined, RotatingKVCache(self.window)
        self.joined += 1
        prompt = self.rng.randint(1, 3 * self.window) if prompt is None else prompt
        keys = [_key(row, p, 0) for p in range(prompt)]
        alone.update_and_fetch(*[mx.array(np.array(keys))[None, None]] * 2)
        for _ in range(self.rng.randint(0, 2 * self.window) if steps is None else steps):
            keys.append(_key(row, len(keys), 0))
            alone.update_and_fetch(*[mx.array(keys[-1])[None, None, None]] * 2)
        one = RowRotatingKVCache.of(alone)
        if self.cache is None:
            self.cache = one
        else:
            self.cache.extend(one)
        self.keys.append(keys)
        self.held.append(one.keys.shape[2])
        self.ids.append(row)

    def leave(self, b: int) -> None:
        assert self.cache is not None
        stay = [i for i in range(len(self.keys)) if i != b]
        self.cache.filter(mx.array(stay))
        self.keys, self.held, self.ids = ([x[i] for i in stay]
                                          for x in (self.keys, self.held, self.ids))

    def run(self, width: int) -> None:
        """One pass of `width` positions; each row keeps a random count of its real ones."""
        assert self.cache is not None
        rows, self.passes = len(self.keys), self.passes + 1
        new = np.array([[[_key(self.ids[b], len(self.keys[b]) + i, self.passes)
                          for i in range(width)]] for b in range(rows)])
        queries = np.random.default_rng(self.passes).standard_normal(new.shape, np.float32)
        mask = self.cache.make_mask(width, window_size=self.window)
        keys, values = self.cache.update_and_fetch(mx.array(new), mx.array(new))
        out = np.array(scaled_dot_product_attention(
            mx.array(queries), keys, values, cache=self.cache, scale=1.0, mask=mask))
        keep = [self.rng.randint(1, width) for _ in range(rows)]
        for b in range(rows):
            seen = self.keys[b] + list(new[b, 0])
            for i in range(keep[b]):
                want = _windowed(queries[b, 0, i], seen, len(self.keys[b]) + i, self.window)
                np.testing.assert_allclose(out[b, 0, i], want, atol=1e-5)
            self.keys[b] += list(new[b, 0, :keep[b]])
            self.held[b] = (min(self.held[b], self.window - 1) + keep[b] if width > 1
                            else self.held[b] + 1 if self.held[b] < self.window else self.window)
        if width > 1:
            self.cache.settle(mx.array(keep), width)

    def check_views(self) -> None:
        """Each row's view holds the keys its cache alone would hold, in position order."""
        assert self.cache is not None
        for b, keys in enumerate(self.keys):
            k, _, real = self.cache.row(b, 1 << 20)
            got = np.array(k)[0, 0][np.array(real)]
            np.testing.assert_array_equal(got, np.array(keys[-self.held[b]:]))


@pytest.mark.parametrize("seed", range(30))
def test_a_batched_window_attends_as_each_row_alone(seed: int) -> None:
    rng = random.Random(seed)
    rows = _Rows(8, rng)
    for _ in range(70):
        op = rng.random()
        if rows.cache is None or op < 0.12 and len(rows.keys) < 4:
            rows.join()
        elif op < 0.2 and len(rows.keys) > 1:
            rows.leave(rng.randrange(len(rows.keys)))
        else:
            rows.run(1 if op < 0.5 else rng.randint(2, 6))
        rows.check_views()
    assert rows.cache is not None
    for b, keys in enumerate(rows.keys):  # what a row that decodes alone again takes
        alone = rows.cache.extract(b)
        ordered = np.array(alone._temporal_order(alone.keys))[0, 0]
        np.testing.assert_array_equal(ordered, np.array(keys[-rows.held[b]:]))


def test_a_wrapped_row_gains_no_key_when_a_longer_row_joins() -> None:
    """A row whose window wrapped in place (its left padding below zero) is padded on the
    left for a joiner holding more keys: its view still holds its own keys only (mlx-lm's
    extend added the padding to the negative count, and a pad column passed for a key)."""
    rows = _Rows(8, random.Random(0))
    rows.join(prompt=5, steps=0)
    rows.run(3)  # a longer pass: the buffer holds more than the window
    for _ in range(4):
        rows.run(1)  # in place: the window wraps
    rows.join(prompt=20, steps=0)
    rows.check_views()
    rows.run(2)
    rows.check_views()


def test_a_window_that_keeps_a_prefix_still_joins_no_batch() -> None:
    assert batchable([RotatingKVCache(8)])
    assert not batchable([RotatingKVCache(8, keep=4)])


# -- 2. whole batches ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def runners(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Runner]:
    """family -> a float32 runner of its fixture (4-bit trunk and head converted, as
    test_families_heads converts them; Gemma 4's target without an assistant), token-id
    prompts and no EOS."""
    root = tmp_path_factory.mktemp("windows")
    cache: dict[str, Runner] = {}

    def get(family: str) -> Runner:
        if family not in cache:
            if family == "gemma4":
                src = build_target("31b", root / "gemma4-hf", embed=0.3)
                options = ConvertOptions(quant=QuantOptions(quantize=False))
            else:
                src = build_head_hf(family, root / f"{family}-hf")
                options = ConvertOptions(quant=QuantOptions(quantize=True),
                                         sidecar=SidecarOptions(group_size=32))
            runner = mtpkit.load(convert(str(src), root / family, options).out, dtype="float32")
            cache[family] = Runner(runner.trunk, runner.head, None)
        return cache[family]

    return get


def _rows(runner: Runner, family: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Prompts longer than the window (one shorter), and rows at other depths and sources:
    the head's where the family runs one, else context drafts."""
    window = WINDOWS.get(family, 64)
    head = "head" if runner.head is not None else "lookup"
    prompts = [_text(40, 7) * (window // 20 + 2), _text(9, 5), _text(window + 30, 11),
               _text(30, 3) * (window // 20 + 2)]
    each = [{"depth": 3, "draft": "lookup", "max_tokens": 60}, {"depth": 0, "max_tokens": 24},
            {"depth": 2, "draft": head, "max_tokens": 48},
            {"depth": 1, "draft": "both", "max_tokens": 40}]
    return prompts, each


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_decodes_as_alone_while_rows_join_and_leave(
        runners: Callable[[str], Runner], family: str) -> None:
    """Rows that draft, and rows that do not, decode as alone while others join and leave.
    Whether a random model's drafts are kept depends on the backend's arithmetic (on the
    H200 the DSA fixtures kept none), so the rows keeping different counts are
    test_rows_keep_their_own_counts_as_windows_wrap's (scripted drafts); here every drafting
    row proposed and verified drafts."""
    runner = runners(family)
    assert runner.batchable, "a batch of this model was refused before"
    prompts, each = _rows(runner, family)
    alone = [runner.generate(p, **e) for p, e in zip(prompts, each, strict=True)]
    order, batched = _streamed(runner, prompts, each, max_batch=3)
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)
    assert order.index(3) > order.index(1), "the fourth joined after a row left"
    assert all(r.stats.verify_calls and r.stats.proposed and r.stats.proposed[0]
               for r, e in zip(batched, each, strict=True) if e["depth"])


@pytest.mark.parametrize("family", ["gemma4", "mimo_v2_flash", "glm_moe_dsa"])
def test_bounded_attention_shapes_decode_the_same(
        runners: Callable[[str], Runner], monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """Where a GPU compiles each attention shape (decoder/cache/shapes.py), alone and batched: the
    batch's full-attention keys padded to whole steps beside the windows' own buffers."""
    import mtpkit.decoder.rounds.batch as batch
    import mtpkit.decoder.rounds.session as session

    monkeypatch.setattr(batch, "bounded_by_default", lambda: True)
    monkeypatch.setattr(session, "bounded_by_default", lambda: True)
    runner = runners(family)
    prompts, each = _rows(runner, family)
    alone = [runner.generate(p, **e) for p, e in zip(prompts, each, strict=True)]
    for a, b in zip(alone, runner.generate_batch(prompts, each=each, max_batch=3),
                    strict=True):
        _same(a, b)


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("family", ["gemma4", "mimo_v2_flash"])
def test_plain_rows_step_together_as_alone(
        runners: Callable[[str], Runner], monkeypatch: pytest.MonkeyPatch, family: str,
        pipelined: bool) -> None:
    """Rows all at depth 0 decode in plain stretches (Batch.plain_steps: the windows written
    in place, rotating), queued ahead as on a GPU or not; a row joins as another leaves, then
    a speculative row's rounds follow the rotated windows."""
    runner = runners(family)
    steps = _pipelined_seen(monkeypatch, "plain_steps", ahead=pipelined)
    prompts, _ = _rows(runner, family)
    each = [{"depth": 0, "max_tokens": n} for n in (50, 20, 40)] + [
        {"depth": 3, "draft": "lookup", "max_tokens": 40}]
    alone = [runner.generate(p, **e) for p, e in zip(prompts, each, strict=True)]
    order, batched = _streamed(runner, prompts, each, max_batch=3)
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)
    assert order.index(3) > order.index(1) and max(steps) == 3


# -- 3. forced rejections ------------------------------------------------------------------

@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_keep_their_own_counts_as_windows_wrap(
        runners: Callable[[str], Runner], monkeypatch: pytest.MonkeyPatch, family: str,
        pipelined: bool) -> None:
    """An oracle head wrong at a fifth of each row's positions: in one pass rows keep 0..K
    drafts, the windows wrap inside rounds, and every row decodes its plain greedy tokens;
    pipelined rounds take each row's count on the device. A row joins as another leaves."""
    base = runners(family)
    window = WINDOWS.get(family, 64)
    prompts = [_text(window + 9, 7), _text(12, 5), _text(2 * window + 3, 3), _text(7, 2)]
    oracle, plain = _oracle_batch(base, prompts, [1, 2, 3, 4], 70)
    rounds = _pipelined_seen(monkeypatch, "spec_rounds") if pipelined else []
    depths = [3] * 4 if pipelined else [1, 3, 4, 2]
    each = [{"depth": d, "max_tokens": n}
            for d, n in zip(depths, (70, 30, 70, 50), strict=True)]
    order, results = _streamed(oracle, prompts, each, max_batch=3)
    every: set[int] = set()
    for result, tokens, e in zip(results, plain, each, strict=True):
        assert result.tokens == tokens[:e["max_tokens"]]
        kept = {k for _, _, d, k in result.stats.timeline if d == e["depth"]}
        assert {0, e["depth"]} <= kept, (e, kept)  # rejected at once, and all kept
        every |= kept
    assert every == set(range(max(depths) + 1))
    assert order.index(3) > order.index(1)
    assert not pipelined or len(rounds) >= 10


# -- 4. seeded sampling --------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_rows_sample_the_same_text_alone_and_batched(
        runners: Callable[[str], Runner], family: str) -> None:
    runner = runners(family)
    prompts, each = _rows(runner, family)
    sampled = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    each = [e | sampled | {"seed": i} for i, e in enumerate(each)]
    alone = [runner.generate(p, **e) for p, e in zip(prompts, each, strict=True)]
    for a, b in zip(alone, runner.generate_batch(prompts, each=each, max_batch=3),
                    strict=True):
        _same(a, b)


def test_a_model_whose_caches_join_no_batch_is_still_refused(
        runners: Callable[[str], Runner], monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches no batch holds (here a window that keeps a prefix) are refused with
    options.invalid before any decoding, and one at a time decodes as alone."""
    runner = runners("gemma4")
    real = runner.trunk.make_cache
    monkeypatch.setattr(runner.trunk, "make_cache", lambda bounded=False: [
        RotatingKVCache(c.max_size, keep=4) if isinstance(c, RotatingKVCache) else c
        for c in real(bounded)])
    assert not runner.batchable
    with pytest.raises(OptionError) as err:
        runner.generate_batch([_text(9, 5)] * 2, 8)
    assert (err.value.code, err.value.option) == ("options.invalid", "max_batch")
    assert "\n" not in str(err.value) and err.value.hint
