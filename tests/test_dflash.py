"""A DFlash drafter (decoder/drafters/dflash.py, loaders/dflash.py): exact greedy and sampled.

Fixtures scale a published config down: z-lab/Qwen3.6-27B-DFlash (docs/dflash.md) reads the
outputs of target layers [1, 16, 31, 46, 61] of 64 (every 15th from the second) with 5 layers,
4 sliding then a full one, blocks of 16. Here a 9-layer Qwen3 trunk (hidden 32, vocabulary 8)
and random drafters of 2 layers reading layers [1, 4, 7], full attention or sliding + full,
blocks of 6 (5 drafts).

1. Greedy identity with stock mlx-lm's greedy decoding at depths 1, 3 and the block (5), with
   drafts kept and rejected; the drafter's context after every kind of round equals the one a
   fresh prefill of the committed text gives (bounded shapes, Qwen3.5 / Qwen3-Next targets
   with both rollbacks too), in a batch's rows and restored from the prefix cache too.
2. Forced rejections: drafts scripted wrong at 30% of positions; every round keeps exactly
   what its script implies.
3. The sampled law in every round state (test_exactness's Markov target and stratified
   chi-square) with the drafter's q, and the test failing a wrong rule; seeded identity.
4. The bundle: `mtpkit.load` attaches dflash/, greedy equals stock there; refusals for a wrong
   vocabulary, a layer id out of range, a hidden size and a config that is not DFlash's.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3
from scipy.stats import chi2
from test_exactness import (
    ALPHA,
    LONG,
    MARKOV_LOGITS,
    MARKOV_PROMPT,
    MV,
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
from mtpkit.decoder.cache.prefix import PrefixCache
from mtpkit.decoder.drafters.dflash import DFlashDrafter, DFlashPair, DFlashProposer
from mtpkit.decoder.model.trunk import Trunk
from mtpkit.decoder.options import SamplingParams, Source
from mtpkit.decoder.rounds import acceptance
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.loaders.dflash import read_dflash, read_spec
from mtpkit.loaders.findings import UserError

VOCAB, HIDDEN, TARGET_LAYERS = 8, 32, 9
READS = [1, 4, 7]
BLOCK = 6


def drafter_config(hidden: int = HIDDEN, vocab: int = VOCAB, reads: list[int] | None = None,
                   sliding: bool = False, **extra: Any) -> dict[str, Any]:
    """A DFlash config.json with the published keys (z-lab's DFlashDraftModel)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 2 * hidden,
            "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 4096, "block_size": BLOCK,
            "num_target_layers": extra.pop("num_target_layers", TARGET_LAYERS),
            "layer_types": ["sliding_attention", "full_attention"] if sliding
            else ["full_attention"] * 2, "sliding_window": 4 if sliding else None,
            "dflash_config": {"mask_token_id": vocab - 1,
                              "target_layer_ids": reads if reads is not None else READS},
            **extra}


def qwen3_trunk(seed: int = 0, vocab: int = VOCAB, layers: int = TARGET_LAYERS) -> Trunk:
    mx.random.seed(seed)
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=HIDDEN, num_hidden_layers=layers,
                           intermediate_size=2 * HIDDEN, num_attention_heads=2,
                           rms_norm_eps=1e-6, vocab_size=vocab, num_key_value_heads=1,
                           max_position_embeddings=4096, rope_theta=10000.0, head_dim=16,
                           tie_word_embeddings=False)
    model = qwen3.Model(args)
    model.update(spread(model, {"model.embed_tokens.weight": 1.0, "lm_head.weight": 0.5}))
    mx.eval(model.parameters())
    return Trunk(model)


def spread(module: Any, scales: dict[str, float], default: float = 0.3) -> dict:
    """Float32 weights drawn N(0, scale) (norm gains 1): logits that spread over a few
    tokens, so greedy text varies instead of repeating one token as mlx's default init does."""
    from mlx.utils import tree_unflatten
    return tree_unflatten([(name, mx.ones(v.shape) if v.ndim == 1 else
                            mx.random.normal(v.shape) * scales.get(name, default))
                           for name, v in tree_flatten(module.parameters())])


