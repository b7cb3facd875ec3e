"""mtpkit graft: a head trained on a frozen trunk, written as a normal bundle."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.models import llama, qwen3_next
from mlx_lm.tokenizer_utils import load as load_tokenizer

import mtpkit
from fixtures.factory import tree_hash
from mtpkit.cli import main
from mtpkit.convert.convert import ConvertError
from mtpkit.convert.writer import OutputExists
from mtpkit.decoder.runner import safe_template
from mtpkit.decoder.tuning.costs import DecodeCosts
from mtpkit.loaders.digest import sha256_file
from mtpkit.schemas import validate
from mtpkit.train import graft as graft_mod
from mtpkit.train.copying import attention_of, copy_loss, copy_sources
from mtpkit.train.corpus import (
    Document,
    prose,
    read_documents,
    split_documents,
    stdlib_root,
)
from mtpkit.train.graft import WARMUP_STEPS, GraftOptions, graft, learning_rate
from mtpkit.train.rollouts import INSTRUCTIONS, Prompts, chat_frame, rollout, training_mask
from mtpkit.train.scoring import SCORING_SHARE, plan, verdict
from mtpkit.verify.loads import MEMO_REQUEST, real_loads

CORPUS = stdlib_root() / "json"


def _options(**kw: object) -> GraftOptions:
    base = {"corpus": [CORPUS], "steps": 12, "batch": 4, "seq_len": 32, "eval_prompts": 3,
            "eval_tokens": 12}
    return GraftOptions(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def grafted(built: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("graft") / "llama-mtp"
    source = built("llama")
    before = tree_hash(source)
    losses: list[float] = []
    phases: list[str] = []

    def report(p) -> None:
        phases.append(p.phase)
        if p.phase == "head":
            losses.append(p.loss)

    result = graft(str(source), out, _options(), progress=report)
    assert list(dict.fromkeys(phases)) == ["trunk", "head", "score"]
    return source, before, result, losses


def test_graft_writes_a_healthy_bundle_with_provenance(grafted) -> None:
    source, before, result, losses = grafted
    assert tree_hash(source) == before, "the source bundle was modified"
    view = mtpkit.open_bundle(result.out)
    assert view.errors == [] and view.mtp.location == "sidecar" and view.mtp.blocks == 1
    manifest = json.loads((result.out / "mtpkit.json").read_text())
    validate(manifest, "manifest")
    record = manifest["graft"]
    assert record["steps"] == 12 and len(losses) == 12
    # 12 steps x 4 windows over 4 passes: the trunk ran once over 12 distinct windows
    assert record["distinct_tokens"] == 12 * 32 and record["tokens"] == 12 * 4 * 32
    assert sum(record["rollouts"][k] for k in ("raw", "chat")) == 12
    assert 0 < record["rollouts"]["trained_positions"] <= 12 * 32
    assert record["corpus"] == [str(CORPUS)] and record["documents"]["held_out"] >= 1
    held = record["held_out_acceptance"]  # pooled over verify rounds: a count of accepted drafts
    accepted = held["depth1"] * held["rounds"]
    assert held["rounds"] >= held["prompts"] and accepted == pytest.approx(round(accepted))
    assert held["prompts"] == 3 and held["tokens_per_prompt"] == 12
    assert record["copy_weight"] == 1.0  # llama attention: copying supervised
    # the decode costs measured here and the speedup they make of the acceptance, always
    costs, speed = record["decode_costs"], record["expected_speedup"]
    assert costs["step_ms"] > 0 and costs["round_ms"] > 0 and costs["prefill_ms_per_token"] > 0
    assert speed["round_steps"] == pytest.approx(costs["round_ms"] / costs["step_ms"])
    assert speed["depth1"] == pytest.approx((1 + speed["acceptance"]) / speed["round_steps"])
    assert speed["pays"] == ("why" not in speed) and record["blas"]["kind"] in (
        "optimized", "reference", None)
    budget = record["budget"]
    assert budget["minutes"] is None and budget["reserved_training_s"] is None  # --steps alone
    assert budget["planned_prompts"]["raw"] == record["held_out_acceptance"]["prompts"]
    assert min(losses[-3:]) < losses[0], "training did not reduce the loss"
    for name in view.weights.trunk_files:  # the trunk is the source's, byte for byte
        assert sha256_file(result.out / name) == sha256_file(source / name)


def test_grafted_head_decodes_exactly(grafted) -> None:
    _, _, result, _ = grafted
    runner = mtpkit.load(result.out, dtype="float32")
    plain = runner.generate("import json", 24, depth=0)
    spec = runner.generate("import json", 24, depth=3)
    assert spec.tokens == plain.tokens and spec.stats.verify_calls > 0


def test_graft_is_deterministic(built: Callable[..., Path], tmp_path: Path, grafted) -> None:
    _, _, first, _ = grafted
    again = graft(str(built("llama")), tmp_path / "again", _options())
    assert sha256_file(again.out / "mtp.safetensors") == sha256_file(first.out / "mtp.safetensors")


def test_graft_refuses_bad_input(built: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(ConvertError) as hf:
        graft(str(built("llama", hf=True)), tmp_path / "a", _options())
    assert hf.value.code == "load.not_converted"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "one.txt").write_text("only one document")
    with pytest.raises(ConvertError) as corpus:
        graft(str(built("llama")), tmp_path / "b", _options(corpus=[empty]))
    assert corpus.value.code == "graft.corpus"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_graft_into_an_existing_out_fails_before_training(built: Callable[..., Path],
                                                         tmp_path: Path) -> None:
    """Refused up front, not after the whole budget has been spent."""
    (tmp_path / "out").mkdir()
    phases: list[str] = []
    with pytest.raises(OutputExists):
        graft(str(built("llama")), tmp_path / "out", _options(),
              progress=lambda p: phases.append(p.phase))
    assert phases == [] and list((tmp_path / "out").iterdir()) == []


def test_corpus_holds_out_by_document_and_finds_prose() -> None:
    docs = read_documents([stdlib_root() / "email"])
    held = [d for d in docs if d.held_out]
    assert held and len(held) < len(docs)
    assert Document("x/a.py", "").held_out == Document("x/a.py", "other").held_out
    text = prose(Document("m.py", 'def f():\n    """' + "Words people wrote. " * 20 + '"""\n'))
    assert len(text) == 1 and text[0].startswith("Words")


def test_held_out_loads_come_from_text_graft_never_trains_on() -> None:
    loads = real_loads(["held_code", "held_memo"])
    train, held = split_documents(read_documents())
    code = loads["held_code"].text
    assert len(code) == 1800 and code.startswith(("def ", "class "))
    assert any(code in d.text for d in held) and not any(code in d.text for d in train)
    doc = loads["held_memo"].text.removeprefix(MEMO_REQUEST)
    assert loads["held_memo"].chat and len(doc) > 500
    assert any(doc in p for d in held for p in prose(d))
    assert not any(doc[:300] in d.text for d in train)
    assert set(real_loads()) == {"code", "memo", "translation"}


def test_graft_cli_reports_progress(built: Callable[..., Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["graft", str(built("llama")), "--out",
                                       str(tmp_path / "g"), "--corpus", str(CORPUS),
                                       "--steps", "3", "--batch", "2", "--seq-len", "16"])
    assert result.exit_code == 0, result.output
    assert "graft step 3" in result.stderr and "held-out depth-1 acceptance" in result.stdout


def test_draft_vocabulary_is_written_and_decodes_exactly(built: Callable[..., Path],
                                                         tmp_path: Path) -> None:
    result = graft(str(built("llama")), tmp_path / "dv", _options(draft_vocab=64, steps=4))
    view = mtpkit.open_bundle(result.out)
    assert view.errors == [] and "mtp.draft_vocab" in view.weights.sidecar
    assert result.graft["draft_vocab"] == 64
    runner = mtpkit.load(result.out, dtype="float32")
    assert runner.head is not None and runner.head.draft_vocab.shape == (64,)
    plain = runner.generate("import json", 24, depth=0)
    spec = runner.generate("import json", 24, depth=2)
    assert spec.tokens == plain.tokens


def test_rollouts_are_the_trunks_greedy_continuations(built: Callable[..., Path]) -> None:
    runner = mtpkit.load(built("llama"), dtype="float32")
    prompts = np.random.default_rng(3).integers(10, 200, (2, 6))
    hidden, ids, targets, mask = rollout(runner.trunk, prompts, 26, eos=set())
    assert ids.shape == (2, 26) and hidden.shape[:2] == (2, 25) and mask.shape == (2, 24)
    assert (ids[:, :6] == prompts).all() and mask.all()
    # head position t learns the trunk's greedy token after position t + 1: the generated
    # token past the prompt, the argmax of a full forward inside it
    assert (targets[:, 5:] == ids[:, 7:]).all()
    for row in range(2):
        plain = runner.generate(prompts[row].tolist(), 20, depth=0).tokens
        assert len(plain) >= 4 and ids[row, 6:6 + len(plain)].tolist() == plain
    # the cached hiddens are the ones a full forward over the window gives
    full, logits = runner.trunk(mx.array(ids[:, :-1]), None)
    assert mx.allclose(hidden, full, atol=1e-4).item()
    assert (targets == np.array(mx.argmax(logits, axis=-1))[:, 1:]).all()


def test_training_stops_at_the_generated_end_of_text() -> None:
    ids = np.array([[1, 9, 3, 4, 9, 5, 6, 7],    # end of text generated at 4 (the 9 at 1 is prompt)
                    [1, 2, 3, 4, 5, 6, 7, 8]])   # no end of text: every position trains
    mask = training_mask(ids, prompt_len=3, eos={9})
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]


def test_prompts_alternate_raw_openings_and_chat_requests(built: Callable[..., Path]) -> None:
    source = built("llama")
    view = mtpkit.open_bundle(source)
    tokenizer = load_tokenizer(source)
    frame = chat_frame(safe_template(view), view.tokenizer.special_tokens(), tokenizer)
    assert frame is not None
    encoded = [tokenizer.encode(d.text) for d in read_documents([CORPUS])]
    prompts = Prompts(encoded, 94, frame, tokenizer, seed=0)
    raw, kind = prompts.next(3)
    assert kind == "raw" and raw.shape == (3, 24)
    chat, kind = prompts.next(3)
    before, after = frame
    assert kind == "chat" and chat.shape == (3, 48)
    assert (chat[:, :len(before)] == before).all() and (chat[:, -len(after):] == after).all()
    text = tokenizer.decode(chat[0].tolist())
    assert any(i.strip() in text for i in INSTRUCTIONS)
    # a template with no room for a snippet leaves raw prompts only
    assert not Prompts(encoded, 30, frame, tokenizer, seed=0).chat


def test_learning_rate_warms_up_then_decays_to_a_floor() -> None:
    peak = 1e-3
    warm = [learning_rate(peak, s, 0.0) for s in range(WARMUP_STEPS)]
    assert warm[0] == pytest.approx(0.1 * peak) and warm == sorted(warm) and warm[-1] < peak
    assert learning_rate(peak, WARMUP_STEPS, 0.0) == pytest.approx(peak)
    decay = [learning_rate(peak, WARMUP_STEPS + 1, d) for d in np.linspace(0, 1, 11)]
    assert decay == sorted(decay, reverse=True)
    assert decay[5] == pytest.approx(0.525 * peak) and decay[-1] == pytest.approx(0.05 * peak)
    assert learning_rate(peak, 10_000, 1.7) == pytest.approx(0.05 * peak)  # past the budget


def test_copy_sources_point_at_the_head_position_holding_the_token() -> None:
    # window "5 1 2 3 4 1 2 3 4 9"; the trunk's targets follow the text
    window = np.array([[5, 1, 2, 3, 4, 1, 2, 3, 4, 9]])
    targets = window[:, 2:]
    sources = copy_sources(window, targets)
    # head position 6 drafts token 8 (a 4): "1 2 3" was followed by token 4 before, which head
    # position 3 reads; position 7 drafts 9, but the lookup would copy a 1; nothing repeats
    # before position 5
    assert sources.tolist() == [[-1, -1, -1, -1, -1, -1, 3, -1]]
    assert copy_sources(window, np.full_like(targets, 7)).max() == -1  # a target never seen


class _Layer(nn.Module):
    def __init__(self, attn: nn.Module, hidden: int) -> None:
        super().__init__()
        self.self_attn = attn
        self.input_layernorm = nn.RMSNorm(hidden)


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_copy_loss_of_uniform_attention_is_the_log_prefix_length(kind: str) -> None:
    """Zero queries and keys attend uniformly over the causal prefix: the loss at query t is
    log(t + 1) whatever the source, so the expected value does not reuse the loss's code."""
    if kind == "llama":
        args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1,
                               intermediate_size=64, num_attention_heads=4, rms_norm_eps=1e-5,
                               vocab_size=100, num_key_value_heads=2)
        layer = _Layer(llama.Attention(args), 32)
    else:
        args = qwen3_next.ModelArgs(
            model_type="qwen3_next", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
            num_attention_heads=4, linear_num_value_heads=2, linear_num_key_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_experts=0, num_experts_per_tok=0, decoder_sparse_step=1,
            shared_expert_intermediate_size=0, mlp_only_layers=[], moe_intermediate_size=0,
            rms_norm_eps=1e-5, vocab_size=100, num_key_value_heads=2, rope_theta=10000.0,
            partial_rotary_factor=0.5, max_position_embeddings=64, head_dim=8)
        layer = _Layer(qwen3_next.Qwen3NextAttention(args), 32)
    assert attention_of(layer) is not None
    attn = layer.self_attn
    attn.q_proj.weight = mx.zeros_like(attn.q_proj.weight)
    attn.k_proj.weight = mx.zeros_like(attn.k_proj.weight)
    x = mx.random.normal((2, 6, 32), key=mx.random.key(0))
    sources = mx.array([[-1, 0, 1, -1, 2, 4], [-1, -1, 0, 0, -1, 5]])
    want = np.mean([np.log(t + 1) for row in sources.tolist()
                    for t, s in enumerate(row) if s >= 0])
    assert float(copy_loss(layer, x, sources)) == pytest.approx(want, rel=1e-5)
    assert attention_of(_Layer(nn.Linear(2, 2), 2)) is None  # an unknown class: not supervised


