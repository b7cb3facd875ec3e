"""Many sequences in one batch (decoder/rounds/batch.py, scheduler.py): each decodes exactly as alone.

Greedy: every row's tokens (float32) and its acceptance counts (so its drafts too) equal its
lone decoding, for every family and draft source, with batch-mates at other depths, sources and
sampling settings, rows joining as others leave, and prompts of very different lengths (one
over the 2,048-token prefill chunk, prefilled between the others' rounds). An oracle drafter
forces each row's rejections at its own positions, so rows keep different counts in the same
pass and the recurrent families commit a different state per row. Prompts that start together
are prefilled in one left-padded pass where that pays (a GPU; forced here), and their rows
still decode as alone. Sampled: a seeded fixed-depth row gives the same text alone and
batched (a plain one beside speculative mates too), and the round-state law test
(test_exactness.py) holds for a row decoded among mates with other settings.

Mutants these tests kill (issue 33; each applied to a copy of the tree): one row's kept count
applied to another row; a rollback that trims every row by the batch's minimum; a joining row
that attends to the positions of the row before it (a mate's layout); a batched prefill
without its padding mask, or leaving a row's cache at the padded width. Re-run on 2026-11-29
at 68e42eb (decoder/ in sub-packages), each on a copy of the tree; the first failing test (-x):
- kept counts applied to other rows (rounds/batch.py round: rows' counts reversed in _settle) and
  every row trimmed by the batch's minimum (all keep max(kept) + 1):
  test_rows_keep_different_counts_in_one_pass[llama];
- a joining row given its mate's layout (cache/batch_cache.py Holes.join: the new row's valid
  is the last row's): test_every_row_decodes_as_alone[qwen3_5] ([llama] passes);
- a batched prefill without its padding mask (rounds/batch_prefill.py: left_padding zeroed after
  BatchKVCache(pads), RoPE offsets kept) and a row's cache left at the padded width (FrozenKV of
  all `width` positions): test_prompts_that_start_together_prefill_in_one_pass[False];
- the recurrent replay's batch lengths path one position too many or too few
  (cache/recording.py), which test_exactness.py does not reach:
  test_rows_keep_different_counts_in_one_pass[qwen3_5] ([llama] passes: no recurrent layer).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import chi2
from test_exactness import (
    ALPHA,
    LONG,
    MARKOV_LOGITS,
    MARKOV_PROMPT,
    MV,
    SETTINGS,
    assert_every_outcome,
    options,
    stratified_test,
    transition_law,
)

import mtpkit
from fixtures.decoder_models import BatchOracleHead, tiny_runner
from mtpkit.decoder.options import OptionError
from mtpkit.decoder.rounds.session import PREFILL_STEP
from mtpkit.decoder.runner import Runner

FAMILIES = ("llama", "qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "mimo")
REPEAT = [11, 12, 13, 14, 15, 16]  # a prompt whose text repeats: context drafts get kept
PROMPTS = [[5, 17, 42, 99, 7, 3], [7, 8], REPEAT * 4, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9],
           [21, 22, 23] * 3]
# mates at other depths and sources; different max_tokens, so rows leave at different rounds
EACH: list[dict[str, Any]] = [
    {"depth": 2, "max_tokens": 40}, {"depth": 0, "max_tokens": 24},
    {"depth": 3, "draft": "lookup", "max_tokens": 40}, {"depth": 4, "max_tokens": 33},
    {"depth": 3, "draft": "both", "max_tokens": 40}]


def _bare(runner: Runner) -> Runner:
    """Token-id prompts and no EOS: every row runs to its max_tokens (test_decoder's _no_eos)."""
    return Runner(runner.trunk, runner.head, None)


def _alone(runner: Runner, prompts: list[list[int]], each: list[dict[str, Any]]) -> list[Any]:
    return [runner.generate(p, **e) for p, e in zip(prompts, each, strict=True)]


def _streamed(runner: Runner, prompts: list[list[int]], each: list[dict[str, Any]],
              max_batch: int) -> tuple[list[int], list[Any]]:
    """Which prompt each streamed piece belonged to, in order, and every prompt's Result."""
    order: list[int] = []
    results: list[Any] = [None] * len(prompts)
    for i, piece in runner.stream_batch(prompts, max_batch=max_batch, each=each):
        order.append(i)
        if piece.result is not None:
            results[i] = piece.result
    return order, results


def _same(alone: Any, batched: Any) -> None:
    assert batched.tokens == alone.tokens
    for name in ("verify_calls", "proposed", "accepted", "bonus", "corrections"):
        assert getattr(batched.stats, name) == getattr(alone.stats, name), name


@pytest.fixture(scope="module")
def runners(built: Callable[..., Path]) -> Callable[[str], Runner]:
    cache: dict[str, Runner] = {}

    def get(family: str) -> Runner:
        if family not in cache:
            cache[family] = _bare(mtpkit.load(built(family), dtype="float32"))
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_decodes_as_alone(runners: Callable[[str], Runner], family: str) -> None:
    runner = runners(family)
    each = [e for e in EACH if family != "llama" or e.get("draft") == "lookup"
            or e["depth"] == 0]  # the llama fixture has no head
    prompts = PROMPTS[:len(each)]
    alone = _alone(runner, prompts, each)
    order, batched = _streamed(runner, prompts, each, max_batch=3)
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)
    if len(prompts) > 3:  # the fourth joined after a row left, mid-way through the others
        assert order.index(3) > order.index(1) > 0
    verified = [r.stats.verify_calls for r, e in zip(batched, each, strict=True) if e["depth"]]
    assert all(verified)  # every speculative row verified drafts (kept ones: the oracle test)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_long_prompt_joins_in_chunks_between_rounds(runners: Callable[[str], Runner],
                                                      family: str) -> None:
    runner = runners(family)
    long = [(7 * i + 3) % 200 + 1 for i in range(PREFILL_STEP + 60)]
    prompts = [PROMPTS[0], long, REPEAT * 3]
    each = [{"depth": 0 if family == "llama" else 2, "max_tokens": 30},
            {"depth": 0, "max_tokens": 12}, {"depth": 3, "draft": "lookup", "max_tokens": 30}]
    alone = _alone(runner, prompts, each)
    order, batched = _streamed(runner, prompts, each, max_batch=4)
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)
    # the long prompt's chunks (more where recurrent caches take bounded pieces): the first
    # row's first token, then its rounds between them
    assert order[0] == 0 and set(order[:order.index(1)]) == {0}
    assert order[:order.index(1)].count(0) >= 2


def _oracle_batch(runner: Runner, prompts: list[list[int]], seeds: list[int], n: int
                  ) -> tuple[Runner, list[list[int]]]:
    """A runner whose head drafts each row's plain greedy continuation, wrong at a fifth of
    that row's positions (drawn from its seed), and the plain continuations."""
    vocab = runner.trunk.args.vocab_size
    plain = [runner.generate(p, n, depth=0).tokens for p in prompts]
    script: dict[tuple[int, int], int] = {}
    for prompt, tokens, seed in zip(prompts, plain, seeds, strict=True):
        seq, wrong = prompt + tokens, random.Random(seed)
        for i in range(len(prompt) + 1, len(seq)):
            script[(i, seq[i - 1])] = (seq[i] + 1) % vocab if wrong.random() < 0.2 else seq[i]
    return Runner(runner.trunk, BatchOracleHead(vocab, script), None), plain  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_next"])
def test_rows_keep_different_counts_in_one_pass(runners: Callable[[str], Runner],
                                                built: Callable[..., Path], family: str) -> None:
    """Forced rejections at each row's own positions: in one pass rows keep 0..K drafts each,
    and every row still decodes its plain greedy tokens (attention holes and recurrent states
    committed per row)."""
    base = runners(family) if family != "llama" else _bare(mtpkit.load(built("llama"),
                                                                        dtype="float32"))
    prompts = [PROMPTS[0], PROMPTS[3], [9, 8, 7, 6, 5, 4, 3]]
    oracle, plain = _oracle_batch(base, prompts, [1, 2, 3], 90)
    each = [{"depth": 1, "max_tokens": 90}, {"depth": 3, "max_tokens": 90},
            {"depth": 4, "max_tokens": 90}]
    results = oracle.generate_batch(prompts, each=each)
    for result, tokens, e in zip(results, plain, each, strict=True):
        assert result.tokens == tokens
        stats = result.stats
        assert stats.bonus > 0 and stats.corrections > 0
        kept = {k for _, _, d, k in stats.timeline if d == e["depth"]}
        assert kept == set(range(e["depth"] + 1)), (e, kept)