def random_drafter(config: dict[str, Any], seed: int = 1, gain: float = 4.0) -> DFlashDrafter:
    """A drafter of random weights whose final norm gain `gain` sharpens its logits (so its
    positions' laws differ from each other and from the target's)."""
    spec, bad = read_spec(config, "config.json")
    assert spec is not None, bad
    mx.random.seed(seed)
    drafter = DFlashDrafter(spec)
    drafter.update(spread(drafter, {}))
    drafter.update({"norm": {"weight": mx.full((spec.hidden,), gain)}})
    mx.eval(drafter.parameters())
    return drafter


def dflash_runner(sliding: bool = False, seed: int = 0) -> Runner:
    trunk = qwen3_trunk(seed)
    runner = Runner(trunk, None, None)
    runner.drafter = DFlashPair.pair(random_drafter(drafter_config(sliding=sliding)), trunk)
    return runner


def stock(trunk: Trunk, prompt: list[int], n: int) -> list[int]:
    """Stock mlx-lm's greedy tokens (generate_step's default sampler is the argmax)."""
    steps = generate_step(mx.array(prompt), trunk.model, max_tokens=n)
    return [int(t) for t, _ in steps]


PROMPT = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5]


# -- 1. greedy identity; the drafter's context -----------------------------------------------

@pytest.mark.parametrize("sliding", [False, True])
def test_greedy_equals_stock_at_every_depth(sliding: bool) -> None:
    runner = dflash_runner(sliding)
    reference = stock(runner.trunk, PROMPT, 80)
    for depth in (1, 3, BLOCK - 1):
        tokens, outcomes = rounds_of(runner, PROMPT, 80, depth, draft="model")
        assert tokens == reference, depth
        kept = [k for d, k in outcomes if d]
        assert 0 < sum(kept) < sum(d for d, _ in outcomes), (depth, outcomes)  # kept, rejected
    # a depth past the block drafts a block's worth
    tokens, outcomes = rounds_of(runner, PROMPT, 40, BLOCK - 1, draft="model")
    result = runner.generate(PROMPT, 40, depth=BLOCK + 3, draft="model")
    proposed = result.stats.proposed
    assert result.tokens == tokens and proposed[BLOCK - 2] > 0 == sum(proposed[BLOCK - 1:])


def fresh_context(pair: DFlashPair, text: list[int]) -> list[mx.array]:
    """The drafter's context keys a fresh prefill of `text` gives, per drafter layer."""
    cache = pair.trunk.make_cache()
    outs: dict[int, mx.array] = {}
    probe = type("Probe", (), {"captured": lambda self, i, c, o: outs.__setitem__(i, o)})()
    for tap in pair.taps:
        tap.sinks.add(probe)
    pair.trunk(mx.array([text]), cache, logits_for=0)
    stores = pair.drafter.make_stores()
    reads = pair.spec.target_layer_ids
    pair.drafter.context(mx.concatenate([outs[i] for i in reads], axis=-1), stores)
    return [s.state[0][..., :s.offset, :] for s in stores]


