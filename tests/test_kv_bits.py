"""--kv-bits, --kv-group-size, --quantized-kv-start: mlx-lm's quantized KV cache in every entry.

The trunk's caches become mlx-lm's QuantizedKVCache once they hold `start` positions, and no
pass crosses that point (a prefill chunk is split there, a verify pass's drafts are cut short),
so a position is attended to float keys exactly when it lies before `start`: MTP rounds, forced
rejections and prefix-cache restores give plain decoding's greedy tokens with the same cache.
Plain decoding switches where mlx-lm's `generate_step` does (checked against it). Bad values
are one line with `options.invalid` on the CLI, in serve and in the Python API.

Power, checked by breaking the code once each: without the quantize after a round, MTP keeps a
float cache past the switch and the greedy and forced-rejection tests fail; without the draft
cut, the pass-structure, sampled and 4-bit forced-rejection tests fail; without the prompt
split, the pass-structure and prefix tests; without `thawable` (quantized keys restored below
the switch), the prefix test; without the scheduler's solo at max_batch 1, the batch test.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache
from test_exactness import assert_every_outcome

import mtpkit
from fixtures.decoder_models import OracleHead, tiny_runner
from fixtures.fake_servers import in_thread
from fixtures.numerics import break_products_over  # (and float32 runs in float32 on GPUs)
from mtpkit.cli import main
from mtpkit.decoder.cache import caches
from mtpkit.decoder.cache.caches import attends_quantized, unquantizable
from mtpkit.decoder.cache.prefix import PrefixCache
from mtpkit.decoder.model.trunk import Trunk
from mtpkit.decoder.options import KVQuant, OptionError
from mtpkit.decoder.rounds.session import Session
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.tuning.curve import CostCurve
from mtpkit.serve.server import Server
from mtpkit.serve.service import Service


def _attention_runs() -> bool:
    cache = KVCache()
    cache.update_and_fetch(*(mx.zeros((1, 2, 3, 64)),) * 2)
    return attends_quantized(cache, KVQuant(4, 64, 0)) is None


# MLX 0.32's CUDA quantized matmul takes only contiguous keys, so attention over mlx-lm's
# quantized cache fails there in mlx-lm's generate_step as in ours: on such a device load
# refuses kv_bits (test_a_device_without_quantized_attention_is_refused) and nothing decodes
DECODES = pytest.mark.skipif(not _attention_runs(), reason="MLX on this device cannot attend "
                             "over a quantized KV cache (load refuses kv_bits here)")
V = 32
START = 24  # --quantized-kv-start in these tests
SHORT = [1, 5, 7, 3, 9, 2, 11, 4]  # shorter than START: the switch falls in the decode
LONG = [(7 * i + 3) % V for i in range(40)]  # longer: the switch falls inside the prompt
# (kv_bits, kv_group_size, quantized_kv_start) the Python API and the CLI (as typed) must
# refuse, and the option the message names
BAD = [((7, 32, 0), "kv_bits"), (("4", 32, 0), "kv_bits"), ((True, 32, 0), "kv_bits"),
       ((4, 48, 0), "kv_group_size"), ((4, 32, -1), "quantized_kv_start"),
       ((4, 32, 1.5), "quantized_kv_start")]
TYPED = [(("7", "32", "0"), "kv_bits"), (("four", "32", "0"), "kv_bits"),
         (("4", "48", "0"), "kv_group_size"), (("4", "32", "-1"), "quantized_kv_start"),
         (("4", "32", "1.5"), "quantized_kv_start")]


@pytest.fixture(scope="module")
def tiny() -> Iterator[Runner]:
    """A float32 llama trunk whose heads are 64 wide (group sizes 32 and 64 fit), and a head."""
    runner = tiny_runner(vocab=V, hidden=128, seed=1)
    yield runner
    runner.quantize_kv(None)


def _made(monkeypatch: pytest.MonkeyPatch, trunk: Trunk) -> list[list[Any]]:
    """Every cache list the trunk makes from now on (sessions switch them in place)."""
    made: list[list[Any]] = []
    make = trunk.make_cache

    def spy(bounded: bool = False) -> list[Any]:
        made.append(make(bounded))
        return made[-1]

    monkeypatch.setattr(trunk, "make_cache", spy)
    return made


def _passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int, int]]:
    """(quantized, offset before, real rows) of every trunk pass from now on."""
    seen: list[tuple[bool, int, int]] = []
    call = Trunk.__call__

    def spy(self: Trunk, tokens: mx.array, cache: list[Any], *args: Any, **kw: Any) -> Any:
        attention = [c for c in cache if isinstance(c, KVCache | QuantizedKVCache)]
        if attention:
            real = kw.get("real") or tokens.shape[1]
            seen.append((isinstance(attention[0], QuantizedKVCache), attention[0].offset, real))
        return call(self, tokens, cache, *args, **kw)

    monkeypatch.setattr(Trunk, "__call__", spy)
    return seen


def _rounds(runner: Runner, prompt: list[int], n: int, depth: int,
            monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokens and each verified round's (drafts verified, kept), as the rounds returned them
    (a round cut short before the switch verifies fewer than it was given)."""
    outcomes: list[tuple[int, int]] = []
    verify = Session.round

    def spy(self: Session, *args: Any, **kw: Any) -> Any:
        out = verify(self, *args, **kw)
        if out.depth:
            outcomes.append((out.depth, out.kept))
        return out

    with monkeypatch.context() as patch:
        patch.setattr(Session, "round", spy)
        result = runner.generate(prompt, n, depth=depth)
    stats = result.stats
    assert stats.verify_calls == len(outcomes)
    assert stats.accepted == [sum(k > i for _, k in outcomes) for i in range(depth)]
    return result.tokens, outcomes