def test_copy_weight_zero_trains_on_cross_entropy_alone(built: Callable[..., Path],
                                                       tmp_path: Path, grafted) -> None:
    _, _, result, losses = grafted
    off: list[float] = []
    plain = graft(str(built("llama")), tmp_path / "off", _options(copy_weight=0.0),
                  progress=lambda p: off.append(p.loss) if p.phase == "head" else None)
    assert plain.graft["copy_weight"] == 0.0
    # the same first batch: with copying on, its loss adds the attention term
    assert losses[0] > off[0] > 0


def _costs(step: float = 0.01, round_: float = 0.03, prefill: float = 0.001) -> DecodeCosts:
    return DecodeCosts(step, round_, prefill)


def test_a_head_that_cannot_pay_is_flagged(built: Callable[..., Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A round priced at 3 plain steps: even every draft accepted gives 2/3 of plain speed."""
    monkeypatch.setattr(graft_mod, "measure_decoding", lambda trunk, head, ids: _costs())
    result = CliRunner().invoke(main, ["graft", str(built("llama")), "--out",
                                       str(tmp_path / "g"), "--corpus", str(CORPUS),
                                       "--steps", "1", "--batch", "2", "--seq-len", "16"])
    assert result.exit_code == 0, result.output
    closing = result.stdout.strip().splitlines()[-1]
    assert closing.startswith("this head will not speed decoding up here: a depth-1 round "
                              "costs 3.00 plain decode steps")
    assert "no acceptance can pay" in closing
    speed = json.loads((tmp_path / "g/mtpkit.json").read_text())["graft"]["expected_speedup"]
    assert speed["pays"] is False and speed["depth1"] <= 2 / 3 and speed["why"] in closing
    assert "then ~" in result.stderr and "scoring" in result.stderr  # said up front


def test_verdict_names_the_acceptance_that_would_pay() -> None:
    paying = verdict(0.44, _costs(round_=0.012), "optimized")
    assert paying["pays"] and paying["depth1"] == pytest.approx(1.44 / 1.2) and "why" not in paying
    low = verdict(0.075, _costs(round_=0.012), "optimized")
    assert not low["pays"] and "at least 26% acceptance" in low["why"]
    assert "train longer" in low["why"]
    dear = verdict(0.075, _costs(round_=0.021), "reference")
    assert "no acceptance can pay" in dear["why"] and "reference BLAS" in dear["why"]


def test_plan_reserves_scoring_and_writing_out_of_the_whole_budget() -> None:
    costs = _costs(step=0.02, round_=0.025, prefill=0.002)
    raw, chat = [150] * 24, [200] * 12
    roomy = plan(27 * 60, 15.0, costs, raw, chat, 48, 32, 300_000_000)
    assert (roomy.raw, roomy.chat) == (24, 12)
    assert roomy.writing_s == pytest.approx(2.0 + 3.0)
    scoring = sum(costs.prompt_s(n, 48) for n in raw + chat) + costs.probe_s(32)
    assert roomy.scoring_s == pytest.approx(scoring)
    assert roomy.setup_s + roomy.training_s + roomy.scoring_s + roomy.writing_s == 27 * 60
    # the reference BLAS on a slow machine: scoring is cut to its share, raw and chat alike
    slow = _costs(step=0.17, round_=0.37, prefill=0.12)
    tight = plan(27 * 60, 30.0, slow, raw, chat, 48, 32, 300_000_000)
    assert tight.scoring_s <= SCORING_SHARE * (27 * 60 - 30.0 - tight.writing_s)
    assert 1 <= tight.raw < 24 and abs(tight.raw - 2 * tight.chat) <= 2
    # with --steps alone nothing is cut; with no room at all one raw prompt still scores
    assert plan(float("inf"), 1.0, slow, raw, chat, 48, 32, 0).raw == 24
    assert (plan(10.0, 9.0, slow, raw, chat, 48, 32, 0).raw,
            plan(10.0, 9.0, slow, raw, chat, 48, 32, 0).chat) == (1, 0)


def test_minutes_bound_the_whole_command(built: Callable[..., Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Scoring priced at ~0.4 s a prompt: a 9-second budget cannot score them all."""
    monkeypatch.setattr(graft_mod, "measure_decoding",
                        lambda trunk, head, ids: _costs(step=0.005, round_=0.008))
    result = graft(str(built("llama")), tmp_path / "m",
                   _options(steps=None, minutes=0.15, eval_prompts=24))
    budget, acc = result.graft["budget"], result.graft["held_out_acceptance"]
    assert budget["minutes"] == 0.15
    parts = ("setup_s", "reserved_training_s", "reserved_scoring_s", "reserved_writing_s")
    assert sum(budget[k] for k in parts) == pytest.approx(9.0)
    planned = budget["planned_prompts"]
    assert 1 <= planned["raw"] < len(graft_mod.held_out_prompts(
        split_documents(read_documents([CORPUS]))[1], 24, 0))
    assert acc["prompts"] <= planned["raw"]
    assert acc.get("chat", {"prompts": 0})["prompts"] <= planned["chat"]


def test_a_bundle_with_a_head_is_not_grafted_over_unasked(built, tmp_path):
    """The head a bundle ships is never replaced without --force (it was, without a word)."""
    source = built("qwen3_5")
    start = time.perf_counter()
    result = CliRunner().invoke(main, ["graft", str(source), "--out", str(tmp_path / "g"),
                                       "--steps", "1"])
    assert result.exit_code == 2, result.output
    assert "error [graft.has_head]" in result.output and "--force" in result.output
    assert not (tmp_path / "g").exists() and time.perf_counter() - start < 30
    forced = CliRunner().invoke(main, ["graft", str(source), "--out", str(tmp_path / "g"),
                                       "--corpus", str(CORPUS), "--steps", "1", "--batch", "2",
                                       "--seq-len", "16", "--force"])
    assert forced.exit_code == 0, forced.output  # asked: the shipped head is replaced
    assert (tmp_path / "g/mtp.safetensors").read_bytes() != (source / "mtp.safetensors").read_bytes()
    assert (source / "mtp.safetensors").is_file(), "the source keeps its own"