class _Concatenated:
    """The reference a block's view is checked against: the context's stored keys and values
    concatenated with the block's, nothing written anywhere."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.offset = store.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = (a[..., :self.offset, :] for a in self.store.state[:2])
        return mx.concatenate([k, keys], axis=2), mx.concatenate([v, values], axis=2)


@pytest.mark.parametrize("sliding", [False, True])
def test_a_block_reads_the_context_then_itself_and_stores_nothing(sliding: bool) -> None:
    """A block's logits over a context longer than a cache step (its buffers grown) equal the
    same layers over the context and the block concatenated; the stores keep the context
    alone (offsets and keys unchanged), and the same block again gives the same logits."""
    pair = dflash_runner(sliding).drafter
    assert isinstance(pair, DFlashPair)
    stores = pair.drafter.make_stores()
    mx.random.seed(3)
    width = len(pair.spec.target_layer_ids) * pair.spec.hidden
    pair.feed(stores, mx.random.normal((1, 300, width)))
    pair.feed(stores, mx.random.normal((1, 7, width)))
    before = [(s.offset, np.array(s.state[0][..., :s.offset, :])) for s in stores]
    got = pair.block_logits(stores, None, 2, BLOCK - 1)
    mx.eval(got)
    for (offset, keys), store in zip(before, stores, strict=True):
        assert store.offset == offset == 307
        assert np.array_equal(np.array(store.state[0][..., :offset, :]), keys)
    drafter, spec = pair.drafter, pair.spec
    x = pair.trunk.embed(mx.array([[2] + [spec.mask_token_id] * (BLOCK - 1)])) * \
        spec.embedding_scale
    for i, (layer, store) in enumerate(zip(drafter.layers, stores, strict=True)):
        x = layer(x, drafter.mask(i, store.offset, x.shape[1]), _Concatenated(store))
    want = pair.trunk.logits(drafter.norm(x)[:, 1:])[0]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
    again = pair.block_logits(stores, None, 2, BLOCK - 1)
    np.testing.assert_allclose(np.array(again), np.array(got), atol=1e-6)


@pytest.mark.parametrize(("params", "bounded"), [(SamplingParams(), False),
                                                 (SamplingParams(0.8, top_k=3), False),
                                                 (SamplingParams(), True)])
def test_the_context_after_every_round_is_a_fresh_prefills(params: SamplingParams,
                                                           bounded: bool) -> None:
    """After prompt, rounds kept and rejected at every position, and plain steps, the
    drafter's context keys hold exactly the committed positions, as a fresh prefill's; with
    bounded shapes too (a GPU's default: padded prefill chunks and verify passes)."""
    seen = context_after_rounds(dflash_runner(), params, bounded=bounded)
    assert {k for _, k in seen} >= {0, 1}, seen


def context_after_rounds(runner: Runner, params: SamplingParams, **kw: Any) -> set:
    """Rounds at every depth and plain steps, the drafter's context compared with a fresh
    prefill's after each; the (depth, kept) pairs seen."""
    session = Session(runner.trunk, None, params, BLOCK - 1, seed=5, draft="model",
                      drafter=runner.drafter, **kw)
    proposer = session.model
    assert isinstance(proposer, DFlashProposer)
    session.start(PROMPT)
    seen = set()
    for step in range(30):
        if step % 7 == 6:
            list(session.plain_steps(2))
            continue
        outcome = session.next_round(1 + step % (BLOCK - 1))
        seen.add((outcome.depth, outcome.kept))
        assert_context_fresh(proposer)
    return seen


def assert_context_fresh(proposer: DFlashProposer) -> None:
    """After the next proposal, the drafter's context keys are a fresh prefill's of the
    committed positions (the text less its last token, which the block starts from)."""
    text = proposer.text[:-1]
    assert proposer.propose(1) is not None
    for got, want in zip([s.state[0][..., :s.offset, :] for s in proposer.stores],
                         fresh_context(proposer.pair, text), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("rollback", ["record", "replay"])
def test_recurrent_targets_keep_the_context_exact(bundle_copy: Callable[..., Path],
                                                  family: str, rollback: str) -> None:
    """DFlash's own targets are hybrid (Qwen3.5 / 3.6): a tapped GatedDeltaNet layer has no
    offset, its rows are placed by an attention cache's; recurrent rollback by recorded
    states or by replay. Greedy output is stock mlx-lm's, alone and batched."""
    path = bundle_copy(family)
    layers = json.loads((path / "config.json").read_text())
    layers = layers.get("text_config", layers)["num_hidden_layers"]
    write_drafter(path / "dflash", drafter_config(hidden=64, vocab=512, reads=[0, layers - 1],
                                                  num_target_layers=layers))
    runner = mtpkit.load(path, dtype="float32", rollback=rollback)
    assert isinstance(runner.drafter, DFlashPair)
    context_after_rounds(runner, SamplingParams(1.0, top_k=20), rollback=rollback)
    reference, _ = stock_greedy(path, PROMPT, 32)
    assert runner.generate(PROMPT, 32, depth=3).tokens == reference
    other, _ = stock_greedy(path, PROMPT[3:], 32)  # batched: recurrent rows, tapped too
    batched = runner.generate_batch([PROMPT, PROMPT[3:]], 32, max_batch=2, depth=3)
    assert [r.tokens for r in batched] == [reference, other]
    assert all(r.stats.sources["model"]["rounds"] > 0 for r in batched)


def rebuilds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every context rebuild from the text (a trunk pass over all of it), as it happens."""
    real, calls = DFlashProposer.rebuild, []

    def counted(self: DFlashProposer, end: int) -> None:
        calls.append(end)
        real(self, end)

    monkeypatch.setattr(DFlashProposer, "rebuild", counted)
    return calls


def test_batch_rows_draft_and_decode_as_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of a batch draft with their DFlash proposers from their rows of the batch's passes:
    three prompts through two places (a row leaves, the third joins, the last parts and
    decodes alone), every row's tokens stock mlx-lm's, and every row proposing and keeping
    what it does alone: its drafts came from the same context, kept from the batch's passes
    (never rebuilt from the text)."""
    runner = dflash_runner()
    rebuilt = rebuilds(monkeypatch)
    prompts = [PROMPT[:6], PROMPT, [1, 2, 3, 4, 5, 6, 7]]
    each = [{"max_tokens": 16}, {"max_tokens": 40}, {"max_tokens": 24}]
    results = runner.generate_batch(prompts, 24, max_batch=2, depth=3, draft="model", each=each)
    assert rebuilt == []
    for prompt, e, result in zip(prompts, each, results, strict=True):
        assert result.tokens == stock(runner.trunk, prompt, e["max_tokens"])
        alone = runner.generate(prompt, e["max_tokens"], depth=3, draft="model").stats
        assert (result.stats.proposed, result.stats.accepted) == (alone.proposed, alone.accepted)
        assert result.stats.sources["model"]["rounds"] > 0, result.stats.sources
    assert sum(results[2].stats.accepted) > 0


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, top_k=3)])
def test_the_context_of_every_batch_row_is_a_fresh_prefills(
        params: SamplingParams, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rows of one batch, rounds at every depth (kept and rejected at every position, rows
    of different widths in one pass) and queued plain steps: after each, every row's drafter
    context holds exactly its committed positions, as a fresh prefill's, from the batch's
    passes (no rebuild); then the last row parts and keeps it so alone."""
    from mtpkit.decoder.rounds.batch import Ask, Batch

    runner = dflash_runner()
    rebuilt = rebuilds(monkeypatch)
    sessions = [Session(runner.trunk, None, params, BLOCK - 1, seed=5 + i, draft="model",
                        drafter=runner.drafter) for i in range(2)]
    batch = Batch(runner.trunk, None)
    for session, prompt in zip(sessions, [PROMPT, PROMPT[3:]], strict=True):
        session.start(prompt)
        batch.join(session)

    def check() -> None:
        for session in sessions:
            assert isinstance(session.model, DFlashProposer)
            assert_context_fresh(session.model)

    seen = set()
    for step in range(16):
        if step % 5 == 4:
            list(batch.plain_steps(2))
        else:
            depths = [1 + step % (BLOCK - 1), 1 + (step + 2) % (BLOCK - 1)]
            outcomes = batch.round([Ask(depth=d, model=True) for d in depths])
            seen |= {(o.depth, o.kept) for o in outcomes}
            assert all(o.source is Source.MODEL for o in outcomes)
        check()
    kept = {k for _, k in seen}
    assert 0 in kept and max(kept) > 0, seen
    batch.leave({0})
    sessions = [batch.part()]
    for depth in (2, 4):
        sessions[0].next_round(depth)
        check()
    assert rebuilt == []


def test_plain_stretches_keep_what_is_held_for_the_drafter_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A session that asks for no draft for long (auto decoding plainly), alone and as a
    batch's row, feeds its drafter's context every PREFILL_STEP committed positions (8 here):
    the tapped outputs it holds stay under that plus a pass, and the context is still a fresh
    prefill's, never rebuilt."""
    from mtpkit.decoder.drafters import dflash
    from mtpkit.decoder.rounds.batch import Batch

    monkeypatch.setattr(dflash, "PREFILL_STEP", 8)
    runner = dflash_runner()
    rebuilt = rebuilds(monkeypatch)
    sessions = [Session(runner.trunk, None, SamplingParams(), BLOCK - 1, seed=5,
                        draft="model", drafter=runner.drafter) for _ in range(3)]
    for session in sessions:
        session.start(PROMPT)
    batch = Batch(runner.trunk, None)
    for session in sessions[1:]:
        batch.join(session)

    def held(proposer: DFlashProposer) -> int:
        proposer._placed()
        return max(sum(p.shape[1] for p in pieces) for pieces in proposer.parts.values())

    for _ in range(6):
        list(sessions[0].plain_steps(5))
        list(batch.plain_steps(5))
        for session in sessions:
            assert isinstance(session.model, DFlashProposer)
            assert held(session.model) <= 8 + 1, held(session.model)
    for session in sessions:
        assert session.model.base > len(PROMPT)
        assert_context_fresh(session.model)
    assert rebuilt == []


def test_a_dflash_session_is_prefilled_alone() -> None:
    """Prompts that arrive together are prefilled in one pass on a GPU; a DFlash session's
    is not, since its drafter's context comes from its own passes."""
    runner = dflash_runner()
    drafting = Session(runner.trunk, None, SamplingParams(), 3, draft="model",
                       drafter=runner.drafter)
    plain = Session(runner.trunk, None, SamplingParams(), 0)
    assert plain.prefills_with_others(PROMPT) and not drafting.prefills_with_others(PROMPT)


def test_a_prompt_from_the_prefix_cache_restores_the_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix cache entry of a DFlash session holds the drafter's context beside the
    trunk's caches: a prompt restored from it, whole or cut back to a shorter shared prefix,
    drafts from the context as a fresh run does (its tokens and kept drafts), with no rebuild
    through the trunk."""
    runner = dflash_runner()
    prefix = PrefixCache(1 << 26)
    first = runner.generate(PROMPT, 32, depth=3, draft="model", prefix=prefix)
    longer = runner.generate(PROMPT + first.tokens[:8], 8, depth=3, draft="model",
                             prefix=prefix)
    rebuilt = rebuilds(monkeypatch)
    again = runner.generate(PROMPT + first.tokens[:4], 28, depth=3, draft="model",
                            prefix=prefix)
    cut = runner.generate(PROMPT + first.tokens[:6] + [7, 7], 20, depth=3, draft="model",
                          prefix=prefix)
    assert rebuilt == [], "restored, not rebuilt"
    fresh = runner.generate(PROMPT + first.tokens[:4], 28, depth=3, draft="model")
    fresh_cut = runner.generate(PROMPT + first.tokens[:6] + [7, 7], 20, depth=3, draft="model")
    assert longer.cached_tokens >= len(PROMPT)
    assert len(PROMPT) < again.cached_tokens < len(PROMPT) + 8, "the longer entry, cut back"
    assert len(PROMPT) + 4 < cut.cached_tokens < len(PROMPT) + 8, "the longer entry, cut back"
    assert again.tokens == fresh.tokens == first.tokens[4:]
    assert again.stats.accepted == fresh.stats.accepted and sum(again.stats.accepted) > 0
    assert cut.tokens == fresh_cut.tokens and cut.stats.accepted == fresh_cut.stats.accepted


# -- 2. forced rejections --------------------------------------------------------------------

class ScriptedPair(DFlashPair):
    """Drafts script[p] for text position p: the position comes from the drafter's context
    length, so a context that is one position off drafts the wrong tokens."""

    script: dict[int, int] = {}

    def block_logits(self, stores: list, features: mx.array | None, last: int,
                     depth: int) -> mx.array:
        super().block_logits(stores, features, last, depth)
        start = stores[0].offset + 1
        wanted = mx.array([self.script.get(start + i, 0) for i in range(depth)])
        return (mx.arange(VOCAB)[None] == wanted[:, None]) * 20.0


def test_forced_rejections_keep_what_the_script_implies() -> None:
    runner = dflash_runner()
    reference = stock(runner.trunk, PROMPT, 96)
    seq = PROMPT + reference
    wrong = np.random.default_rng(0).random(len(seq)) < 0.3
    pair = ScriptedPair(runner.drafter.drafter, runner.trunk, runner.drafter.taps)
    pair.script = {i: (t + 1) % VOCAB if wrong[i] else t for i, t in enumerate(seq)}
    runner.drafter = pair
    for depth in (2, 3, BLOCK - 1):
        tokens, outcomes = rounds_of(runner, PROMPT, 96, depth, draft="model")
        assert tokens == reference, depth
        n, made, expected = len(PROMPT) + 1, 1, []
        while made < 96:
            drafted, kept = min(depth, 96 - made - 1), 0
            while kept < drafted and pair.script[n + kept] == seq[n + kept]:
                kept += 1
            expected.append((drafted, kept))
            n, made = n + kept + 1, made + kept + 1
        assert outcomes == expected, depth


# -- 3. the sampled law ----------------------------------------------------------------------

class PositionalPair(DFlashPair):
    """The drafter's logits plus a bias that favours token i mod V at block position i: laws
    that differ by position, as a trained drafter's do, so a q taken from the wrong position
    shows in the emitted law."""

    def block_logits(self, stores: list, features: mx.array | None, last: int,
                     depth: int) -> mx.array:
        logits = super().block_logits(stores, features, last, depth)
        width = logits.shape[-1]
        return logits + 2.0 * (mx.arange(width)[None] == mx.arange(depth)[:, None] % width)


def markov_with_dflash(params: SamplingParams) -> tuple[float, int]:
    """test_exactness.markov_statistic with a DFlash drafter reading the Markov target's two
    layers: runs at depths 2 and 3 and at the block."""
    runner = tiny_runner(vocab=MV, markov=True, logit_scale=MARKOV_LOGITS)
    runner.head = None
    config = drafter_config(vocab=MV, reads=[0, 1], num_target_layers=2)
    runner.drafter = PositionalPair.pair(random_drafter(config, seed=3, gain=1.0),
                                         runner.trunk)
    law = transition_law(runner, params)
    stat, df = 0.0, 0
    for depth in (2, 3, BLOCK - 1):
        tokens, outcomes = rounds_of(runner, MARKOV_PROMPT, LONG, depth, seed=depth,
                                     draft="model", **options(params))
        assert len(tokens) == LONG
        assert_every_outcome(outcomes, (depth,))
        s, d = stratified_test(law, tokens, outcomes)
        stat, df = stat + s, df + d
    return stat, df


LAW_SETTINGS = [SamplingParams(1.0), SamplingParams(0.8, top_k=3)]


@pytest.mark.parametrize("params", LAW_SETTINGS)
def test_every_round_state_emits_the_target_law(params: SamplingParams) -> None:
    stat, df = markov_with_dflash(params)
    assert chi2.sf(stat, df) > ALPHA, (stat, df)


def test_the_law_test_fails_a_wrong_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replacement after a rejection drawn from p, not normalize(max(0, p - q))."""
    monkeypatch.setattr(acceptance, "accept_sampled", replacement_from_p)
    stat, df = markov_with_dflash(LAW_SETTINGS[0])
    assert chi2.sf(stat, df) < 1e-10, (stat, df)


def test_seeded_runs_repeat() -> None:
    runner = dflash_runner()
    sampled = {"temperature": 0.8, "top_p": 0.95, "top_k": 4, "draft": "model", "depth": 3}
    first = runner.generate(PROMPT, 48, seed=11, **sampled)
    assert runner.generate(PROMPT, 48, seed=11, **sampled).tokens == first.tokens
    assert runner.generate(PROMPT, 48, seed=12, **sampled).tokens != first.tokens
    assert sum(first.stats.accepted) > 0


# -- 4. the bundle: attach, refusals ---------------------------------------------------------

def write_drafter(folder: Path, config: dict[str, Any], seed: int = 1) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    spec, bad = read_spec(config, "config.json")
    if spec is None:  # a config the reader refuses: weights of a valid one beside it
        spec, _ = read_spec(drafter_config(hidden=64, vocab=512, reads=[0, 1],
                                           num_target_layers=2), "config.json")
    assert spec is not None
    mx.random.seed(seed)
    weights = dict(tree_flatten(DFlashDrafter(spec).parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)


LLAMA = {"hidden": 64, "vocab": 512, "reads": [0, 1], "num_target_layers": 2}


def test_load_attaches_the_bundles_drafter(bundle_copy: Callable[..., Path]) -> None:
    path = bundle_copy("llama")
    reference, _ = stock_greedy(path, PROMPT, 48)
    write_drafter(path / "dflash", drafter_config(**LLAMA))
    runner = mtpkit.load(path, dtype="float32")
    assert isinstance(runner.drafter, DFlashPair)
    assert runner.draft_source(3, None).value == "model"
    for depth in (1, BLOCK - 1):
        result = runner.generate(PROMPT, 48, depth=depth)
        assert result.tokens == reference, depth
        assert result.stats.sources["model"]["rounds"] == result.stats.verify_calls > 0


BAD = {
    "tokenizer.vocab_mismatch": {**LLAMA, "vocab": 256},
    "drafter.mismatch": {**LLAMA, "reads": [0, 2]},  # the target has 2 layers
    "drafter.mismatch ": {**LLAMA, "hidden": 32},
}


@pytest.mark.parametrize("code", BAD)
def test_a_drafter_that_does_not_fit_is_refused(bundle_copy: Callable[..., Path],
                                                code: str) -> None:
    path = bundle_copy("llama")
    write_drafter(path / "dflash", drafter_config(**BAD[code]))
    target = json.loads((path / "config.json").read_text())
    report = read_dflash(path, target)
    assert code.strip() in {f.code for f in report.findings}, report.findings
    with pytest.raises(UserError) as err:
        mtpkit.load(path, dtype="float32")
    assert err.value.code == code.strip() and "\n" not in str(err.value)


INVALID = {
    "not DFlash": {"architectures": ["DFlash2DraftModel"]},
    "no dflash_config": {"dflash_config": None},
    "mask token outside": {"dflash_config": {"mask_token_id": 512, "target_layer_ids": [0]}},
    "block of one": {"block_size": 1},
}


@pytest.mark.parametrize("name", INVALID)
def test_an_invalid_drafter_config_is_refused(tmp_path: Path, name: str) -> None:
    config = drafter_config(**LLAMA) | INVALID[name]
    spec, bad = read_spec(config, "dflash/config.json")
    assert spec is None and [f.code for f in bad] == ["drafter.invalid"], bad


def test_damaged_weights_are_findings(bundle_copy: Callable[..., Path]) -> None:
    path = bundle_copy("llama")
    write_drafter(path / "dflash", drafter_config(**LLAMA))
    weights = mx.load(str(path / "dflash" / "model.safetensors"))
    weights.pop("fc.weight")
    weights["norm.weight"] = mx.ones((7,))
    mx.save_safetensors(str(path / "dflash" / "model.safetensors"), weights)
    codes = {f.code for f in read_dflash(path, json.loads((path / "config.json").read_text()))
             .findings}
    assert {"weights.missing", "weights.shape_mismatch"} <= codes, codes
    shutil.rmtree(path / "dflash")
    (path / "mtpkit.json").write_text(json.dumps({"drafter": {"kind": "dflash",
                                                              "path": "elsewhere"}}))
    assert [f.code for f in read_dflash(path, {}, {"drafter": {"kind": "dflash",
                                                               "path": "elsewhere"}})
            .findings] == ["drafter.invalid"]


def test_a_quantized_drafter_is_refused(bundle_copy: Callable[..., Path]) -> None:
    path = bundle_copy("llama")
    write_drafter(path / "dflash", drafter_config(**LLAMA))
    weights = mx.load(str(path / "dflash" / "model.safetensors"))
    packed, scales, biases = mx.quantize(weights["fc.weight"], group_size=64, bits=4)
    weights |= {"fc.weight": packed, "fc.scales": scales, "fc.biases": biases}
    mx.save_safetensors(str(path / "dflash" / "model.safetensors"), weights)
    with pytest.raises(UserError) as err:
        mtpkit.load(path, dtype="float32")
    assert err.value.code == "options.invalid" and "quantized" in str(err.value)


# -- 5. convert --drafter and doctor -------------------------------------------------------------

def test_convert_carries_a_dflash_drafter(bundle_copy: Callable[..., Path],
                                          tmp_path: Path) -> None:
    """convert TARGET OUT --drafter DFLASH: the drafter copied into OUT/dflash/ byte for byte,
    the manifest naming it (schema-valid), doctor finding the pair healthy, the bundle decoding
    with it as stock mlx-lm does; convert again and doctor --fix keep it."""
    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.repair import repair
    from mtpkit.convert.trunk import QuantOptions
    from mtpkit.schemas import validate
    from mtpkit.verify.doctor import report

    target = bundle_copy("llama")
    drafter = tmp_path / "drafter"
    write_drafter(drafter, drafter_config(**LLAMA))
    out = tmp_path / "out"
    convert(str(target), out, ConvertOptions(quant=QuantOptions(quantize=False),
                                             drafter=str(drafter)))
    manifest = json.loads((out / "mtpkit.json").read_text())
    validate(manifest, "manifest")
    assert manifest["drafter"] == {"kind": "dflash", "path": "dflash", "layers": 2,
                                   "block_size": BLOCK, "target_layer_ids": [0, 1],
                                   "mask_token_id": manifest["drafter"]["mask_token_id"],
                                   "weights": "as_given"}
    roles = {f["path"]: f["role"] for f in manifest["files"]}
    assert roles["dflash/config.json"] == roles["dflash/model.safetensors"] == "drafter"
    for name in ("config.json", "model.safetensors"):
        assert (out / "dflash" / name).read_bytes() == (drafter / name).read_bytes()
    doc = report(out)
    validate(doc, "doctor_report")
    assert doc["summary"]["ok"] and doc["bundle"]["drafter"]["kind"] == "dflash", doc
    reference, _ = stock_greedy(target, PROMPT, 32)
    runner = mtpkit.load(out, dtype="float32")
    assert isinstance(runner.drafter, DFlashPair)
    result = runner.generate(PROMPT, 32, depth=3)
    assert result.tokens == reference and result.stats.sources["model"]["rounds"] > 0
    again = tmp_path / "again"
    convert(str(out), again, ConvertOptions(quant=QuantOptions(quantize=False)))
    assert json.loads((again / "mtpkit.json").read_text())["drafter"] == manifest["drafter"]
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in json.loads((out / "tokenizer_config.json").read_text())
                    .items() if k != "chat_template"}))
    repair(out, tmp_path / "fixed")
    fixed = json.loads((tmp_path / "fixed" / "mtpkit.json").read_text())
    assert fixed["drafter"] == manifest["drafter"]
    assert (tmp_path / "fixed" / "dflash" / "model.safetensors").read_bytes() == (
        drafter / "model.safetensors").read_bytes()


