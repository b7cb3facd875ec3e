"""A separate draft model (decoder/drafters/draft_model.py): exact alone and batched, greedy and sampled.

1. Greedy identity with stock mlx-lm at depths 1 and 3 with a different draft model of the same
   tokenizer (rejections happen), and with the trunk itself drafting (every draft kept).
2. Forced rejections: a scripted draft model wrong at a random 30% of positions; every round's
   kept count must be the one its script implies (a draft cache rolled back one position off
   drafts from the wrong positions and keeps other counts), the tokens stock mlx-lm's.
3. The sampled law in every round state (test_exactness.py's Markov target and stratified
   chi-square) with the draft model's q, and the same test failing a subtly wrong rule.
4. Seeded identity alone vs batched; the draft cache after rollbacks equals a fresh one's on
   the committed text; refusals (another vocabulary, recurrent caches, "model" unloaded).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from scipy.stats import chi2
from test_exactness import (
    ALPHA,
    LONG,
    MARKOV_LOGITS,
    MARKOV_PROMPT,
    MV,
    PROMPT,
    SETTINGS,
    assert_every_outcome,
    options,
    replacement_from_p,
    rounds_of,
    stock_greedy,
    stratified_test,
    transition_law,
)

import mtpkit
from fixtures.decoder_models import tiny_runner
from fixtures.tokenizer import write_tokenizer
from mtpkit.decoder.drafters.draft_model import DraftModel
from mtpkit.decoder.options import OptionError, SamplingParams, Source
from mtpkit.decoder.rounds import acceptance
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.loaders.findings import UserError


class ScriptedDraft(nn.Module):
    """A draft "model" proposing `script[p]` for text position p: its cache's offset says where
    it is, so a cache rolled back to the wrong length drafts the wrong positions."""

    def __init__(self, vocab: int, script: dict[int, int]) -> None:
        super().__init__()
        self.vocab, self.script = vocab, script

    def make_cache(self) -> list[KVCache]:
        return [KVCache()]

    def __call__(self, inputs: mx.array, cache: list[KVCache]) -> mx.array:
        width = inputs.shape[1]
        start = cache[0].offset
        blank = mx.zeros((1, 1, width, 1))
        cache[0].update_and_fetch(blank, blank)
        wanted = mx.array([self.script.get(start + i + 1, 0) for i in range(width)])
        return (mx.arange(self.vocab)[None, None] == wanted[None, :, None]) * 20.0


def expected_rounds(script: dict[int, int], seq: list[int], prompt: int, max_tokens: int,
                    depth: int) -> list[tuple[int, int]]:
    """Each round's (drafted, kept) when drafts for position p are script[p] and the text is
    seq (what rounds_of reads)."""
    out, n, made = [], prompt + 1, 1
    while made < max_tokens:
        drafted = min(depth, max_tokens - made - 1)
        kept = 0
        while kept < drafted and script[n + kept] == seq[n + kept]:
            kept += 1
        out.append((drafted, kept))
        n, made = n + kept + 1, made + kept + 1
    return out


# -- 1. greedy identity with stock mlx-lm ----------------------------------------------------

def test_greedy_equals_stock_with_another_draft_model(built: Callable[..., Path]) -> None:
    # the trunk's own checkpoint at 3 bits: it agrees with the target on some tokens only
    path, draft = built("llama"), built("llama", bits=3, group_size=32)
    reference, reason = stock_greedy(path, PROMPT, 64)
    runner = mtpkit.load(path, dtype="float32", draft_model=draft)
    assert runner.draft_source(3, None) == Source.MODEL  # the default drafter once loaded
    for depth in (1, 3):
        result = runner.generate(PROMPT, 64, depth=depth)
        assert result.tokens == reference, depth
        assert result.finish_reason == reason
        model = result.stats.sources["model"]
        assert model["rounds"] == result.stats.verify_calls > 0
        assert 0 < sum(model["accepted"]) < sum(model["proposed"]), model  # some rejected


def test_the_trunk_drafting_for_itself_keeps_every_draft(built: Callable[..., Path]) -> None:
    path = built("llama")
    reference, _ = stock_greedy(path, PROMPT, 64)
    runner = mtpkit.load(path, dtype="float32")
    runner.drafter = DraftModel(runner.trunk.model, runner.trunk.args.vocab_size)
    for depth in (1, 3):
        result = runner.generate(PROMPT, 64, depth=depth, draft="model")
        assert result.tokens == reference, depth
        assert result.stats.accepted == result.stats.proposed and result.stats.corrections == 0


# -- 2. forced rejections --------------------------------------------------------------------

FORCED_PROMPT = [9, 8, 7, 6, 5, 4]


def scripted(path: Path, tokens: int, seed: int = 0) -> tuple[Runner, list[int], dict]:
    """A float32 runner of the bundle drafting from a script wrong at a random 30% of
    positions, stock mlx-lm's greedy tokens, and the script."""
    reference, reason = stock_greedy(path, FORCED_PROMPT, tokens)
    assert reason == "length"
    runner = mtpkit.load(path, dtype="float32")
    vocab = runner.trunk.args.vocab_size
    seq = FORCED_PROMPT + reference
    wrong = np.random.default_rng(seed).random(len(seq)) < 0.3
    script = {i: (t + 1) % vocab if wrong[i] else t for i, t in enumerate(seq)}
    runner.drafter = DraftModel(ScriptedDraft(vocab, script), vocab)
    return runner, reference, script