def test_a_seeded_row_samples_the_same_text_alone_and_batched() -> None:
    runner = tiny_runner(vocab=6)
    prompts = [[1, 2, 3, 4, 5], [0, 1], [3, 1, 4, 1, 5, 2] * 3, [2, 2, 2, 2]]
    each = [{"depth": 2, "temperature": 0.9, "seed": 3, "max_tokens": 40},
            {"depth": 0, "max_tokens": 30},
            {"depth": 3, "draft": "both", "temperature": 0.7, "top_k": 3, "seed": 1,
             "max_tokens": 40},
            {"depth": 4, "temperature": 1.0, "top_p": 0.9, "seed": 9, "max_tokens": 35}]
    alone = _alone(runner, prompts, each)
    for a, b in zip(alone, runner.generate_batch(prompts, each=each, max_batch=3),
                    strict=True):
        _same(a, b)
    assert sum(a.stats.accepted[0] for a in alone if a.stats.accepted) > 0


@pytest.mark.parametrize("mate", [2, "auto"])
def test_a_seeded_plain_row_samples_the_same_text_beside_a_speculative_mate(
        mate: int | str) -> None:
    """A seeded row at depth 0 draws one plain step's uniforms per token whether it runs alone
    (pipelined plain steps) or as a depth-0 row of a speculative batch round (a round there
    had drawn one ratio test more, and every later token differed)."""
    from mtpkit.decoder.tuning.curve import CostCurve

    runner = tiny_runner(vocab=6)
    # rounds priced as plain steps, taken as given: auto speculates on any machine
    runner._costs = CostCurve([0.01] * 16, 0.01, 0.0)
    prompts = [[1, 2, 3, 4], [5, 4, 3]]
    row = {"depth": 0, "temperature": 0.8, "seed": 5, "max_tokens": 40}
    alone = runner.generate(prompts[0], **row)
    batched = runner.generate_batch(prompts, each=[row, {"depth": mate, "max_tokens": 40}],
                                    max_batch=2)
    assert batched[0].tokens == alone.tokens
    assert batched[1].stats.verify_calls > 0  # the mate's rounds carried the plain row