@pytest.mark.parametrize("code", BAD)
def test_convert_refuses_a_dflash_drafter_that_does_not_fit(bundle_copy: Callable[..., Path],
                                                            tmp_path: Path, code: str) -> None:
    """A DFlash drafter trained for another target: one ConvertError with the code doctor
    gives, and no output; the CLI says it in one line, exit 2."""
    from click.testing import CliRunner

    from mtpkit.cli import main
    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.errors import ConvertError
    from mtpkit.convert.trunk import QuantOptions

    target = bundle_copy("llama")
    bad = tmp_path / "bad"
    write_drafter(bad, drafter_config(**BAD[code]))
    with pytest.raises(ConvertError) as err:
        convert(str(target), tmp_path / "out", ConvertOptions(
            quant=QuantOptions(quantize=False), drafter=str(bad)))
    assert err.value.code == code.strip() and not (tmp_path / "out").exists()
    no = CliRunner().invoke(main, ["convert", str(target), str(tmp_path / "no"),
                                   "--drafter", str(bad)])
    errors = [line for line in no.output.splitlines() if line.startswith("error")]
    assert no.exit_code == 2 and len(errors) == 1 and f"[{code.strip()}]" in errors[0], no.output
    assert not (tmp_path / "no").exists()


def test_doctor_reports_a_damaged_dflash_drafter(bundle_copy: Callable[..., Path]) -> None:
    """doctor reads a bundle's dflash/ as load does: a missing tensor is an error located at
    the drafter's file, and the bundle is not ok."""
    from mtpkit.verify.doctor import report

    path = bundle_copy("llama")
    write_drafter(path / "dflash", drafter_config(**LLAMA))
    assert report(path)["summary"]["ok"]
    weights = mx.load(str(path / "dflash" / "model.safetensors"))
    weights.pop("fc.weight")
    mx.save_safetensors(str(path / "dflash" / "model.safetensors"), weights)
    doc = report(path)
    missing = [f for f in doc["findings"] if f["code"] == "weights.missing"]
    assert not doc["summary"]["ok"] and missing, doc["findings"]
    assert all("dflash" in f["location"] for f in missing), missing
