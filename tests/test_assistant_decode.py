"""Gemma 4's assistant decoding (decoder/drafters/assistant.py as a session's `model` proposer).

1. Greedy identity with stock mlx-lm's greedy decoding of the target, at depths 1 and 3 and
   under auto, past the sliding window, with drafts both kept and rejected.
2. Rollback: after every round the target's caches, as the assistant reads them, and the kept
   hidden equal a fresh prefill's of the committed text (wrapped sliding windows included).
3. The sampled law: the first tokens of generations drafted by the assistant, against the
   target's enumerated joint law; a wrong replacement rule fails it.
4. Batches: a Gemma 4 target's rows in a batch (its sliding windows as mlx-lm's batched
   window, decoder/cache/batch_cache.py), each drafted by the assistant over its own row of the
   batch's caches: every row's tokens and acceptance counts equal its lone decoding, greedy
   and seeded at temperature 0.6, with rows joining as others leave; one at a time too. A
   batch above 1 was refused on every Python entry; each now takes one.
   Mutants these kill (applied by hand to a copy of the tree): the row's drafts reading the
   batch's buffers unmasked (other rows' padding and holes): the e2b batch and both seeded
   batches; a batched round that does not keep the row's last hidden for the assistant: both
   seeded batches.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from test_exactness import ALPHA, replacement_from_p, stock_greedy

import mtpkit
from fixtures.gemma4 import build_echo_assistant, build_target
from fixtures.laws import pvalue
from mtpkit.decoder.drafters.assistant import AssistantDrafter, attach, final_normed, shared_kv
from mtpkit.decoder.options import OptionError, SamplingParams, Source
from mtpkit.decoder.rounds import acceptance
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.sampling import probabilities
from mtpkit.loaders.findings import UserError

WINDOW = 8  # the fixtures' sliding_window
PROMPT = [89, 214, 115, 98, 183, 3, 55, 14, 160, 248, 71, 24]  # runs broken by other tokens


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """variant -> a converted bundle of a target that writes runs of tokens and the assistant
    that mostly drafts the last one again (fixtures/gemma4.py), built once, read-only."""
    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.trunk import QuantOptions

    root = tmp_path_factory.mktemp("assistant-decode")
    out = {}
    for variant in ("31b", "e2b"):
        target = build_target(variant, root / variant, embed=0.3)
        assistant = build_echo_assistant(variant, target, root / f"{variant}-assistant")
        out[variant] = root / f"{variant}-bundle"
        convert(str(target), out[variant], ConvertOptions(quant=QuantOptions(quantize=False),
                                                          drafter=str(assistant)))
    return out


def loaded(path: Path) -> Runner:
    """The bundle as mtpkit.load(path) will load it once runner.load attaches the drafter."""
    runner = mtpkit.load(path, dtype="float32")
    assert attach(runner, path)
    return runner


# -- 1. greedy identity ----------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["31b", "e2b"])
def test_greedy_equals_stock_mlx_lm(bundles: dict[str, Path], variant: str) -> None:
    path = bundles[variant]
    reference, _ = stock_greedy(path, PROMPT, 48)
    assert len(PROMPT) + len(reference) > 4 * WINDOW  # the sliding layers' windows wrap
    runner = loaded(path)
    assert isinstance(runner.drafter, AssistantDrafter)
    assert runner.draft_source("auto", None) is Source.MODEL  # the default once attached
    for depth in (1, 3, "auto"):
        result = runner.generate(PROMPT, 48, depth=depth)
        assert result.tokens == reference, depth
        stats = result.stats
        if depth == "auto":  # auto may choose plain steps throughout where rounds are dear here
            assert set(stats.sources) <= {"model"}, stats.sources
        else:
            assert set(stats.sources) == {"model"}, depth
            assert stats.corrections > 0 and sum(stats.accepted) > 0, (depth, stats.accepted)


@pytest.mark.parametrize("prompt", [PROMPT[:2], PROMPT[:6], PROMPT[:7]])
def test_greedy_from_a_prompt_shorter_than_the_window(bundles: dict[str, Path],
                                                      prompt: list[int]) -> None:
    """Rounds that carry the sliding window past its edge before it has wrapped."""
    path = bundles["31b"]
    reference, _ = stock_greedy(path, prompt, 30)
    runner = loaded(path)
    for depth in (1, 3):
        assert runner.generate(prompt, 30, depth=depth).tokens == reference, depth


def test_a_rejected_pass_across_the_window_edge(bundles: dict[str, Path]) -> None:
    """The target's rollback alone (no assistant: forced drafts the target rejects), from a
    6-token prompt through a 4-token pass into an 8-token window, then plain steps: stock's
    text. caches.snapshot saves a sliding window the pass will wrap, not only one that has
    wrapped: before, the rejected keys stayed in the window."""
    from mtpkit.decoder.drafters.drafts import Draft

    path, prompt = bundles["31b"], PROMPT[:6]
    reference, _ = stock_greedy(path, prompt, 20)
    runner = loaded(path)
    session = Session(runner.trunk, None, SamplingParams(), 3, draft=Source.MODEL,
                      drafter=runner.drafter)
    text = [session.start(prompt)]
    wrong = next(t for t in range(3, 500) if t not in reference[:4])
    outcome = session.round(Draft(mx.array([[session.last, wrong, wrong, wrong]]), None,
                                  Source.MODEL, 3))
    assert outcome.kept == 0 and session.cache[0].offset == len(prompt) + 1
    text += outcome.committed
    while len(text) < len(reference):
        text += session.round(session.head_draft(0)).committed
        _same_reads(runner, session, prompt + text)
    assert text == reference


def _same_reads(runner: Runner, session: Session, text: list[int]) -> None:
    """The session's caches, as the assistant reads them, are a fresh prefill's of `text` but
    its last token (not cached yet)."""
    drafter = runner.drafter
    assert isinstance(drafter, AssistantDrafter)
    fresh = runner.trunk.make_cache()
    runner.trunk(mx.array([text[:-1]]), fresh, logits_for=0)
    mine, theirs = _reads(drafter, session.cache), _reads(drafter, fresh)
    for kind in mine:
        for a, b in zip(mine[kind], theirs[kind], strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


def test_no_assistant_no_drafter(bundles: dict[str, Path], tmp_path: Path) -> None:
    """A bundle without assistant/ (nor a manifest naming one): attach leaves the runner as
    it was."""
    path = shutil.copytree(bundles["31b"], tmp_path / "b", ignore=shutil.ignore_patterns(
        "assistant", "mtpkit.json"))
    runner = mtpkit.load(path)
    assert not attach(runner, path) and runner.drafter is None


# -- 2. rollback -----------------------------------------------------------------------------

def _reads(drafter: AssistantDrafter, caches: list) -> dict[str, tuple[mx.array, mx.array]]:
    """What the assistant's layers attend over: every full-attention position, the last
    WINDOW sliding positions (a fresh multi-token prefill leaves one more in mlx-lm's cache
    than token-by-token steps do; the assistant's own window covers both)."""
    kv, _ = shared_kv(caches, drafter.reads, WINDOW)
    return {kind: (k[..., -WINDOW:, :], v[..., -WINDOW:, :]) if kind == "sliding_attention"
            else (k, v) for kind, (k, v) in kv.items()}


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, top_k=8)])
def test_rollback_leaves_what_a_fresh_prefill_leaves(bundles: dict[str, Path],
                                                     params: SamplingParams) -> None:
    """After each round (kept 0 to 3, sliding windows wrapped): the target's caches as the
    assistant reads them, and the session's kept hidden, are a fresh prefill's of the committed
    text but the last token; nothing else of the assistant's changes."""
    runner = loaded(bundles["31b"])
    drafter = runner.drafter
    assert isinstance(drafter, AssistantDrafter)
    session = Session(runner.trunk, None, params, 3, seed=4, draft=Source.MODEL,
                      drafter=drafter)
    assert session.assistant_hidden is None
    text = [*PROMPT, session.start(PROMPT)]
    kept = set()
    for _ in range(14):
        outcome = session.next_round(3)
        text += outcome.committed
        kept.add(outcome.kept)
        hidden, _ = runner.trunk(mx.array([text[:-1]]), runner.trunk.make_cache(),
                                 logits_for=0)
        assert session.last == text[-1] and session.cache[0].offset == len(text) - 1
        np.testing.assert_allclose(np.array(session.assistant_hidden),
                                   np.array(hidden[:, -1:]), atol=1e-4)
        _same_reads(runner, session, text)
    assert 0 in kept and max(kept) > 0, kept
    assert len(text) > 3 * WINDOW