def _oracle(runner: Runner, prompt: list[int], reference: list[int]) -> Runner:
    """The trunk (and its quantized cache) with a drafter wrong at a random 30% of positions:
    rounds end in a rejection at every draft position, and in bonuses."""
    seq = prompt + reference
    wrong = np.random.default_rng(0).random(len(seq)) < 0.3
    script = {i: (t + 1) % V if wrong[i] else t for i, t in enumerate(seq)}
    return Runner(runner.trunk, OracleHead(V, script, len(prompt)), None,  # type: ignore[arg-type]
                  rollback=runner.rollback)


# -- exactness -------------------------------------------------------------------------------

@DECODES
@pytest.mark.parametrize("bits", [8, 4])
def test_mtp_greedy_equals_plain_with_the_same_quantized_cache(
        tiny: Runner, bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny.quantize_kv(None)
    floats = {tuple(p): tiny.generate(p, 48, depth=0).tokens for p in (SHORT, LONG)}
    tiny.quantize_kv(bits, 64, START)
    # --depth auto by a curve given by hand (cheap verify passes: deep rounds), not measured
    tiny._costs = CostCurve([0.01 * (1 + 0.05 * t) for t in range(16)], 0.01, 0.002)
    made = _made(monkeypatch, tiny.trunk)
    differs = False
    for prompt in (SHORT, LONG):
        plain = tiny.generate(prompt, 48, depth=0).tokens
        differs |= plain != floats[tuple(prompt)]
        for depth in (1, 3, "auto"):
            result = tiny.generate(prompt, 48, depth=depth)
            assert result.tokens == plain, (bits, prompt, depth)
            assert result.stats.verify_calls > 0, "rounds were verified"
    assert made and all(type(c) is QuantizedKVCache and c.bits == bits and c.offset > START
                        for cache in made for c in cache), "every session switched"
    assert differs or bits == 8, "4 bits changes the greedy text: the cache is quantized"


@DECODES
def test_plain_switches_where_mlx_lm_generate_step_does(tiny: Runner) -> None:
    """A prompt shorter than the switch: stock mlx-lm's decode steps switch at the same
    position (inside a prompt mlx-lm switches at the end of its prefill chunk; mtpkit at the
    position, so chunking never changes a token)."""
    tiny.quantize_kv(4, 64, START)
    want = [int(t) for t, _ in generate_step(mx.array(SHORT), tiny.trunk.model, max_tokens=48,
                                             kv_bits=4, kv_group_size=64,
                                             quantized_kv_start=START)]
    assert tiny.generate(SHORT, 48, depth=0).tokens == want


@DECODES
def test_no_pass_crosses_the_switch(tiny: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pass attends either wholly before the switch in float or wholly after it,
    quantized: the prompt is split there, a round's drafts are cut short before it."""
    tiny.quantize_kv(4, 64, START)
    for prompt in (SHORT, LONG):
        reference = tiny.generate(prompt, 48, depth=0).tokens
        oracle = _oracle(tiny, prompt, reference)
        seen = _passes(monkeypatch)
        assert oracle.generate(prompt, 48, depth=4).tokens == reference
        assert seen and all(quantized == (offset >= START) and (quantized or offset + real <= START)
                            for quantized, offset, real in seen), seen
        monkeypatch.undo()
    assert (False, 0, START) in seen, "the long prompt was split at the switch"


@DECODES
@pytest.mark.parametrize("bits", [8, 4])
def test_forced_rejections_with_a_quantized_cache(tiny: Runner, bits: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tiny.quantize_kv(bits, 64, START)
    for prompt in (SHORT, LONG):
        reference = tiny.generate(prompt, 64, depth=0).tokens
        oracle = _oracle(tiny, prompt, reference)
        for depth in (2, 3, 4):
            tokens, outcomes = _rounds(oracle, prompt, 64, depth, monkeypatch)
            assert tokens == reference, (bits, prompt, depth)
            assert_every_outcome(outcomes, (depth,))


@DECODES
@pytest.mark.parametrize("rollback", ["record", "replay"])
def test_forced_rejections_on_a_hybrid_trunk(built: Callable[..., Path], rollback: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """GatedDeltaNet layers roll back beside quantized attention caches."""
    runner = mtpkit.load(built("qwen3_5"), dtype="float32", rollback=rollback, kv_bits=4,
                         kv_group_size=32, quantized_kv_start=10)
    runner = Runner(runner.trunk, runner.head, None, rollback=rollback)
    prompt = [9, 8, 7, 6, 5, 4]
    reference = runner.generate(prompt, 48, depth=0).tokens
    seq = prompt + reference
    vocab = runner.trunk.args.vocab_size
    wrong = np.random.default_rng(0).random(len(seq)) < 0.3
    oracle = Runner(runner.trunk, OracleHead(vocab, {i: (t + 1) % vocab if wrong[i] else t
                                                     for i, t in enumerate(seq)}, len(prompt)),
                    None, rollback=rollback)  # type: ignore[arg-type]
    for depth in (2, 3):
        tokens, outcomes = _rounds(oracle, prompt, 48, depth, monkeypatch)
        assert tokens == reference, (rollback, depth)
        assert_every_outcome(outcomes, (depth,))


@DECODES
def test_sampled_rounds_cut_before_the_switch(tiny: Runner,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled round cut short keeps its q rows and uniforms in step (seeded: reproducible)."""
    tiny.quantize_kv(4, 64, START)
    seen = _passes(monkeypatch)
    runs = [tiny.generate(SHORT, 40, depth=3, temperature=1.0, seed=5).tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 40
    assert all(q == (o >= START) and (q or o + r <= START) for q, o, r in seen)


# -- the prefix cache ------------------------------------------------------------------------

@DECODES
def test_prefix_cache_reuse_gives_the_same_tokens(tiny: Runner) -> None:
    """Exports of quantized caches restore at any prefix past the switch; one cut back below it
    is not restored (a cold run attends to those positions' float keys)."""
    tiny.quantize_kv(4, 64, START)
    turn1 = LONG[:30]
    turn2 = turn1 + [3, 1, 4, 1, 5]
    above = turn1[:28] + [2, 7, 2]  # leaves turn 1 past the switch
    below = turn1[:12] + [2, 7, 2]  # leaves it before the switch
    for mode in ({"depth": 0}, {"depth": 3}):
        cold = {tuple(p): tiny.generate(p, 40, **mode).tokens for p in (turn1, turn2, above, below)}
        cache = PrefixCache(1 << 30)
        for prompt, cached in ((turn1, 0), (turn2, len(turn1)), (above, 28), (below, 0)):
            warm = tiny.generate(prompt, 40, prefix=cache, **mode)
            assert warm.tokens == cold[tuple(prompt)], (mode, prompt)
            assert warm.cached_tokens == cached, (mode, prompt)



@DECODES
def test_prefix_entries_made_without_kv_bits_restore_only_before_the_switch(
        tiny: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    """One prefix cache shared by a float run and a quantized one (the Python API allows it):
    float keys restore up to the switch (then turn quantized), never past it."""
    before, past = LONG[:START], LONG[:30]
    tiny.quantize_kv(4, 64, START)
    cold = {tuple(p): tiny.generate(p + [2, 7], 32, depth=3).tokens for p in (before, past)}
    for prompt, cached in ((before, START), (past, 0)):
        cache = PrefixCache(1 << 30)
        tiny.quantize_kv(None)
        tiny.generate(prompt, 4, depth=3, prefix=cache)
        tiny.quantize_kv(4, 64, START)
        with monkeypatch.context() as patch:
            seen = _passes(patch)
            warm = tiny.generate(prompt + [2, 7], 32, depth=3, prefix=cache)
        assert (warm.tokens, warm.cached_tokens) == (cold[tuple(prompt)], cached), prompt
        assert all(q == (o >= START) for q, o, _ in seen), "restored keys switch at once"


# -- batches ---------------------------------------------------------------------------------

@DECODES
def test_batches_decode_one_at_a_time_or_are_refused(tiny: Runner) -> None:
    """mlx-lm has no batched quantized cache: max_batch above 1 is refused; at 1 the scheduler
    decodes each prompt as alone."""
    tiny.quantize_kv(4, 64, START)
    alone = [tiny.generate(p, 32, depth=3).tokens for p in (SHORT, LONG)]
    together = tiny.generate_batch([SHORT, LONG], 32, max_batch=1, depth=3)
    assert [r.tokens for r in together] == alone
    with pytest.raises(OptionError) as err:
        tiny.generate_batch([SHORT, LONG], 32, max_batch=2, depth=3)
    assert (err.value.code, err.value.option) == ("options.invalid", "max_batch")
    with pytest.raises(OptionError):
        Service(tiny, "m", 3, 64, max_batch=2)
    with pytest.raises(OptionError):
        tiny.batch_costs(2)


# -- refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize(("values", "option"), BAD)
def test_the_python_api_refuses_bad_values(built: Callable[..., Path], tiny: Runner,
                                           values: tuple, option: str) -> None:
    bits, group, start = values
    with pytest.raises(OptionError) as err:  # before any weights load
        mtpkit.load(built("mimo"), kv_bits=bits, kv_group_size=group, quantized_kv_start=start)
    assert (err.value.code, err.value.option) == ("options.invalid", option)
    with pytest.raises(OptionError):
        tiny.quantize_kv(bits, group, start)


def test_caches_mlx_lm_cannot_quantize_are_refused(built: Callable[..., Path]) -> None:
    kv = KVQuant(4, 32, 0)
    assert unquantizable([RotatingKVCache(8)], kv)[0] == "kv_bits"
    assert unquantizable([ArraysCache(2)], kv)[0] == "kv_bits"
    with pytest.raises(OptionError) as err:  # heads 32 wide: group 64 does not divide them
        mtpkit.load(built("mimo"), kv_bits=4, kv_group_size=64)
    assert err.value.option == "kv_group_size" and "32" in err.value.hint
    with pytest.raises(OptionError):  # MLA's rope keys are 16 wide
        mtpkit.load(built("deepseek_v3"), kv_bits=4, kv_group_size=32)
    with pytest.raises(OptionError) as err:
        mtpkit.load(built("mimo"), kv_bits=4, kv_group_size=32, shard="tensor")
    assert err.value.option == "kv_bits"


def test_a_device_without_quantized_attention_is_refused(built: Callable[..., Path], tiny: Runner,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where MLX has no kernel for attention over a quantized cache (CUDA, MLX 0.32), load,
    quantize_kv and the CLI refuse kv_bits with one line instead of a RuntimeError mid-decode."""
    def no_kernel(*args: Any, **kwargs: Any) -> mx.array:
        raise RuntimeError("[quantized_matmul] No implementation for problem shape: 1x25x64x2")

    monkeypatch.setattr(caches, "quantized_scaled_dot_product_attention", no_kernel)
    with pytest.raises(OptionError) as err:
        mtpkit.load(built("mimo"), kv_bits=4, kv_group_size=32)
    assert (err.value.code, err.value.option) == ("options.invalid", "kv_bits")
    assert "No implementation" in str(err.value)
    with pytest.raises(OptionError):
        tiny.quantize_kv(8, 32, 0)
    _refused(CliRunner().invoke(main, ["generate", str(built("mimo")), "hi", "--raw", "-m", "4",
                                       "--kv-bits", "4", "--kv-group-size", "32"]),
             "--kv-bits")


def test_a_device_whose_quantized_attention_is_wrong_is_refused(
        tiny: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where MLX's quantized matmul returns garbage for several query rows of the heads' width
    (as its CUDA op does for 64-wide rows), kv_bits is refused: one-row steps would stay right
    and every verify pass and prefill chunk would not."""
    runs = _attention_runs()
    probe = tiny.trunk.make_cache()
    tiny.trunk(mx.array([[0]]), probe, logits_for=0)
    width = next(c.keys.shape[-1] for c in probe if hasattr(c, "to_quantized"))
    tiny.quantize_kv(8, 32, 0)  # right here: accepted
    break_products_over(monkeypatch, width)
    with pytest.raises(OptionError) as err:
        tiny.quantize_kv(8, 32, 0)
    assert (err.value.code, err.value.option) == ("options.invalid", "kv_bits")
    if runs:  # (where MLX cannot attend over a quantized cache at all, that is said first)
        assert f"wrong results for 4 query rows of {width}-wide heads" in str(err.value)
    tiny.quantize_kv(None)


def _refused(result: Any, flag: str) -> None:
    """One error line with the code and the flag as typed, one hint line, exit 2."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert lines[-2].startswith(f"error [options.invalid]: {flag}"), result.output
    assert lines[-1].startswith("  hint: ") and "Traceback" not in result.output


@pytest.mark.parametrize(("values", "option"), TYPED)
def test_every_command_refuses_bad_values(built: Callable[..., Path], values: tuple,
                                          option: str) -> None:
    bits, group, start = values
    flags = ["--kv-bits", bits, "--kv-group-size", group, "--quantized-kv-start", start]
    bundle = str(built("mimo"))
    for command in (["generate", bundle, "hi", "--raw", "--depth", "2"],
                    ["serve", bundle, "--port", "0", "--depth", "2"],
                    ["verify-run", bundle, "--depth", "2"], ["tune", bundle]):
        _refused(CliRunner().invoke(main, command + flags), "--" + option.replace("_", "-"))


def test_cli_refuses_a_batch_and_an_endpoint_with_kv_bits(built: Callable[..., Path]) -> None:
    bundle = str(built("mimo"))
    kv = ["--kv-bits", "4", "--kv-group-size", "32"]
    _refused(CliRunner().invoke(main, ["serve", bundle, "--port", "0", "--depth", "2",
                                       "--max-batch", "2", *kv]), "--max-batch")
    _refused(CliRunner().invoke(main, ["verify-run", "--endpoint", "http://127.0.0.1:9", *kv]),
             "--kv-bits")
    _refused(CliRunner().invoke(main, ["tune", bundle, "--max-batch", "2", *kv]), "--max-batch")
    _refused(CliRunner().invoke(main, ["generate", bundle, "hi", "--kv-bits", "4"]),
             "--kv-group-size")


# -- entries that run --------------------------------------------------------------------------

@DECODES
def test_generate_runs_a_quantized_cache(built: Callable[..., Path]) -> None:
    bundle = str(built("mimo"))
    common = ["generate", bundle, "hi", "--raw", "-m", "24", "--dtype", "float32", "--json"]
    kv = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "3"]
    docs = [json.loads(CliRunner().invoke(main, common + ["--depth", d] + kv).stdout)
            for d in ("0", "3")]
    float_doc = json.loads(CliRunner().invoke(main, common + ["--depth", "0"]).stdout)
    assert docs[0]["tokens"] == docs[1]["tokens"] and len(docs[0]["tokens"]) == 24
    assert float_doc["tokens"] != docs[0]["tokens"], "4 bits changes the greedy text"


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as response:
        return response.status, json.loads(response.read())


@DECODES
def test_serve_answers_both_apis_over_a_quantized_cache(built: Callable[..., Path]) -> None:
    """The cache is the server's option: both APIs decode over it, MTP equal to plain."""
    runner = mtpkit.load(built("mimo"), dtype="float32", kv_bits=8, kv_group_size=32,
                         quantized_kv_start=4)
    body = {"prompt": [5, 17, 42, 99, 7, 3], "max_tokens": 16}
    with in_thread(Server(Service(runner, "m", 2, 64, cache_bytes=1 << 26), "127.0.0.1", 0,
                          None)) as url:
        status, plain = _post(url, "/completions", body | {"mtp_depth": 0})
        assert status == 200
        for _ in range(2):  # the second from the prefix cache
            status, doc = _post(url, "/completions", body)
            assert status == 200 and doc["choices"][0]["text"] == plain["choices"][0]["text"]
        status, doc = _post(url, "/messages", {"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "hello"}]})
        assert status == 200 and doc["usage"]["output_tokens"] > 0