def test_forced_rejections_roll_the_draft_cache_back_exactly(built: Callable[..., Path]) -> None:
    runner, reference, script = scripted(built("llama"), 96)
    seq = FORCED_PROMPT + reference
    for depth in (2, 3, 4):
        tokens, outcomes = rounds_of(runner, FORCED_PROMPT, 96, depth, draft="model")
        assert tokens == reference, depth
        assert_every_outcome(outcomes, (depth,))
        assert outcomes == expected_rounds(script, seq, len(FORCED_PROMPT), 96, depth)


def test_forced_rejections_in_a_batch(built: Callable[..., Path]) -> None:
    """Rows drafting from the draft model in one batch: each row's own cache rolls back as
    alone (two rows of the same script, and one plain row beside them)."""
    runner, reference, script = scripted(built("llama"), 48)
    results = runner.generate_batch([FORCED_PROMPT, FORCED_PROMPT, FORCED_PROMPT], 48,
                                    max_batch=3, depth=3, draft="model",
                                    each=[{}, {}, {"depth": 0}])
    seq = FORCED_PROMPT + reference
    rounds = expected_rounds(script, seq, len(FORCED_PROMPT), 48, 3)
    for result in results:
        assert result.tokens == reference
    for result in results[:2]:
        assert result.stats.verify_calls == sum(d > 0 for d, _ in rounds)
        assert sum(result.stats.accepted) == sum(k for _, k in rounds)


# -- 3. the sampled law ----------------------------------------------------------------------

def markov_with_draft_model(setting: str) -> tuple[float, int]:
    """test_exactness.markov_statistic with a draft model (an attending llama over the same
    vocabulary, its own weights) as the drafter: runs at depths 2, 3 and 4."""
    params, _, _ = SETTINGS[setting]
    runner = tiny_runner(vocab=MV, markov=True, logit_scale=MARKOV_LOGITS)
    drafter = tiny_runner(vocab=MV, seed=7, logit_scale=0.3)
    runner.drafter = DraftModel(drafter.trunk.model, MV)
    law = transition_law(runner, params)
    stat, df = 0.0, 0
    for depth in (2, 3, 4):
        tokens, outcomes = rounds_of(runner, MARKOV_PROMPT, LONG, depth, seed=depth,
                                     draft="model", **options(params))
        assert len(tokens) == LONG
        assert_every_outcome(outcomes, (depth,))
        s, d = stratified_test(law, tokens, outcomes)
        stat, df = stat + s, df + d
    return stat, df


@pytest.mark.parametrize("setting", ["temperature", "top_k", "top_p_min_p"])
def test_every_round_state_emits_the_target_law(setting: str) -> None:
    stat, df = markov_with_draft_model(setting)
    assert chi2.sf(stat, df) > ALPHA, (stat, df)