def test_a_plain_stretch_keeps_the_hidden(bundles: dict[str, Path]) -> None:
    """Plain steps (a controller's stretch) leave the hidden of the last position they cached,
    so the next round drafts from the right place."""
    runner = loaded(bundles["31b"])
    session = Session(runner.trunk, None, SamplingParams(), 3, draft=Source.MODEL,
                      drafter=runner.drafter)
    text = [*PROMPT, session.start(PROMPT)]
    text += list(session.plain_steps(5))
    hidden, _ = runner.trunk(mx.array([text[:-1]]), runner.trunk.make_cache(), logits_for=0)
    np.testing.assert_allclose(np.array(session.assistant_hidden), np.array(hidden[:, -1:]),
                               atol=1e-4)


def test_a_pre_norm_trunk_is_normed_by_its_own_norm(bundles: dict[str, Path]) -> None:
    """A trunk that returns the pre-norm hidden (a head fed pre_norm): the assistant reads it
    after the trunk's own final norm, the post-norm hidden a post_norm trunk returns."""
    from mlx_lm.utils import load_model

    from mtpkit.decoder.model.trunk import Trunk

    tokens = mx.array([PROMPT])
    post, pre = (Trunk(load_model(bundles["31b"])[0], feed) for feed in ("post_norm",
                                                                          "pre_norm"))
    want, _ = post(tokens, post.make_cache(), logits_for=0)
    got, _ = pre(tokens, pre.make_cache(), logits_for=0)
    assert not np.allclose(np.array(got), np.array(want), atol=1e-3)
    np.testing.assert_allclose(np.array(final_normed(pre, got)), np.array(want), atol=1e-4)


