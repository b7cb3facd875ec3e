"""--depth auto as users reach it: generate, serve (and its "mtp_depth" extension) and
verify-run choose each round's depth from the measured cost curve and report the choices and
the speedup the curve predicts; a target that takes only numbers still gets a depth sweep."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import mtpkit
from mtpkit.cli import main
from mtpkit.schemas import validate
from mtpkit.serve.protocol import Request, RequestError, parse
from mtpkit.serve.server import Server
from mtpkit.serve.service import Service, usage
from mtpkit.verify.answer import Answer, Chunk
from mtpkit.verify.endpoint import EndpointError
from mtpkit.verify.run import Facts, VerifyOptions, depths_text, run, table


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "costs"


def _invoke(*args: str) -> Any:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def _rounds(depths: dict[str, int]) -> int:
    return sum(n for d, n in depths.items() if d != "0")


# -- generate --------------------------------------------------------------------------------

def test_generate_auto_reports_the_chosen_depths(built: Callable[..., Path], cache: Path) -> None:
    bundle = str(built("qwen3_5"))
    args = ["generate", bundle, "The quick brown fox", "--raw", "--max-tokens", "48",
            "--dtype", "float32"]
    doc = json.loads(_invoke(*args, "--json").stdout)  # --depth auto is the default
    validate(doc, "generation")
    stats = doc["stats"]
    assert stats["depths"] and all(int(d) >= 0 and n > 0 for d, n in stats["depths"].items())
    assert _rounds(stats["depths"]) == stats["verify_calls"], "every verify round is counted"
    assert stats["depths"].get("0", 0) < stats["generated_tokens"]
    # whether rounds pay on this fixture depends on the machine's costs: predicted exactly
    # when rounds ran (tests/test_policy.py decides on given costs)
    assert (stats["predicted_speedup"] is None) == (stats["verify_calls"] == 0)
    assert stats["predicted_speedup"] is None or stats["predicted_speedup"] > 0

    text = _invoke(*args, "--depth", "auto")
    # streamed pieces vs one decode: a tokenizer may drop the first token's leading space, and
    # bytes that are no UTF-8 (a random model's) may be replaced differently piece by piece
    valid = doc["text"].lstrip().split("\ufffd")[0]
    assert text.exit_code == 0 and text.stdout.lstrip().startswith(valid)
    # the depths of this second run: --depth auto corrects its costs by what rounds really
    # took here, so two runs may choose differently (their tokens are the same)
    listed = r"(?:plain|d\d+) \d+(?: / (?:plain|d\d+) \d+)*"
    assert re.search(rf"depth auto \(depths {listed}\)", text.stderr), text.stderr
    assert re.fullmatch(listed, depths_text(stats["depths"]))  # the same form as the JSON's

    plain = json.loads(_invoke(*args, "--depth", "0", "--json").stdout)
    assert plain["tokens"] == doc["tokens"], "greedy auto decodes exactly like plain"
    assert plain["stats"]["depths"] == {} and plain["stats"]["predicted_speedup"] is None
    forced = _invoke(*args, "--depth", "2")
    assert "depth 2," in forced.stderr and "depth auto" not in forced.stderr


def test_generate_compare_prints_the_predicted_speedup(built: Callable[..., Path],
                                                       cache: Path) -> None:
    result = _invoke("generate", str(built("qwen3_5")), "The quick brown fox", "--raw",
                     "--max-tokens", "32", "--compare")
    assert result.exit_code == 0, result.output
    line = result.stderr.strip().splitlines()[-1]
    found = re.search(r"-> depth auto [\d.]+ tok/s: speedup \d+\.\d\dx( \(predicted \d+\.\d\dx\))?; "
                      r"tokens identical to plain: (yes|NO)\]$", line)
    assert found, line
    # a prediction exactly when rounds ran (where plain steps are cheap, as on a GPU, auto may
    # run plain throughout: then there is nothing to predict)
    depths = re.search(r"depth auto \(depths ([^)]*)\)", result.stderr)
    assert depths, result.stderr
    speculated = re.search(r"\bd\d+ \d+", depths.group(1)) is not None
    assert (found.group(1) is not None) == speculated, result.stderr


@pytest.mark.parametrize("command", ["generate", "serve", "verify-run"])
def test_a_bad_depth_is_a_one_line_usage_error(command: str, tmp_path: Path) -> None:
    target = [str(tmp_path)] + (["Hi"] if command == "generate" else [])
    for bad in ("deep", "17", "-1", "2.5"):
        result = _invoke(command, *target, "--depth", bad)
        assert result.exit_code == 2, (command, bad, result.output)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert errors == ['error [options.invalid]: --depth must be "auto" or an integer in '
                          '[0, 16]'], (command, bad, result.stderr)
        assert "Traceback" not in result.output


def test_head_drafts_without_a_head_are_a_one_line_error(built: Callable[..., Path],
                                                         cache: Path) -> None:
    """A bundle without a head drafts from the context (any depth, auto included); asking for
    head drafts is a usage error."""
    bundle = str(built("qwen3_5", sidecar=None))
    result = _invoke("generate", bundle, "Hi", "--raw", "--depth", "2", "--max-tokens", "4",
                     "--draft", "head")
    assert result.exit_code == 2 and ('error [options.no_head]: --draft "head" drafts with an '
                                      'MTP head') in result.output
    for depth in ("2", "auto"):
        run = _invoke("generate", bundle, "Hi", "--raw", "--max-tokens", "6", "--depth", depth,
                      "--json")
        assert run.exit_code == 0, run.output
        assert set(json.loads(run.stdout)["stats"]["sources"]) <= {"lookup"}


# -- serve -----------------------------------------------------------------------------------

def test_mtp_depth_extension_takes_auto_or_a_number() -> None:
    body = {"prompt": "x"}
    assert parse(body, False, 64).depth is None
    assert parse(body | {"mtp_depth": "auto"}, False, 64).depth == "auto"
    assert parse(body | {"mtp_depth": 0}, False, 64).depth == 0
    assert parse(body | {"mtp_depth": 16}, False, 64).depth == 16
    for bad in ("deep", "AUTO", "3", 17, -1, 1.0, True, [2]):
        with pytest.raises(RequestError) as err:
            parse(body | {"mtp_depth": bad}, False, 64)
        assert (err.value.status, err.value.param) == (400, "mtp_depth"), bad
        assert err.value.message == ('options.invalid: mtp_depth must be "auto" or an integer '
                                     'in [0, 16]')


def test_service_passes_auto_and_reports_the_choices(built: Callable[..., Path],
                                                     cache: Path) -> None:
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    seen: list[Any] = []
    stream = runner.stream

    def spy(ids: list[int], max_tokens: int, **options: Any) -> Any:
        seen.append(options["depth"])
        return stream(ids, max_tokens, **options)

    runner.stream = spy  # type: ignore[method-assign]
    service = Service(runner, "m", "auto", 64)
    tokens = []
    for asked, used in ((None, "auto"), ("auto", "auto"), (0, 0), (2, 2)):
        req = Request(chat=False, prompt="The quick brown fox", max_tokens=40, depth=asked)
        result = list(service.deltas(req))[-1].result
        assert result is not None and seen[-1] == used, (asked, seen)
        mtp = usage(result)["mtp"]
        if used == "auto":
            assert mtp["depths"] and _rounds(mtp["depths"]) == mtp["verify_calls"]
            # a prediction where it speculated; an answer auto decoded plain predicts nothing
            assert (mtp["predicted_speedup"] is None) == (mtp["verify_calls"] == 0)
            assert mtp["drafted_depth"] == len(mtp["acceptance_by_depth"])
        else:
            assert mtp["depths"] == {} and mtp["predicted_speedup"] is None
            assert mtp["depth"] == used
        tokens.append(result.tokens)
    assert all(t == tokens[0] for t in tokens), "every depth answers like plain decoding"


def test_serve_auto_measures_the_curve_at_start_up(built: Callable[..., Path], cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Server] = []
    monkeypatch.setattr(Server, "serve_forever", lambda self, *a, **k: started.append(self))
    result = _invoke("serve", str(built("qwen3_5")), "--port", "0")
    assert result.exit_code == 0, result.output
    assert "depth auto: chosen per round from this machine's costs (measured now" in result.stderr
    assert "verify c(T)" not in result.stderr  # the curve itself only with --verbose
    assert "(MTP depth auto)" in result.stderr
    assert started[0].service.depth == "auto"
    # the curve and what batched rounds cost (default --max-batch 8), both before any request
    assert len(list(cache.glob("*.batch.json"))) == 1 and len(list(cache.glob("*.json"))) == 2
    assert "timing batched rounds for --depth auto" in result.stderr
    assert re.search(r"batches: round prices for [\d, ]+ rows, timed once", result.stderr)
    runner = started[0].service.runner
    assert runner._costs is not None and runner.paid is not None
    assert {2, 4, 8} <= {rows for rows, _, _ in runner.paid.seeded}

    started.clear()  # a second start reads both; one at a time times no batch
    again = _invoke("serve", str(built("qwen3_5")), "--port", "0", "--max-batch", "4")
    assert again.exit_code == 0 and "timing batched rounds" not in again.stderr
    assert re.search(r"batches: round prices for [\d, ]+ rows, timed once", again.stderr)
    alone = _invoke("serve", str(built("qwen3_5")), "--port", "0", "--max-batch", "1")
    assert alone.exit_code == 0 and "batch" not in alone.stderr

    started.clear()
    headless = _invoke("serve", str(built("qwen3_5", sidecar=None)), "--port", "0", "--verbose")
    assert re.search(r"verify c\(T\)/c\(1\) 2:[\d.]+ 4:[\d.]+ 8:[\d.]+ 16:[\d.]+", headless.stderr)
    assert headless.exit_code == 0 and "no MTP head, context lookup drafts" in headless.stderr
    assert "(MTP depth auto), drafts lookup" in headless.stderr  # every model speculates
    assert started[0].service.depth == "auto" and started[0].service.runner._costs is not None

    started.clear()
    fixed = _invoke("serve", str(built("qwen3_5")), "--port", "0", "--depth", "3")
    assert fixed.exit_code == 0 and "depth auto" not in fixed.stderr
    assert "(MTP depth 3)" in fixed.stderr and started[0].service.depth == 3


# -- verify-run ------------------------------------------------------------------------------

AUTO_DEPTHS = {"0": 3, "2": 5}
SPEEDUP = {0: 1.0, 1: 1.2, 2: 1.4, 3: 1.3, 4: 1.1, "auto": 1.5}


class Fake:
    """A target whose decoding speed per depth is known; "auto" is taken (reported with its
    choices), refused with an HTTP 400 (as an older serve does) or ignored."""

    def __init__(self, auto: str) -> None:
        self.auto, self.asked = auto, []

    def ask(self, messages: list[dict] | None = None, prompt: str | None = None, *,
            max_tokens: int, stream: bool, depth: int | str | None = None,
            thinking: bool | None = None) -> Answer:
        self.asked.append(depth)
        if depth == "auto" and self.auto == "refuses":
            raise EndpointError('HTTP 400: mtp_depth must be an integer in [0, 16]', status=400)
        key = 0 if depth is None or (depth == "auto" and self.auto == "ignores") else depth
        step = 0.01 / SPEEDUP[key]
        chunks = [Chunk(step * (i + 1), "word ", "", 1) for i in range(max_tokens)]
        mtp: dict[str, Any] = {"depth": key if isinstance(key, int) else 8,
                               "acceptance_by_depth": [0.6] * (key if isinstance(key, int) else 8)}
        if key == "auto":
            mtp |= {"depths": AUTO_DEPTHS, "predicted_speedup": 1.6}
        return Answer("word " * max_tokens, "", max_tokens, 12, "length",
                      chunks if stream else [], mtp, None, list(range(max_tokens)))


def _report(fake: Fake) -> dict[str, Any]:
    report = run(fake, Facts("endpoint", "fake", exact_ids=True),
                 VerifyOptions(loads=("code",), runs=2, max_tokens=40))
    report.record = {"machine": {"platform": "test", "cores": 1, "versions": {}}}
    doc = report.to_dict()
    validate(doc, "verify_run")
    return doc


def test_verify_run_auto_runs_against_plain_where_the_target_takes_it() -> None:
    fake = Fake("takes")
    doc = _report(fake)
    speed = doc["speed"]
    assert speed["depth"] == "auto" and speed["sweep"] == {} and speed["mtp_control"]
    assert not {1, 2, 3, 4} & set(fake.asked), "no sweep"
    row = speed["loads"]["code"]
    assert row["mtp"]["depths"] == {"0": 6, "2": 10}, "summed over the runs"
    assert row["predicted_speedup"] == row["mtp"]["predicted_speedup"] == 1.6
    assert row["plain"]["depths"] is None and row["speedup"] == pytest.approx(1.5, rel=1e-6)
    check = next(c for c in doc["checks"] if c["name"] == "speedup")
    assert "MTP depth auto 1.50x plain decoding" in check["summary"]
    assert "predicted 1.60x" in check["summary"]
    assert check["evidence"]["predicted_by_load"] == {"code": 1.6}
    assert next(c for c in doc["checks"] if c["name"] == "exactness")["status"] == "pass"
    printed = table(doc)
    assert "speedup 1.50x, predicted 1.60x, depths plain 6 / d2 10" in printed


@pytest.mark.parametrize("auto", ["refuses", "ignores"])
def test_verify_run_auto_sweeps_a_target_that_takes_only_numbers(auto: str) -> None:
    fake = Fake(auto)
    doc = _report(fake)
    speed = doc["speed"]
    assert fake.asked.count("auto") == 1, "one probe"
    assert sorted(map(int, speed["sweep"]["depths"])) == [1, 2, 3, 4]
    assert speed["depth"] == speed["sweep"]["fastest"] == 2
    assert speed["loads"]["code"]["speedup"] == pytest.approx(1.4, rel=1e-6)
    assert speed["loads"]["code"]["predicted_speedup"] is None
    assert "predicted" not in next(c for c in doc["checks"] if c["name"] == "speedup")["summary"]


def test_verify_run_local_bundle_with_depth_auto(built: Callable[..., Path], cache: Path) -> None:
    result = _invoke("verify-run", str(built("qwen3_5")), "--loads", "code", "--runs", "1",
                     "--max-tokens", "32", "--json", "--dtype", "float32")
    doc = json.loads(result.stdout)
    validate(doc, "verify_run")
    speed = doc["speed"]
    assert speed["depth"] == "auto" and speed["sweep"] == {}
    mtp = speed["loads"]["code"]["mtp"]
    assert sum(mtp["depths"].values()) > 0, mtp
    # a prediction exactly when rounds ran (where this machine prices rounds dear against plain
    # steps, auto may run plain throughout: then there is nothing to predict)
    speculated = any(d != "0" for d in mtp["depths"])
    assert (mtp["predicted_speedup"] is not None) == speculated, mtp
    assert next(c for c in doc["checks"] if c["name"] == "exactness")["status"] == "pass"