def test_the_law_test_fails_a_wrong_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replacement after a rejection drawn from p, not normalize(max(0, p - q))."""
    monkeypatch.setattr(acceptance, "accept_sampled", replacement_from_p)
    stat, df = markov_with_draft_model("temperature")
    assert chi2.sf(stat, df) < 1e-10, (stat, df)


# -- 4. batches, the cache after rollbacks, refusals -----------------------------------------

def drafting_runner() -> Runner:
    """A tiny runner and, as its draft model, a copy of its trunk with a noisy output layer:
    it agrees with the target on some tokens only, greedy or sampled."""
    runner = tiny_runner(vocab=8, logit_scale=0.3)
    model = tiny_runner(vocab=8, logit_scale=0.3).trunk.model
    weight = model.lm_head.weight
    mx.random.seed(3)
    model.lm_head.weight = weight + mx.random.normal(weight.shape) * mx.abs(weight).mean() * 0.3
    runner.drafter = DraftModel(model, 8)
    return runner


@pytest.mark.parametrize("params", [SamplingParams(0.8, top_k=4), SamplingParams()])
def test_seeded_rows_equal_alone_and_batched(params: SamplingParams) -> None:
    runner = drafting_runner()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [2, 2]]
    each = [{"seed": 11, "depth": 3}, {"seed": 12, "depth": 2}, {"seed": 13, "depth": 0}]
    alone = [runner.generate(p, 40, **options(params), **e) for p, e in zip(prompts, each,
                                                                             strict=True)]
    batched = runner.generate_batch(prompts, 40, max_batch=3, each=each, **options(params))
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert [r.stats.accepted for r in batched] == [r.stats.accepted for r in alone]
    assert alone[0].stats.corrections > 0 and sum(alone[0].stats.accepted) > 0


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams()])
def test_the_draft_cache_after_rollbacks_is_a_fresh_ones(params: SamplingParams) -> None:
    """After rounds that rejected at every position, the draft model's cache holds exactly
    what a fresh cache fed the committed text holds (the rest pending, ending with the last
    committed token)."""
    runner = drafting_runner()
    assert runner.drafter is not None
    session = Session(runner.trunk, None, params, 3, seed=5, draft=Source.MODEL,
                      drafter=runner.drafter)
    text = [5, 1, 7, 2, 6] + [session.start([5, 1, 7, 2, 6])]
    kept = set()
    for _ in range(16):
        outcome = session.next_round(3)
        text += outcome.committed
        kept.add(outcome.kept)
    assert kept == {0, 1, 2, 3}
    proposer = session.model
    assert proposer is not None and proposer.pending and proposer.pending[-1] == session.last
    assert text[len(text) - len(proposer.pending):] == proposer.pending
    fresh = runner.drafter.make_cache()
    runner.drafter.feed(mx.array([text[:len(text) - len(proposer.pending)]]), fresh)
    for mine, theirs in zip(proposer.cache, fresh, strict=True):
        assert mine.offset == theirs.offset
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            end = mine.offset  # (the buffers run past it: trimmed drafts stay there, unread)
            np.testing.assert_allclose(np.array(a[..., :end, :]), np.array(b[..., :end, :]),
                                       atol=1e-5)


def test_another_vocabulary_is_refused(built: Callable[..., Path], tmp_path: Path) -> None:
    """The same code from load and from a loaded runner, one line, before the draft's weights
    load."""
    import shutil
    other = tmp_path / "other"
    shutil.copytree(built("llama", seed=1), other)
    write_tokenizer(other, 300, thinking=False)
    with pytest.raises(UserError) as err:
        mtpkit.load(built("llama"), dtype="float32", draft_model=other)
    assert err.value.code == "draft.vocab_mismatch" and "\n" not in str(err.value)
    assert err.value.hint
    runner = mtpkit.load(built("llama"), dtype="float32")
    with pytest.raises(UserError) as again:
        runner.load_draft_model(other)
    assert again.value.code == "draft.vocab_mismatch" and runner.drafter is None


def test_recurrent_draft_models_are_refused(built: Callable[..., Path]) -> None:
    trunk = mtpkit.load(built("qwen3_5"), dtype="float32").trunk
    with pytest.raises(OptionError) as err:
        DraftModel(trunk.model, trunk.args.vocab_size)
    assert err.value.code == "options.invalid" and "ArraysCache" in str(err.value)


def test_model_drafts_need_a_draft_model() -> None:
    runner = tiny_runner(vocab=8)
    with pytest.raises(OptionError) as err:
        runner.generate([1, 2], 4, depth=2, draft="model")
    assert err.value.code == "options.invalid"
    runner.drafter = DraftModel(tiny_runner(vocab=8, seed=3).trunk.model, 8)
    assert runner.draft_source("auto", None) == Source.MODEL
    assert runner.policy(None, Source.MODEL) == (3, None)  # mlx-lm's default


class SlowDraft(ScriptedDraft):
    """A scripted draft model whose every pass costs `seconds` more (the host sleeps while it
    is built): a drafter too dear to pay anywhere."""

    def __init__(self, vocab: int, script: dict[int, int], seconds: float) -> None:
        super().__init__(vocab, script)
        self.seconds = seconds

    def __call__(self, inputs: mx.array, cache: list[KVCache]) -> mx.array:
        time.sleep(self.seconds)
        return super().__call__(inputs, cache)


class DearLayer(nn.Module):
    """A trunk layer's MLP whose every call costs `seconds` more on the host: beside it a scripted
    drafter is cheap on any backend (a tiny trunk alone costs what a drafter step costs on a
    GPU, where both are bound by launches)."""

    def __init__(self, layer: nn.Module, seconds: float) -> None:
        super().__init__()
        self.layer, self.seconds = layer, seconds

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.seconds)
        return self.layer(*args, **kwargs)


def test_auto_prices_the_draft_model(built: Callable[..., Path]) -> None:
    """depth auto chooses per round by the draft model's own step cost (timed at first use) and
    its acceptance: a cheap drafter that is always right beside a dear trunk (20 ms a pass) is
    taken at depths above 1, by a lone request and by fresh rows of a batch; one costing 50 ms
    a step is left for plain steps. Tokens stay stock mlx-lm's either way. (The trunk's host
    delay must dwarf what a loaded machine adds to a pass: a batch's fresh rows start from the
    acceptance prior, and where a measured round costs two plain steps they stay plain.)"""
    runner, reference, script = scripted(built("llama"), 96)
    first = runner.trunk.inner.layers[0]
    first.mlp = DearLayer(first.mlp, 0.02)
    right = {p: t for p, t in enumerate(FORCED_PROMPT + reference)}
    vocab = runner.trunk.args.vocab_size
    runner.drafter = DraftModel(ScriptedDraft(vocab, right), vocab)
    deepest, policy = runner.policy("auto", Source.MODEL)
    assert policy is not None and policy.sources == (Source.MODEL,)
    assert policy.cost(3, Source.MODEL) == pytest.approx(
        policy.priced.round_cost(3, 0) + 3 * runner.drafter.step_cost())
    fast = runner.generate(FORCED_PROMPT, 96, draft="model")
    assert fast.tokens == reference
    assert sum(n for d, n in fast.stats.depths.items() if d > 1) > 5, fast.stats.depths
    rows = runner.generate_batch([FORCED_PROMPT, FORCED_PROMPT], 96, max_batch=2,
                                 draft="model")
    assert [r.tokens for r in rows] == [reference, reference]
    assert all(sum(r.stats.accepted) > 0 for r in rows)  # rows drafted in the batch too
    runner.drafter = DraftModel(SlowDraft(vocab, right, 0.05), vocab)
    assert runner.drafter.step_cost() > 0.05
    slow = runner.generate(FORCED_PROMPT, 96, draft="model")
    assert slow.tokens == reference
    assert slow.stats.depths.get(0, 0) > 0.8 * 96, slow.stats.depths