# -- 3. the sampled law ----------------------------------------------------------------------

LAW = SamplingParams(2.0, top_k=2)  # flat enough that no outcome dominates
LAW_TOKENS, LAW_RUNS = 4, 400  # the first four tokens: the prefill's, then a round drafting 2
LAW_PROMPT = [3, 200]  # short: the round's pass stays inside the window


def joint_law(runner: Runner, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The target's joint law of the first LAW_TOKENS tokens under LAW, enumerated over the
    tokens its filter keeps."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(LAW_TOKENS):
        grown = {}
        for prefix, mass in law.items():
            _, logits = runner.trunk(mx.array([prompt + list(prefix)]),
                                     runner.trunk.make_cache())
            p = probabilities(logits[0, -1:], LAW)[0]
            grown |= {(*prefix, int(t)): mass * float(p[t]) for t in np.flatnonzero(p)}
        law = grown
    return law


def sampled(runner: Runner, prompt: list[int]) -> tuple[Counter, list[int]]:
    """LAW_RUNS seeded generations' first tokens, and their rounds' drafts kept at the first
    and second place and rejected."""
    seen, accepted = Counter(), [0, 0, 0]
    for seed in range(LAW_RUNS):
        result = runner.generate(prompt, LAW_TOKENS, depth=3, seed=seed,
                                 temperature=LAW.temperature, top_k=LAW.top_k)
        seen[tuple(result.tokens)] += 1
        for i, count in enumerate(result.stats.accepted[:2]):
            accepted[i] += count
        accepted[2] += result.stats.corrections
    return seen, accepted


def test_sampled_tokens_follow_the_target_law(bundles: dict[str, Path]) -> None:
    runner = loaded(bundles["31b"])
    law = joint_law(runner, LAW_PROMPT)
    seen, (first, second, rejected) = sampled(runner, LAW_PROMPT)
    assert min(first, second, rejected) > LAW_RUNS // 10  # kept at both places, and rejected
    assert sum(seen.values()) == LAW_RUNS and set(seen) <= set(law)
    assert pvalue(seen, law) > ALPHA, (seen, law)


def test_the_law_test_fails_a_wrong_rule(bundles: dict[str, Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the replacement after a rejection drawn from p, not from
    normalize(max(0, p - q)) with the assistant's q."""
    monkeypatch.setattr(acceptance, "accept_sampled", replacement_from_p)
    runner = loaded(bundles["31b"])
    seen, _ = sampled(runner, LAW_PROMPT)
    assert pvalue(seen, joint_law(runner, LAW_PROMPT)) < 1e-10


# -- 4. batches ------------------------------------------------------------------------------

BATCH_PROMPTS = [PROMPT, PROMPT[3:], [7, 7, 300, 41, 41, 41], PROMPT * 2]  # windows wrap
BATCH_EACH: list[dict[str, Any]] = [  # other depths beside, and max_tokens: rows leave apart
    {"depth": 3, "max_tokens": 40}, {"depth": 1, "max_tokens": 24},
    {"depth": 0, "max_tokens": 30}, {"depth": 2, "max_tokens": 40}]


def _same_as_alone(runner: Runner, each: list[dict[str, Any]], max_batch: int) -> list[Any]:
    """Every prompt decoded alone and in a batch: the same tokens and acceptance counts."""
    alone = [runner.generate(p, **e) for p, e in zip(BATCH_PROMPTS, each, strict=True)]
    batched = runner.generate_batch(BATCH_PROMPTS, each=each, max_batch=max_batch)
    for a, b in zip(alone, batched, strict=True):
        assert b.tokens == a.tokens
        assert b.stats.sources == a.stats.sources  # drafts proposed and kept per position
        assert (b.stats.verify_calls, b.stats.corrections) == (a.stats.verify_calls,
                                                               a.stats.corrections)
    return batched


@pytest.mark.parametrize("variant", ["31b", "e2b"])
def test_a_batch_decodes_every_row_as_alone(bundles: dict[str, Path], variant: str) -> None:
    """Greedy rows at depths 0 to 3, three at a time: the fourth joins as one leaves, and the
    last decodes solo again."""
    runner = loaded(bundles[variant])
    batched = _same_as_alone(runner, BATCH_EACH, 3)
    assert all(set(r.stats.sources) == {"model"} for r, e in zip(batched, BATCH_EACH,
                                                                strict=True) if e["depth"])
    assert sum(sum(r.stats.accepted) for r in batched) > 0
    assert sum(r.stats.corrections for r in batched) > 0


@pytest.mark.parametrize("variant", ["31b", "e2b"])
def test_seeded_rows_sample_the_same_text_batched(bundles: dict[str, Path],
                                                  variant: str) -> None:
    """At temperature 0.6 (top-p 0.95, top-k 20), each row seeded: its drafts, their laws and
    its draws are its lone decoding's."""
    sampled = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    each = [e | sampled | {"seed": i} for i, e in enumerate(BATCH_EACH)]
    batched = _same_as_alone(loaded(bundles[variant]), each, 3)
    assert sum(sum(r.stats.accepted) for r in batched) > 0


def test_prompts_one_at_a_time_equal_alone(bundles: dict[str, Path]) -> None:
    _same_as_alone(loaded(bundles["31b"]), BATCH_EACH, 1)


def test_every_entry_takes_a_batch(bundles: dict[str, Path]) -> None:
    """The entries that refused a batch of a Gemma 4 target take one: generate_batch and
    stream_batch decode it as alone, batch_costs times nothing (no head: the assistant's
    rounds are priced as alone), serve's service batches up to its max_batch."""
    from mtpkit.serve.service import Service

    runner = loaded(bundles["31b"])
    alone = runner.generate(PROMPT, 8)
    assert [r.tokens for r in runner.generate_batch([PROMPT, PROMPT], 8, max_batch=2)] \
        == [alone.tokens] * 2
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for i, piece in runner.stream_batch([PROMPT, PROMPT], 8, max_batch=4):
        streamed[i] += piece.tokens
    assert streamed == {0: alone.tokens, 1: alone.tokens}
    assert runner.batch_costs(2) == ({}, False)
    assert Service(runner, "gemma", 3, 16, max_batch=2).max_batch == 2


def test_kv_bits_with_an_assistant_is_refused(bundles: dict[str, Path]) -> None:
    """--kv-bits: refused before the assistant loads (a sliding window's caches are not
    quantized; attach refuses a quantized KV cache on its own)."""
    path = bundles["31b"]
    with pytest.raises(OptionError) as raised:
        mtpkit.load(path, kv_bits=4)
    assert raised.value.code == "options.invalid"
    runner = mtpkit.load(path)
    before = runner.drafter
    assert isinstance(before, AssistantDrafter), "load attaches the bundle's assistant"
    runner.trunk.kv = object()  # as a runner whose caches would turn quantized
    with pytest.raises(OptionError) as raised:
        attach(runner, path)
    assert raised.value.code == "options.invalid" and raised.value.option == "kv_bits"
    assert runner.drafter is before, "a refused attach changes nothing"


def test_a_quantized_assistant_is_refused(bundles: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    path = shutil.copytree(bundles["31b"], tmp_path / "b")
    weights = load_file(str(path / "assistant" / "model.safetensors"))
    weights["pre_projection.scales"] = np.ones((32, 1), np.float32)
    save_file(weights, str(path / "assistant" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError) as raised:  # load attaches the bundle's assistant: refused
        mtpkit.load(path)
    assert raised.value.code == "options.invalid" and "quantized" in str(raised.value)
    assert "\n" not in str(raised.value)