def _batch_rounds(runner: Runner, depth: int, pipelined: bool = False, **kwargs: Any
                  ) -> tuple[list[int], list[tuple[int, int]]]:
    """The first row's tokens and rounds (drafted, kept) decoded among mates with other
    settings (test_exactness.rounds_of, batched); `pipelined`: mates at its depth, so that
    the batch's rounds run pipelined (Batch.spec_rounds)."""
    mates = [{"depth": depth if pipelined else 1, "max_tokens": LONG // 3},
             {"depth": depth if pipelined else 2, "temperature": 0.5, "seed": 2,
              "max_tokens": LONG // 2}]
    each = [{"depth": depth, "max_tokens": LONG, **kwargs}, *mates]
    pieces = [p for i, p in runner.stream_batch([MARKOV_PROMPT, [1, 2], [3, 3, 0]], each=each)
              if i == 0]
    *steps, last = pieces
    tokens, outcomes = list(steps[0].tokens), []
    for piece in steps[1:]:
        outcomes.append((min(depth, LONG - len(tokens) - 1), len(piece.tokens) - 1))
        tokens += piece.tokens
    assert last.result is not None and last.result.tokens == tokens
    return tokens, outcomes


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("setting", ["temperature", "top_p_min_p"])
def test_a_batched_row_emits_the_target_law_in_every_round_state(
        setting: str, pipelined: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    params, draft_vocab, head_norm = SETTINGS[setting]
    runner = tiny_runner(vocab=MV, draft_vocab=draft_vocab, head_norm=head_norm, markov=True,
                         logit_scale=MARKOV_LOGITS)
    law = transition_law(runner, params)
    # (not pipelined: this backend's synchronous rounds throughout; queued ahead as on a GPU,
    # the row left alone would go on as a batch of one, pipelined)
    rounds = _pipelined_seen(monkeypatch, "spec_rounds", ahead=pipelined)
    stat, df = 0.0, 0
    for depth in (2, 3, 4):
        tokens, outcomes = _batch_rounds(runner, depth, pipelined, seed=depth, **options(params))
        assert len(tokens) == LONG
        assert_every_outcome(outcomes, (depth,))
        s, d = stratified_test(law, tokens, outcomes)
        stat, df = stat + s, df + d
    assert chi2.sf(stat, df) > ALPHA, (stat, df)
    assert bool(rounds) == pipelined


def test_a_cancelled_row_leaves_and_the_others_go_on() -> None:
    runner = tiny_runner(vocab=6)
    seen: list[int] = []

    def gone() -> bool:
        return len(seen) >= 5

    each = [{"depth": 2, "max_tokens": 30}, {"depth": 2, "max_tokens": 30, "stop": gone}]
    alone = runner.generate([1, 2, 3], 30, depth=2)
    results: list[Any] = [None, None]
    for i, piece in runner.stream_batch([[1, 2, 3], [4, 5]], each=each):
        if i == 1:
            seen += piece.tokens
        if piece.result is not None:
            results[i] = piece.result
    assert results[0].tokens == alone.tokens
    assert 5 <= len(results[1].tokens) < 30 and results[1].finish_reason == "stop"


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_batch_is_refused_with_its_code(bad: Any) -> None:
    with pytest.raises(OptionError) as refused:
        list(tiny_runner(vocab=6).stream_batch([[1, 2]], max_batch=bad))
    assert refused.value.code == "options.invalid"


def test_bounded_attention_shapes_decode_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a GPU compiles each attention shape (decoder/cache/shapes.py), a batch's passes see keys
    padded to whole steps, hidden by the mask: the same tokens as alone."""
    import mtpkit.decoder.rounds.batch as batch

    monkeypatch.setattr(batch, "bounded_by_default", lambda: True)
    runner = tiny_runner(vocab=6)
    prompts = [[1, 2, 3, 4, 5], [0, 1], [3, 1, 4, 1, 5, 2] * 50]
    each = [{"depth": 2, "max_tokens": 40}, {"depth": 0, "max_tokens": 30},
            {"depth": 3, "draft": "both", "max_tokens": 40}]
    alone = _alone(runner, prompts, each)
    scheduler_batches: list[Any] = []
    real = batch.Batch.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        scheduler_batches.append(self)

    monkeypatch.setattr(batch.Batch, "__init__", spy)
    for a, b in zip(alone, runner.generate_batch(prompts, each=each), strict=True):
        _same(a, b)
    assert scheduler_batches and all(b.bounded for b in scheduler_batches)


def _prefills(monkeypatch: pytest.MonkeyPatch, gpu: bool = True) -> list[int]:
    """The sizes of the batched prefills the scheduler runs (a spy on prefill_together), as
    on a GPU (where they pay) unless `gpu` is False."""
    import mtpkit.decoder.rounds.scheduler as scheduler

    sizes: list[int] = []
    real = scheduler.prefill_together

    def spy(sessions: list[Any], prompts: list[list[int]]) -> list[int]:
        sizes.append(len(sessions))
        return real(sessions, prompts)

    monkeypatch.setattr(scheduler, "prefill_together", spy)
    monkeypatch.setattr(scheduler, "prefill_pays", lambda: gpu)
    return sizes


@pytest.mark.parametrize("bounded", [False, True])
def test_prompts_that_start_together_prefill_in_one_pass(monkeypatch: pytest.MonkeyPatch,
                                                         bounded: bool) -> None:
    """Requests waiting together are prefilled in one left-padded pass: each sends its first
    token before any round, and every row (head, context and plain drafts; prompts of 2 to 300
    tokens) then decodes exactly as alone, with bounded shapes (a GPU's) too."""
    import mtpkit.decoder.rounds.session as session

    monkeypatch.setattr(session, "bounded_by_default", lambda: bounded)
    runner = tiny_runner(vocab=6)
    prompts = [[1, 2, 3, 4, 5], [0, 1], [3, 1, 4, 1, 5, 2] * 50, [2, 2, 1]]
    each = [{"depth": 2, "max_tokens": 40}, {"depth": 0, "max_tokens": 30},
            {"depth": 3, "draft": "both", "max_tokens": 40}, {"depth": 1, "max_tokens": 20}]
    alone = _alone(runner, prompts, each)
    sizes = _prefills(monkeypatch)
    order, batched = _streamed(runner, prompts, each, max_batch=3)
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)
    assert sizes[0] == 3 and order[:3] == [0, 1, 2], "three first tokens from one pass"
    assert order.index(3) > 3, "the fourth joined later, as a place freed up"


def test_a_cpu_prefills_prompts_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU one pass of N prompts costs their sum, and the first waits for all: each is
    prefilled alone, its first token sent before the next prompt's prefill."""
    runner = tiny_runner(vocab=6)
    prompts, each = [[1, 2, 3, 4, 5], [0, 1], [2, 2, 1]], [{"depth": 2, "max_tokens": 8}] * 3
    sizes = _prefills(monkeypatch, gpu=False)
    _streamed(runner, prompts, each, max_batch=3)
    assert sizes == []


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_only_attention_trunks_prefill_together(runners: Callable[[str], Runner],
                                                monkeypatch: pytest.MonkeyPatch,
                                                family: str) -> None:
    """A hybrid trunk's recurrent layers would run their state through the left padding: its
    prompts are prefilled one at a time; an attention trunk (DeepSeek's latent attention)
    prefills them together. Either way every row decodes as alone."""
    runner = runners(family)
    prompts, each = PROMPTS[:3], [dict(e) for e in EACH[:3]]
    alone = _alone(runner, prompts, each)
    sizes = _prefills(monkeypatch)
    _, batched = _streamed(runner, prompts, each, max_batch=3)
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)
    assert sizes == ([] if family == "qwen3_5" else [3])


def test_a_cached_prompt_is_restored_not_prefilled_with_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt with a cached prefix starts from it alone; the ones after it still go
    together."""
    from mtpkit.decoder.cache.prefix import PrefixCache
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.rounds.scheduler import Scheduler

    runner = tiny_runner(vocab=6)
    prefix = PrefixCache(1 << 26)
    prompts = [[1, 2, 3, 4, 5, 0, 1], [0, 1, 2], [5, 4, 3, 2]]
    warm = runner.prepare(prompts[0][:5], depth=2, max_tokens=4, prefix=prefix)
    scheduler = Scheduler(Batch(runner.trunk, runner.head), 4)
    scheduler.add(warm)
    while scheduler:
        scheduler.step()
    alone = [runner.generate(p, depth=2, max_tokens=12) for p in prompts]
    sizes = _prefills(monkeypatch)
    requests = [runner.prepare(p, depth=2, max_tokens=12, prefix=prefix) for p in prompts]
    for request in requests:
        scheduler.add(request)
    while scheduler:
        scheduler.step()
    assert requests[0].session.cached_tokens == 5 and sizes == [2]
    assert (prefix.hits, prefix.misses) == (1, 3), "one hit, the warm-up's and two misses"
    assert [r.tokens for r in requests] == [a.tokens for a in alone]


def test_a_batchs_rounds_are_priced_at_the_keys_its_pass_attends_over() -> None:
    """A batch's round is priced by the curve at its context, as a lone sequence's is: with
    rounds as cheap as a step at the curve's first context (512) and 20 steps' worth from 1,024
    keys, rows whose head drafts right 80% of the time speculate over short prompts and decode
    plainly past 1,024 tokens. (Priced at the first context, the long batch speculated too.)"""
    from mtpkit.decoder.tuning.curve import CostCurve, Point

    base = tiny_runner(vocab=6)
    short = [[1, 2, 3, 4], [5, 4, 3]]
    long = [[1, 2, 3, 4, 5] * 260, [5, 4, 3, 0] * 330]
    for prompts, speculates in ((short, True), (long, False)):
        runner, plain = _oracle_batch(base, prompts, [1, 2], 24)
        runner._costs = CostCurve([0.01] * 16, 0.01, 0.0,
                                  longer=[Point(1024, [0.2] * 16, 0.01)])
        rows = runner.generate_batch(prompts, 24, max_batch=2, depth="auto")
        assert [r.tokens for r in rows] == plain
        rounds = sum(n for r in rows for d, n in r.stats.depths.items() if d > 0)
        assert (rounds > 0) == speculates, [r.stats.depths for r in rows]


def test_a_batchs_passes_are_corrected_against_their_price_at_its_keys() -> None:
    """What a batch's pass paid is compared with the prior at the keys it attended over, as its
    price was taken: on a curve ten times dearer from 1,024 keys (plain steps too), every
    correction a long batch records divides its timing by the dear prior. (Observed against the
    first context's prior, its corrections came out ten times too large, and a long batch was
    priced at the long context's cost times that.)"""
    from mtpkit.decoder.tuning.curve import CostCurve, Point

    base = tiny_runner(vocab=6)
    long = [[1, 2, 3, 4, 5] * 260, [5, 4, 3, 0] * 330]
    runner, plain = _oracle_batch(base, long, [1, 2], 24)
    runner._costs = CostCurve([0.01] * 16, 0.01, 0.0, estimate=True,
                              longer=[Point(1024, [0.2] * 16, 0.1)])
    rows = runner.generate_batch(long, 24, max_batch=2, depth="auto")
    assert [r.tokens for r in rows] == plain
    table = runner.paid
    assert table is not None and table.ratios, "the batch's passes were observed"
    for row in rows:  # each row's statistics say what it was priced by, its batch's shapes
        assert any(name.startswith("2x") for name in row.stats.cost_scale), row.stats.cost_scale
    for shape, ratios in table.ratios.items():
        priced = [t / r for t, r in zip(table.times[shape], ratios, strict=True)]
        short, dear = table.prior(shape, 0), table.prior(shape, 1300)
        assert dear > 5 * short, (shape, short, dear)
        assert all(p > 0.5 * dear for p in priced), (shape, priced, short, dear)


@pytest.mark.parametrize("depth", [0, 2, "auto"])
def test_a_lone_request_decodes_solo_then_joins_the_batch(depth: Any) -> None:
    """Alone, a request decodes on the single-sequence path (plain stretches pipelined, the
    controller choosing); when another arrives it ends its stretch at a clean point and joins
    the batch. Both still decode exactly as alone."""
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.rounds.scheduler import Scheduler
    from mtpkit.decoder.tuning.curve import CostCurve

    runner = tiny_runner(vocab=6)
    # a what-if curve where plain decoding wins at first: auto starts with a plain stretch
    runner._costs = CostCurve([0.01 * (1 + t) for t in range(16)], 0.011, 0.004)
    first = {"depth": depth, "max_tokens": 60}
    second = {"depth": 3, "draft": "both", "max_tokens": 30}
    alone = [runner.generate([1, 2, 3, 4], **first), runner.generate([5, 4, 3], **second)]
    scheduler = Scheduler(Batch(runner.trunk, runner.head), 4)
    a = runner.prepare([1, 2, 3, 4], **first)
    scheduler.add(a)
    rows, steps = [], 0
    while scheduler:
        scheduler.step()
        rows.append(scheduler.rows if scheduler.solo is None else 0)
        steps += 1
        if steps == 12:
            b = runner.prepare([5, 4, 3], **second)
            scheduler.add(b)
    assert rows[:12] == [0] * 12, "alone, the first request decoded solo"
    assert max(rows) == 2, "then both decoded in one batch"
    assert a.tokens == alone[0].tokens and b.tokens == alone[1].tokens
    assert a.finish == "length" and b.finish == "length"


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_every_row_decodes_as_alone_with_bounded_shapes(built: Callable[..., Path], family: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """As above with a GPU's bounded shapes and traced passes: the row that parts takes its
    batch buffers back without a copy, so a bounded cache must get them in whole STEPs (a
    buffer cut at the row's end gave a pass a shorter key view than its mask on the H200)."""
    import mtpkit.decoder.rounds.batch as batch

    monkeypatch.setattr(batch, "bounded_by_default", lambda: True)
    runner = _bare(mtpkit.load(built(family), dtype="float32"))
    runner.trunk.use_traced()
    each = [e for e in EACH if family != "llama" or e.get("draft") == "lookup"
            or e["depth"] == 0]
    prompts = PROMPTS[:len(each)]
    alone = _alone(runner, prompts, each)
    _, batched = _streamed(runner, prompts, each, max_batch=3)
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)


def test_traced_batch_passes_decode_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's verify passes traced once per shape (decoder/model/traced.py's run_rows: each row's
    RoPE offset and holes are inputs of the trace) decode the same tokens as alone."""
    import mtpkit.decoder.rounds.batch as batch

    monkeypatch.setattr(batch, "bounded_by_default", lambda: True)
    runner = tiny_runner(vocab=6)
    runner.trunk.use_traced()
    assert runner.trunk.passes is not None
    calls: list[int] = []
    real = runner.trunk.passes.run_rows

    def spy(tokens: Any, cache: Any, holes: Any) -> Any:
        out = real(tokens, cache, holes)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(runner.trunk.passes, "run_rows", spy)
    prompts = [[1, 2, 3, 4, 5], [0, 1], [3, 1, 4, 1, 5, 2] * 50, [2, 2, 2, 2]]
    each = [{"depth": 2, "max_tokens": 40}, {"depth": 0, "max_tokens": 30},
            {"depth": 3, "draft": "both", "max_tokens": 40},
            {"depth": 4, "temperature": 1.0, "seed": 9, "max_tokens": 35}]
    alone = _alone(runner, prompts, each)
    for a, b in zip(alone, runner.generate_batch(prompts, each=each, max_batch=3), strict=True):
        _same(a, b)
    assert calls and all(calls), "every batch pass was traced"


def _keen(curve: Any, max_depth: int, kept: float = 0.9, depth: int = 3) -> Any:
    """A row's policy (the batch's view of an auto row) whose head kept `kept` of its drafts
    at `depth`."""
    from mtpkit.decoder.tuning.policy import DepthPolicy

    row = DepthPolicy(curve, max_depth)
    for i in range(40):
        row.record(depth, depth if (i % 10) < 10 * kept else 0)
    return row


def _run(table: Any, offers: list[Any], max_depth: int, paid: Callable[[int], float],
         rounds: int) -> list[int]:
    """`rounds` batch rounds as `decide` plans them, each paying `paid(depth)` (0: a plain
    step of every row): the depths chosen."""
    from mtpkit.decoder.tuning.policy import decide

    rows, chosen = len(offers), []
    for _ in range(rounds):
        depth = decide(offers, table, max_depth).depth
        chosen.append(depth)
        table.tick(rows)
        table.observe((rows, depth + 1, depth == 0), paid(depth))
    return chosen


def test_the_policy_drops_a_depth_whose_batch_rounds_cost_more_than_priced() -> None:
    """A curve that makes drafts look free and rows that keep 90% of their drafts: where a
    batch's rounds really cost 3 plain steps per draft, the policy leaves the depths it tries
    as they are timed and decodes plain; where drafts are as cheap as priced it goes deepest."""
    from mtpkit.decoder.tuning.curve import CostCurve
    from mtpkit.decoder.tuning.policy import CostTable

    curve = CostCurve([0.01] * 16, 0.01, 0.0, estimate=True)
    for per_draft, want in ((3.0, 0), (0.02, 8)):
        offers = [_keen(curve, 8, depth=8).offer() for _ in range(4)]
        chosen = _run(CostTable(curve), offers, 8, lambda d, p=per_draft: 0.01 * (1 + p * d), 60)
        assert chosen[0] == 8 and chosen[-1] == want, (per_draft, chosen)
        assert chosen[-20:].count(want) >= 18, chosen


def test_a_new_batch_size_takes_the_nearest_sizes_correction() -> None:
    """Rows leave and join all the time: a size not timed yet is priced by the curve's prior
    for its rows x positions, corrected as the nearest size's same shape paid (then by its own
    timings, weighed by their count)."""
    from mtpkit.decoder.tuning.curve import CostCurve
    from mtpkit.decoder.tuning.policy import CostTable

    curve = CostCurve([0.01 + 0.001 * t for t in range(16)], 0.01, 0.0, estimate=True)
    table = CostTable(curve)
    for width in (1, 2, 3, 4):
        for _ in range(20):
            table.tick(4)
            table.observe((4, width, False), 2 * table.prior((4, width, False)))
    assert table.seconds((3, 3, False)) == pytest.approx(
        2 * table.prior((3, 3, False)), rel=0.05)
    assert table.prior((3, 3, False)) == pytest.approx(curve.verify[8])  # 9 tokens
    for _ in range(40):
        table.tick(3)
        table.observe((3, 3, False), table.prior((3, 3, False)))
    assert table.correction((3, 3, False)) < 1.15, "its own timings, once it has many"
    assert table.correction((4, 3, False)) == pytest.approx(2.0)


def test_a_copying_row_is_priced_by_the_match_it_would_draft_from() -> None:
    """A row whose text repeats (a 40-token line seen before: a match of 8) keeps 95% of the
    context drafts of long matches and 10% of one-token ones. Its offer to the policy is the
    long match's tracker, as its draft would be, so a depth-3 round pays and the row drafts
    from its context; a row whose text offers no match gains nothing from a context, and with
    a head that keeps little the batch decodes plain."""
    from types import SimpleNamespace

    from mtpkit.decoder.drafters.lookup import ContextIndex
    from mtpkit.decoder.options import Source
    from mtpkit.decoder.rounds.scheduler import _offer
    from mtpkit.decoder.tuning.curve import CostCurve
    from mtpkit.decoder.tuning.policy import DepthPolicy, decide

    curve = CostCurve([0.01 + 0.002 * t for t in range(16)], 0.01, 0.0)

    def row(text: list[int]) -> Any:
        policy = DepthPolicy(curve, 3, sources=(Source.HEAD, Source.LOOKUP))
        for i in range(40):
            policy.record(3, 3 if i % 20 else 0, Source.LOOKUP, match=8)
            policy.record(1, int(i % 10 == 0), Source.LOOKUP, match=1)
            policy.record(3, 0)  # the head keeps nothing
        index = ContextIndex()
        index.extend(text)
        return SimpleNamespace(policy=policy, session=SimpleNamespace(head=1, depth=3,
                                                                      lookup=index))

    line = [(7 * i) % 50 for i in range(40)]
    copying = row(line + line[:10])
    offer = _offer(copying)
    assert list(offer.context) == copying.policy.acceptance(Source.LOOKUP, 8)[:3]
    assert sum(offer.context) > 2.5 > 0.5 > sum(copying.policy.acceptance(Source.LOOKUP, 1)[:3])
    plan = decide([offer] * 4, copying.policy.costs, 3)
    assert plan.depth == 3 and set(plan.sources) == {Source.LOOKUP}
    fresh = row(list(range(50)))  # no earlier occurrence of any suffix
    assert list(_offer(fresh).context) == []
    assert decide([_offer(fresh)] * 4, fresh.policy.costs, 3).depth == 0


def test_plain_is_priced_by_pipelined_steps_once_timed() -> None:
    """Depth-1 rounds that beat plain steps as the curve prices them, but lose to plain steps
    as they really run: once a stretch's steps are timed, the policy decodes plain."""
    from mtpkit.decoder.tuning.curve import CostCurve
    from mtpkit.decoder.tuning.policy import CostTable, decide

    curve = CostCurve([0.02] * 16, 0.02, 0.0, estimate=True)
    offers = [_keen(curve, 1, kept=0.5, depth=1).offer() for _ in range(4)]
    table = CostTable(curve)
    for _ in range(20):  # a round's 1.5 tokens for 1.25 plain steps as priced
        table.tick(4)
        table.observe((4, 2, False), 0.025 * 4 / 4)
    assert decide(offers, table, 1).depth == 1
    for _ in range(20):
        table.tick(4)
        table.observe((4, 1, True), 0.012)  # a pipelined step: 1.5 tokens would need 0.018
    assert decide(offers, table, 1).depth == 0


def test_a_pipelined_round_is_priced_as_pipelined_passes_paid() -> None:
    """Where a round would run pipelined its prior is the synchronous pass's scaled by what
    pipelining saves a plain step (the curve's plain step over its one-row pass), and it takes
    the correction of the nearest pipelined round timed, never the synchronous rounds' nor
    the plain steps' (other kernels: CostTable.correction); so depths are compared as the
    batch would run them."""
    from mtpkit.decoder.tuning.curve import CostCurve
    from mtpkit.decoder.tuning.policy import CostTable, decide

    curve = CostCurve([0.01] * 16, 0.006, 0.0, estimate=True)
    table = CostTable(curve)
    assert table.prior((4, 2, True)) == pytest.approx(0.01 * 0.6)
    offers = [_keen(curve, 1, kept=0.75, depth=1).offer() for _ in range(4)]
    for _ in range(20):
        table.tick(4)
        table.observe((4, 2, False), 0.0227)  # synchronous: dear
        table.observe((4, 1, True), 0.0121)  # pipelined plain steps: 2x the curve
    assert decide(offers, table, 1).depth == 0  # 1.75 tokens for 22.7 ms
    assert table.correction((4, 2, True)) == 1.0  # (plain steps' 2x does not price it)
    assert decide(offers, table, 1, pipelined=True).depth == 1  # 1.75 for 6 ms
    for _ in range(20):  # run pipelined, the depth has its own price
        table.tick(4)
        table.observe((4, 2, True), 0.030)
    assert decide(offers, table, 1, pipelined=True).depth == 0


def _pipelined_seen(monkeypatch: pytest.MonkeyPatch, name: str = "plain_steps",
                    ahead: bool = True) -> list[int]:
    """The rows of every pipelined step or round batches take from now on (Batch.plain_steps,
    or Batch.spec_rounds), queued ahead as on a GPU (`ahead`; else as this backend does)."""
    import mtpkit.decoder.rounds.batch as batch
    from mtpkit.decoder.rounds.batch import Batch

    monkeypatch.setattr(batch, "overlaps", lambda: ahead)

    steps: list[int] = []
    real = getattr(Batch, name)

    def spy(self: Batch, *args: Any, **kwargs: Any) -> Any:
        for out in real(self, *args, **kwargs):
            steps.append(len(out[0]) if name == "plain_steps" else len(out))
            yield out

    monkeypatch.setattr(Batch, name, spy)
    return steps


@pytest.mark.parametrize("traced", [False, True])
def test_a_plain_stretch_runs_pipelined_and_decodes_the_same(
        monkeypatch: pytest.MonkeyPatch, traced: bool) -> None:
    """Under auto, where no draft pays (a head always wrong), the batch decodes plain
    stretches as pipelined steps of every row (Batch.plain_steps: the next pass queued before
    the last one's tokens are read); auto rows and a fixed plain one still decode as alone,
    rows leave mid-stretch at their max_tokens, and a request that arrives mid-stretch ends it
    and joins."""
    import mtpkit.decoder.rounds.batch as batch
    from mtpkit.decoder.tuning.policy import CostTable

    if traced:
        monkeypatch.setattr(batch, "bounded_by_default", lambda: True)
    base = tiny_runner(vocab=6)
    if traced:
        base.trunk.use_traced()
    prompts = [[1, 2, 3, 4], [5, 4, 3], [2, 2, 1], [0, 1, 2, 3, 4, 5]]
    each = [{"depth": "auto", "draft": "head", "max_tokens": 90},
            {"depth": "auto", "draft": "head", "max_tokens": 50}, {"depth": 0, "max_tokens": 70},
            {"depth": "auto", "draft": "head", "max_tokens": 40}]
    plain = [base.generate(p, e["max_tokens"], depth=0).tokens for p, e in zip(prompts, each, strict=True)]
    script = {}
    for prompt, tokens in zip(prompts, plain, strict=True):
        seq = prompt + tokens
        for i in range(len(prompt) + 1, len(seq)):
            script[(i, seq[i - 1])] = (seq[i] + 1) % 6  # never the right token
    runner = Runner(base.trunk, BatchOracleHead(6, script), None)  # type: ignore[arg-type]
    steps = _pipelined_seen(monkeypatch)
    # what-if round costs (a draft costs a plain step): the policy's choice, not this
    # machine's timings, is what this test holds fixed
    monkeypatch.setattr(CostTable, "pricer", _what_if(lambda width: 0.01 * width))
    order, batched = _streamed(runner, prompts, each, max_batch=3)
    assert [b.tokens for b in batched] == plain
    assert len(steps) > 40 and max(steps) == 3, "most steps ran pipelined, three rows at once"
    assert order.index(3) > order.index(1), "the fourth request joined after a row left"
    assert runner.paid is not None and runner.paid.times.get((3, 1, True)), \
        "pipelined steps price the batch's plain decoding"


@pytest.mark.parametrize("ahead", [True, False])
def test_a_batch_of_plain_rows_steps_pipelined(monkeypatch: pytest.MonkeyPatch,
                                              ahead: bool) -> None:
    """Rows at a fixed depth 0 (greedy and seeded sampled) decode in plain stretches, as
    alone, each step queued ahead of the last one's read (a GPU) or not (a CPU): the sampled
    row draws what its lone plain decoding draws."""
    runner = tiny_runner(vocab=6)
    steps = _pipelined_seen(monkeypatch, ahead=ahead)
    prompts = [[1, 2, 3, 4], [5, 4, 3], [2, 2, 1]]
    each = [{"depth": 0, "max_tokens": 30}, {"depth": 0, "temperature": 0.8, "seed": 5,
                                             "max_tokens": 40}, {"depth": 0, "max_tokens": 25}]
    alone = _alone(runner, prompts, each)
    batched = runner.generate_batch(prompts, each=each, max_batch=3)
    assert [b.tokens for b in batched] == [a.tokens for a in alone]
    assert len(steps) > 20 and max(steps) == 3


def test_a_batchs_plain_steps_reach_every_rows_drafters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens a batch's plain steps commit are every row's text, as a lone session's are: each
    row's context index holds its prompt and everything it decoded (where rounds are dear
    enough that the rows decode plainly throughout, in batched plain steps)."""
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.rounds.scheduler import Scheduler
    from mtpkit.decoder.tuning.policy import CostTable

    runner = tiny_runner(vocab=6)
    steps = _pipelined_seen(monkeypatch, ahead=False)
    monkeypatch.setattr(CostTable, "pricer", _what_if(lambda width: 0.01 * width ** 3))
    prompts = [[1, 2, 3, 1, 2], [5, 4, 3, 5], [2, 2, 1, 2]]
    scheduler = Scheduler(Batch(runner.trunk, runner.head), 3)
    requests = [runner.prepare(p, max_tokens=24, depth="auto", draft="lookup") for p in prompts]
    for request in requests:
        scheduler.add(request)
    while scheduler:
        scheduler.step()
    assert max(steps) == 3, "the rows decoded in batched plain steps"
    for request in requests:
        assert request.session.lookup is not None
        assert request.session.lookup.tokens == request.ids + request.tokens


@pytest.mark.parametrize("ahead", [False, True])
def test_a_waiting_request_waits_for_the_step_in_flight_only_on_a_cpu(ahead: bool) -> None:
    """A plain stretch queues its next step before reading the last only where host and device
    overlap (a GPU, Batch.pipelined); there a request arriving mid-stretch waits for the queued
    step too. On a CPU none is queued ahead: its prefill follows the step in flight. Either
    way every row decodes as alone."""
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.rounds.scheduler import Scheduler

    runner = tiny_runner(vocab=6)
    prompts = [[1, 2, 3, 4], [5, 4, 3], [2, 2, 1]]
    each = [{"depth": 0, "max_tokens": 30}, {"depth": 0, "max_tokens": 30},
            {"depth": 0, "max_tokens": 10}]
    alone = _alone(runner, prompts, each)
    batch = Batch(runner.trunk, runner.head)
    batch.pipelined = ahead
    scheduler = Scheduler(batch, 3)
    requests = [runner.prepare(p, **e) for p, e in zip(prompts, each, strict=True)]
    for request in requests[:2]:
        scheduler.add(request)
    while scheduler.stretch is None:
        scheduler.step()
    for _ in range(3):
        scheduler.step()
    late = requests[2]
    scheduler.add(late)
    mates = 0  # steps of the running rows before the late one's first token
    while late.first_at is None:
        mates += any(e.request is not late and e.tokens for e in scheduler.step())
    assert mates == (1 if ahead else 0)
    while scheduler:
        scheduler.step()
    assert [r.tokens for r in requests] == [a.tokens for a in alone]


def test_the_last_row_left_decodes_solo_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the batch drops to one row, that row's caches are compacted to its real positions
    and it decodes on the single-sequence path again (Batch.part), still exactly as alone:
    greedy and seeded sampled, head and context drafts, its acceptance counts too. (Where
    rounds pipeline, a last row at a fixed depth drafting from the head stays a batch of one:
    test_a_lone_request_at_a_fixed_depth_runs_as_a_batch_of_one_where_rounds_pipeline; here
    they do not, on every backend.)"""
    import mtpkit.decoder.rounds.batch as batch
    from mtpkit.decoder.rounds.batch import Batch

    monkeypatch.setattr(batch, "overlaps", lambda: False)
    runner = tiny_runner(vocab=6)
    parted: list[int] = []
    real = Batch.part

    def spy(self: Batch) -> Any:
        parted.append(len(self.rows))
        return real(self)

    monkeypatch.setattr(Batch, "part", spy)
    prompts = [[1, 2, 3, 4, 5], [0, 1], [3, 1, 4, 1, 5, 2] * 3]
    each = [{"depth": 2, "max_tokens": 12}, {"depth": 3, "draft": "both", "max_tokens": 20},
            {"depth": 2, "temperature": 0.9, "seed": 3, "max_tokens": 60}]
    alone = _alone(runner, prompts, each)
    for a, b in zip(alone, runner.generate_batch(prompts, each=each, max_batch=3), strict=True):
        _same(a, b)
    assert parted == [1], "the longest request finished alone, on the solo path"


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "mimo"])
def test_speculative_rounds_run_pipelined_and_decode_as_alone(
        runners: Callable[[str], Runner], monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """Rows drafting the same depth from the head verify in pipelined rounds (Batch.spec_rounds:
    the next round's head fed the last one's pairs on the device, its pass queued before the
    verdicts are read): each row's tokens and acceptance counts equal its lone decoding, rows
    leave at their max_tokens mid-stretch and a waiting one joins."""
    runner = runners(family)
    rounds = _pipelined_seen(monkeypatch, "spec_rounds")
    prompts = [PROMPTS[0], PROMPTS[3], [9, 8, 7, 6, 5, 4, 3], PROMPTS[1]]
    each = [{"depth": 2, "draft": "head", "max_tokens": n} for n in (60, 30, 60, 40)]
    alone = _alone(runner, prompts, each)
    order, batched = _streamed(runner, prompts, each, max_batch=3)
    for a, b in zip(alone, batched, strict=True):
        _same(a, b)
    assert order.index(3) > order.index(1), "the fourth request joined after a row left"
    assert len(rounds) >= 10 and max(rounds) == 3, "most rounds ran pipelined, three rows"


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_pipelined_rounds_keep_each_rows_own_count(
        runners: Callable[[str], Runner], built: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """Forced rejections at each row's own positions in pipelined rounds: rows keep 0..K
    drafts each in the same pass, the next round's head takes each row's own count of pairs
    (a device array), and every row decodes its plain greedy tokens."""
    base = runners(family) if family != "llama" else _bare(mtpkit.load(built("llama"),
                                                                        dtype="float32"))
    prompts = [PROMPTS[0], PROMPTS[3], [9, 8, 7, 6, 5, 4, 3]]
    oracle, plain = _oracle_batch(base, prompts, [4, 5, 6], 90)
    rounds = _pipelined_seen(monkeypatch, "spec_rounds")
    results = oracle.generate_batch(prompts, each=[{"depth": 3, "max_tokens": 90}] * 3)
    for result, tokens in zip(results, plain, strict=True):
        assert result.tokens == tokens
        kept = {k for _, _, d, k in result.stats.timeline if d == 3}
        assert kept == {0, 1, 2, 3}, kept
    assert len(rounds) >= 20


@pytest.mark.parametrize("traced", [False, True])
def test_seeded_rows_sample_the_same_text_in_pipelined_rounds(
        monkeypatch: pytest.MonkeyPatch, traced: bool) -> None:
    """Seeded sampled rows (and a greedy mate) at one fixed depth: pipelined rounds draw what
    each row's lone decoding draws (traced batch passes too)."""
    import mtpkit.decoder.rounds.batch as batch

    if traced:
        monkeypatch.setattr(batch, "bounded_by_default", lambda: True)
    runner = tiny_runner(vocab=6)
    if traced:
        runner.trunk.use_traced()
    rounds = _pipelined_seen(monkeypatch, "spec_rounds")
    prompts = [[1, 2, 3, 4, 5], [0, 1], [2, 2, 2, 2]]
    each = [{"depth": 2, "temperature": 0.9, "seed": 3, "max_tokens": 40},
            {"depth": 2, "max_tokens": 30},
            {"depth": 2, "temperature": 1.0, "top_p": 0.9, "seed": 9, "max_tokens": 35}]
    alone = _alone(runner, prompts, each)
    for a, b in zip(alone, runner.generate_batch(prompts, each=each, max_batch=3),
                    strict=True):
        _same(a, b)
    assert len(rounds) >= 8


def test_auto_rounds_run_pipelined_once_the_policy_chooses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under auto, rounds at the depth the policy chooses run pipelined; tokens still equal
    plain decoding."""
    from mtpkit.decoder.tuning.policy import CostTable

    base = tiny_runner(vocab=6)
    prompts = [[1, 2, 3, 4], [5, 4, 3], [2, 2, 1]]
    oracle, plain = _oracle_batch(base, prompts, [7, 8, 9], 120)
    rounds = _pipelined_seen(monkeypatch, "spec_rounds")
    monkeypatch.setattr(CostTable, "pricer", _what_if(lambda width: 0.01 * (0.9 + 0.1 * width)))
    results = oracle.generate_batch(prompts, each=[{"depth": "auto", "draft": "head",
                                                    "max_tokens": 120}] * 3)
    assert [r.tokens for r in results] == plain
    assert len(rounds) >= 10 and max(rounds) == 3


def test_auto_rows_done_mid_stretch_stay_until_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, auto rows' pipelined rounds run past the first row's max_tokens: a row done
    mid-stretch stays in the batch, taking nothing, and leaves when the stretch ends (a new
    pass shape and a pipeline restart, not one per row); each row's surplus past its
    max_tokens is dropped, and every row's tokens are its plain greedy ones. The stretch
    goes on through the policy's choices while it picks the same depth: one stretch."""
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.tuning.policy import CostTable

    base = tiny_runner(vocab=6)
    prompts = [[1, 2, 3, 4], [5, 4, 3], [2, 2, 1]]
    lengths = [90, 100, 120]
    oracle, plain = _oracle_batch(base, prompts, [7, 8, 9], 120)
    _pipelined_seen(monkeypatch, "spec_rounds")
    monkeypatch.setattr(CostTable, "pricer", _what_if(lambda width: 0.01 if width <= 5 else 1.0))
    # depth 4 pays, every time it chooses
    dead: list[int] = []  # per pipelined round: rows already done when it was read
    left: list[int] = []  # rows that left, per Batch.leave
    starts: list[int] = []  # the depth of each pipelined stretch
    spec, leave = Batch.spec_rounds, Batch.leave

    def rounds(self: Batch, depth: int, count: int, stop: Any = None, done: Any = None) -> Any:
        starts.append(depth)
        for out in spec(self, depth, count, stop, done):
            dead.append(sum(done(b) for b in range(len(out))))
            yield out

    def leaving(self: Batch, gone: set[int]) -> None:
        left.append(len(gone))
        leave(self, gone)

    monkeypatch.setattr(Batch, "spec_rounds", rounds)
    monkeypatch.setattr(Batch, "leave", leaving)
    results = oracle.generate_batch(prompts, each=[{"depth": "auto", "draft": "head",
                                                    "max_tokens": n} for n in lengths])
    assert [r.tokens for r in results] == [t[:n] for t, n in zip(plain, lengths, strict=True)]
    assert sum(1 for d in dead if d) >= 4, dead  # (ending the stretch at a row done: <= 2)
    assert left == [3], left  # (all together, when the last was done)
    assert len(starts) == 1 and len(dead) > 16, (starts, len(dead))


def _stretches(monkeypatch: pytest.MonkeyPatch, turn: int, tokens: int
               ) -> tuple[Runner, list[list[int]]]:
    """Three auto rows of an oracle batch decoded with pipelined rounds, under what-if prices
    by pass width that make depth 1 pay, then depth 2 from round `turn` on: the runner, and
    each pipelined stretch's depth and rounds. Tokens are checked to be the plain greedy ones."""
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.tuning.policy import CostTable

    prompts = [[1, 2, 3, 4], [5, 4, 3], [2, 2, 1]]
    oracle, plain = _oracle_batch(tiny_runner(vocab=6), prompts, [7, 8, 9], tokens)
    _pipelined_seen(monkeypatch, "spec_rounds")
    late = [False]
    monkeypatch.setattr(CostTable, "pricer", _what_if(
        lambda width: 0.01 if width <= (3 if late[0] else 2) else 1.0))
    stretches: list[list[int]] = []  # per pipelined stretch: its depth, then its rounds
    spec = Batch.spec_rounds

    def rounds(self: Batch, depth: int, count: int, stop: Any = None, done: Any = None) -> Any:
        stretches.append([depth, 0])
        for out in spec(self, depth, count, stop, done):
            stretches[-1][1] += 1
            late[0] = late[0] or sum(n for _, n in stretches) == turn
            yield out

    monkeypatch.setattr(Batch, "spec_rounds", rounds)
    results = oracle.generate_batch(prompts, each=[{"depth": "auto", "draft": "head",
                                                    "max_tokens": tokens}] * 3)
    assert [r.tokens for r in results] == plain
    return oracle, stretches


def test_a_depth_chosen_at_a_stretchs_check_runs_next_pipelined(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a pipelined stretch's shape has been timed SPEC_ROUNDS times, the policy chooses
    again every SPEC_ROUNDS rounds: where the costs it prices by change (what-if prices that
    make depth 2 pay from round 40 on, past the ~23 rounds the shape takes to be timed), the
    stretch ends at the next check, not at once, and the new depth runs next, pipelined."""
    from mtpkit.decoder.rounds.scheduler import SPEC_ROUNDS

    _, stretches = _stretches(monkeypatch, 40, 400)
    (first, n), (second, _), *_ = stretches
    assert first == 1 and 42 <= n <= 41 + SPEC_ROUNDS, stretches  # (ended at a check)
    assert second == 2, stretches


def test_an_untried_shapes_stretch_asks_the_policy_early_not_after_every_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While a pipelined stretch's pass shape has been timed fewer than SPEC_ROUNDS times, the
    policy is asked after round SPEC_ROUNDS / 4 (then 8, 16): where its price turns (here
    from round 3 on) the stretch ends at that check rather than at the SPEC_ROUNDS one, and
    the new depth runs next. Not after every round: the rounds after a restart read slow,
    and a policy asked after each took every try for dear (on an H200, auto ran stretches of
    three rounds through depths 4-8 at 1K). A stretch's first round is not timed."""
    from mtpkit.decoder.rounds.scheduler import SPEC_ROUNDS

    oracle, stretches = _stretches(monkeypatch, 3, 200)
    (first, n), (second, _), *_ = stretches
    assert first == 1 and n == SPEC_ROUNDS // 4 + 1, stretches  # (the round queued ran too)
    assert second == 2, stretches
    assert len(oracle.table().times[(3, 2, True)]) == n - 1, stretches


def _paid_by_stretch(monkeypatch: pytest.MonkeyPatch, begin: Callable[[], None] | None = None,
                     after: Callable[[], None] | None = None) -> list[list[float]]:
    """What each round of each pipelined stretch paid (Batch.spec_rounds, from now on):
    `begin()` runs as a stretch starts, `after()` once each round is consumed."""
    from mtpkit.decoder.rounds.batch import Batch

    stretches: list[list[float]] = []
    spec = Batch.spec_rounds

    def rounds(self: Batch, depth: int, count: int, stop: Any = None, done: Any = None) -> Any:
        stretches.append([])
        if begin is not None:
            begin()
        for out in spec(self, depth, count, stop, done):
            stretches[-1].append(out[0].paid_s)
            yield out
            if after is not None:
                after()

    monkeypatch.setattr(Batch, "spec_rounds", rounds)
    return stretches


def test_a_pipelined_round_pays_the_consumers_time_it_ran_beside(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipelined round is queued before the last one is read, so it runs while the consumer
    (the scheduler, a server) works: it paid the time from read to read, the consumer's
    included, as a pipelined plain step does (`pipelined`), averaged over the stretch so far."""
    import time

    from mtpkit.decoder.rounds.batch import Batch

    base = tiny_runner(vocab=6)
    prompts = [[1, 2, 3, 4], [5, 4, 3]]
    oracle, plain = _oracle_batch(base, prompts, [7, 8], 60)
    _pipelined_seen(monkeypatch, "spec_rounds")
    pause = [0.05]  # the consumer's work after each round
    stretches = _paid_by_stretch(monkeypatch, after=lambda: time.sleep(pause[0]))
    results = oracle.generate_batch(prompts, each=[{"depth": 2, "max_tokens": 60}] * 2)
    assert [r.tokens for r in results] == plain
    # (a stretch's first round ran after nothing; each later one beside the consumer's 0.05 s)
    assert sum(len(paid) for paid in stretches) >= 10, stretches
    assert all(paid[-1] * len(paid) >= 0.05 * (len(paid) - 1) for paid in stretches), stretches

    # a read that waits for the next round too (here: every other read stalls) leaves that
    # round free to read: each round is priced at its stretch's mean, not at nothing
    reads = [0]
    read = Batch._read

    def stalling(self: Batch, *args: Any) -> Any:
        reads[0] += 1
        time.sleep(0.04 if reads[0] % 2 else 0.0)
        return read(self, *args)

    monkeypatch.setattr(Batch, "_read", stalling)
    pause[0] = 0.0
    stretches.clear()
    assert [r.tokens for r in oracle.generate_batch(
        prompts, each=[{"depth": 2, "max_tokens": 60}] * 2)] == plain
    # (after k >= 2 reads at least k // 2 stalled: a mean of at least 0.04 / 3)
    assert all(p >= 0.012 for paid in stretches for p in paid[1:]), stretches


def test_a_pipelined_round_is_not_priced_at_its_shapes_compile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pass of each shape may compile as it is queued (a trace, kernels, a cuDNN
    graph: host time, once per shape); here every new shape's pass stalls 0.2 s as it is
    built. A round is priced at what rounds of its shape pay, that left out: priced at the
    stretch's mean with it, a stretch of a few rounds after a compile took a shape for several
    times its cost and auto kept away from it."""
    import time

    from mtpkit.decoder.cache.caches import extent
    from mtpkit.decoder.rounds.batch import Batch

    prompts = [[1, 2, 3, 4], [5, 4, 3]]
    oracle, plain = _oracle_batch(tiny_runner(vocab=6), prompts, [7, 8], 400)
    _pipelined_seen(monkeypatch, "spec_rounds")
    built: set[tuple[int, ...]] = set()
    real_pass = Batch._pass

    def compiling(self: Batch, tokens: Any, real: Any, width: int) -> Any:
        shape = (len(self.rows), width, extent(self.cache or []))
        if shape not in built:
            built.add(shape)
            time.sleep(0.2)
        return real_pass(self, tokens, real, width)

    monkeypatch.setattr(Batch, "_pass", compiling)
    stretches = _paid_by_stretch(monkeypatch)
    results = oracle.generate_batch(prompts, each=[{"depth": 2, "max_tokens": 400}] * 2)
    assert [r.tokens for r in results] == plain
    paid = [p for stretch in stretches for p in stretch[1:]]  # (a first round is not timed)
    assert len(built) >= 2 and len(paid) >= 10, (built, stretches)
    assert max(paid) < 0.05, stretches


def test_a_pipelined_stretch_of_rounds_is_priced_without_its_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stretch of pipelined rounds starts with a round built while the device idles (its
    drafts, its pass: 0.2 s here, every stretch, no compile); the rounds after it are priced
    at what rounds of the stretch paid from when that one was queued: counted in their
    stretch's mean, a stretch of a few rounds priced its depth at several times its cost."""
    import time

    from mtpkit.decoder.rounds.batch import Batch

    prompts = [[1, 2, 3, 4], [5, 4, 3]]
    oracle, plain = _oracle_batch(tiny_runner(vocab=6), prompts, [7, 8], 120)
    _pipelined_seen(monkeypatch, "spec_rounds")
    real_pass = Batch._pass
    first = [False]

    def restarting(self: Batch, *args: Any) -> Any:
        if first[0]:
            first[0] = False
            time.sleep(0.2)
        return real_pass(self, *args)

    monkeypatch.setattr(Batch, "_pass", restarting)
    stretches = _paid_by_stretch(monkeypatch, begin=lambda: first.__setitem__(0, True))
    results = oracle.generate_batch(prompts, each=[{"depth": 2, "max_tokens": 120}] * 2)
    assert [r.tokens for r in results] == plain
    paid = [p for stretch in stretches for p in stretch[1:]]  # (a first round is not timed)
    assert len(paid) >= 10 and max(paid) < 0.05, stretches
    # under auto, each stretch's restart goes into the cost table the policy weighs it by
    # (a stretch whose first pass was the first of its shape may have compiled: not kept)
    oracle.table().curve.estimate = True
    stretches.clear()
    oracle.generate_batch(prompts, each=[{"depth": "auto", "draft": "head",
                                          "max_tokens": 120}] * 2)
    kept = [r for r in oracle.table().restarts[2] if r >= 0.2]
    assert 1 <= len(kept) <= len(stretches), (oracle.table().restarts, stretches)


def test_a_plain_stretchs_first_step_is_not_priced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain stretch's first read may also wait for work queued before the stretch (a long
    prompt's last prefill piece, the last round): auto learns nothing from it. Here each
    stretch's first step reads 10 s; priced, it made every plain step of the batch look dear."""
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.tuning.curve import CostCurve

    prompts = [[1, 2, 3, 4], [5, 4, 3]]
    oracle, plain = _oracle_batch(tiny_runner(vocab=6), prompts, [7, 8], 24)
    oracle._costs = CostCurve([1.0] * 16, 0.01, 0.0, estimate=True)  # rounds never pay
    steps, stretches = Batch.plain_steps, [0]

    def waiting(self: Batch, count: int, stop: Any = None) -> Any:
        stretches[0] += 1
        for n, (tokens, paid) in enumerate(steps(self, count, stop)):
            yield tokens, 10.0 if n == 0 else paid

    monkeypatch.setattr(Batch, "plain_steps", waiting)
    results = oracle.generate_batch(prompts, 24, max_batch=2, depth="auto")
    assert [r.tokens for r in results] == plain
    times = oracle.table().times[(2, 1, True)]
    assert stretches[0] >= 1 and times and max(times) < 1.0, (stretches, times)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_lone_rows_plain_steps_see_exact_keys_after_pipelined_rounds(
        monkeypatch: pytest.MonkeyPatch, runners: Callable[[str], Runner],
        built: Callable[..., Path], family: str) -> None:
    """A batch of one whose pipelined rounds left rejected positions as holes squeezes them out
    before its plain steps (Batch._squeeze), which then attend over the row's keys with no
    mask (exact_views), as a lone session's do; every token stays the plain greedy one. Auto
    under what-if prices: depth 2 pays for the first eight rounds, then plain steps do."""
    from mtpkit.decoder.cache.batch_cache import RowKVCache
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.tuning.policy import CostTable

    base = runners(family) if family != "llama" else _bare(mtpkit.load(built("llama"),
                                                                        dtype="float32"))
    oracle, plain = _oracle_batch(base, [PROMPTS[0]], [1], 60)
    rounds = _pipelined_seen(monkeypatch, "spec_rounds")
    monkeypatch.setattr(CostTable, "pricer", _what_if(
        lambda width: 0.01 if (width == 3) == (len(rounds) < 8) and width in (1, 3) else 1.0))
    holes: list[tuple[bool, bool]] = []  # per squeeze: whether the row had holes, and after
    masks: list[bool] = []
    squeeze, make_mask = Batch._squeeze, RowKVCache.make_mask

    def counted(self: Batch) -> None:
        assert self.holes.valid is not None
        before = not self.holes.valid.all().item()
        squeeze(self)
        assert self.holes.valid is not None
        holes.append((before, not self.holes.valid.all().item()))

    def seen(self: RowKVCache, n: int, *args: Any, **kwargs: Any) -> Any:
        mask = make_mask(self, n, *args, **kwargs)
        masks.append(n == 1 and mask is None)
        return mask

    monkeypatch.setattr(Batch, "_squeeze", counted)
    monkeypatch.setattr(RowKVCache, "make_mask", seen)
    scheduler = oracle.scheduler(1, solo=False)
    request = oracle.prepare(PROMPTS[0], 60, depth="auto", draft="head")
    scheduler.add(request)
    tokens = [t for event in scheduler.run() for t in event.tokens]
    assert tokens == plain[0]
    assert len(rounds) >= 8 and any(masks), (rounds, masks)
    assert any(had for had, _ in holes) and not any(left for _, left in holes), holes


def _what_if(price: Callable[[int], float]) -> Callable[..., Callable[[float], float]]:
    """CostTable.pricer replaced by what-if prices by pass width (drafts free, no optimism)."""
    def pricer(self: Any, shape: Any, context: int, optimism: bool) -> Callable[[float], float]:
        return lambda drafting: price(shape[1])
    return pricer


@pytest.mark.parametrize(("ahead", "draft", "want"), [
    (True, "head", {True}), (False, "head", {False}), (True, "both", {False})])
def test_the_policy_is_told_whether_a_depth_would_run_pipelined(
        monkeypatch: pytest.MonkeyPatch, ahead: bool, draft: str, want: set) -> None:
    """Head rows on a GPU: a chosen depth runs pipelined; on a CPU, or with rows that may
    draft from their context, it does not (and is priced synchronously)."""
    import mtpkit.decoder.rounds.scheduler as scheduler

    base = tiny_runner(vocab=6)
    prompts = [[1, 2, 3, 4], [5, 4, 3]]
    oracle, _ = _oracle_batch(base, prompts, [7, 8], 24)
    _pipelined_seen(monkeypatch, "spec_rounds", ahead)
    told: set[bool] = set()
    real = scheduler.decide

    def spy(*args: Any, **kwargs: Any) -> Any:
        told.add(args[4])
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler, "decide", spy)
    oracle.generate_batch(prompts, each=[{"depth": "auto", "draft": draft, "max_tokens": 24}] * 2)
    assert told == want


@pytest.mark.parametrize("family", ["mimo", "qwen3_5"])
def test_a_request_arriving_mid_round_is_prefilled_between_the_rounds_stages(
        runners: Callable[[str], Runner], family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where rounds are synchronous (a CPU), a server's arrivals are taken between the stages
    of a round's pass: the first to arrive is prefilled there and its first token sent at once
    (`early`), while the round is still in flight; one fill a step, so a second arrival waits
    for the next step's. Every row, the late ones included, decodes exactly as alone."""
    import mtpkit.decoder.rounds.scheduler as scheduler_module
    import mtpkit.decoder.rounds.session as session_module
    from mtpkit.decoder.cache.batch_cache import RowKVCache
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.rounds.scheduler import Event, Scheduler

    runner = runners(family)
    prompts = [PROMPTS[0], PROMPTS[3], REPEAT * 3, PROMPTS[4], [9, 8, 7, 6]]
    each = [{"depth": 2, "max_tokens": 30}, {"depth": 3, "max_tokens": 30},
            {"depth": 3, "draft": "lookup", "max_tokens": 30}, {"depth": 2, "max_tokens": 12},
            {"depth": 0, "max_tokens": 8}]
    alone = _alone(runner, prompts, each)
    monkeypatch.setattr(runner.trunk, "passes", None)  # stock passes with synchronous rounds,
    batch = Batch(runner.trunk, runner.head)  # as on a CPU (a GPU pipelines and traces them)
    monkeypatch.setattr(session_module, "bounded_by_default", lambda: False)  # each prompt
    monkeypatch.setattr(scheduler_module, "prefill_pays", lambda: False)  # one chunk, alone
    batch.pipelined = False
    scheduler = Scheduler(batch, 5, solo=False)
    requests = [runner.prepare(p, **e) for p, e in zip(prompts, each, strict=True)]
    for request in requests[:3]:
        scheduler.add(request)
    while len(scheduler.active) < 3:
        scheduler.step()
    late = requests[3:]
    arrived: list[bool] = []  # whether the round's pass was in flight at each call
    early: list[Event] = []

    def arrivals() -> None:
        arrived.append(any(isinstance(c, RowKVCache) and c.fed is not None
                           for c in batch.cache or []))
        if len(arrived) == 1:
            for request in late:
                scheduler.add(request)
    scheduler.take_arrivals(arrivals, early.extend)
    events = scheduler.step()
    assert arrived and all(arrived), "asked only while a round's pass was in flight"
    assert [e.request for e in early] == [late[0]] and len(early[0].tokens) == 1
    assert sorted(id(e.request) for e in events) == sorted(map(id, requests[:3])), \
        "the round went on and finished"
    assert late[1].first_at is None and list(scheduler.waiting) == [late[1]]
    events = scheduler.step()  # late[0] joins; late[1]'s prefill opens this step, as before
    assert any(r is late[0] for r in scheduler.active) and len(early) == 1
    assert [e.request for e in events] == [late[1]] and len(events[0].tokens) == 1
    while scheduler:
        scheduler.step()
    assert [r.tokens for r in requests] == [a.tokens for a in alone]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_lone_request_at_a_fixed_depth_runs_as_a_batch_of_one_where_rounds_pipeline(
        runners: Callable[[str], Runner], built: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """Where rounds pipeline (a GPU), Runner.stream decodes a lone request drafting from the
    head, at a fixed depth or under auto, as a batch of one (Batch.spec_rounds): forced
    rejections at every draft position, and its tokens are its plain greedy ones. With
    context drafts and on a trunk with recurrent layers (a batch replays every verified
    position) it stays on its own session."""
    base = runners(family) if family != "llama" else _bare(mtpkit.load(built("llama"),
                                                                        dtype="float32"))
    prompt = PROMPTS[3]
    from mtpkit.decoder.tuning.curve import CostCurve

    oracle, plain = _oracle_batch(base, [prompt], [4], 90)
    oracle._costs = CostCurve([0.01] * 16, 0.01, 0.0)  # by hand: auto drafts throughout
    rounds = _pipelined_seen(monkeypatch, "spec_rounds")
    pipelined, kept = [], set()
    for ask in ({"depth": 3}, {"depth": "auto", "draft": "head"}, {"depth": 3, "draft": "both"}):
        before = len(rounds)
        got = oracle.generate(prompt, 90, **ask)
        assert got.tokens == plain[0], ask
        assert not rounds[before:] or max(rounds[before:]) == 1
        pipelined.append(len(rounds) - before)
        if ask == {"depth": 3}:
            kept = {k for _, _, d, k in got.stats.timeline if d == 3}
    assert kept == {0, 1, 2, 3}, kept
    if family == "llama":
        assert pipelined[0] >= 10 and pipelined[1] >= 10 and pipelined[2] == 0, pipelined
    else:
        assert pipelined == [0, 0, 0], "a recurrent trunk decodes solo"


def test_a_lone_rows_caches_change_hands_one_layer_at_a_time() -> None:
    """A session's caches become a batch's row without a copy (its buffers), and a batch of
    one's rows become a session's (Batch.part, Batch._squeeze) one layer's copy at a time:
    at a 64K context every layer's keys at once is gigabytes beside the row's own."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mtpkit.decoder.cache.batch_cache import Holes, RowKVCache, batched, single

    layers, shape = 8, (1, 4, 4096, 64)  # 4 MiB of keys and 4 of values a layer
    layer = 2 * 4 * 4096 * 64 * 4
    caches = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        caches.append(c)
    mx.eval([c.state for c in caches])
    keys = [c.keys for c in caches]
    holes = Holes()
    holes.join(1, 4096, 0, 4096)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    rows = batched(caches, holes)
    del caches
    mx.eval([r.state for r in rows])
    assert all(r.keys is k for r, k in zip(rows, keys, strict=True)), "the session's buffers"
    assert mx.get_peak_memory() - before < layer / 4
    assert all(isinstance(r, RowKVCache) and r._idx == 4096 for r in rows)
    del keys
    holes.valid = mx.arange(4096)[None] % 2 == 0  # rejected positions left holes: a copy
    mx.eval(holes.valid)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    back = single(rows, [holes], [KVCache() for _ in range(layers)])
    assert all(r is None for r in rows), "the batch's layers were handed over"
    del rows
    mx.eval([c.state for c in back])
    assert mx.get_peak_memory() - before < 2 * layer, "one layer's copy at a time"
    assert mx.get_active_memory() - before < -layers * layer / 3  # half the positions kept
    assert all(c.offset == 2048 and c.keys.shape[2] == 2048 for c in back)
