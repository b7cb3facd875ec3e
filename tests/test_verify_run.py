"""verify-run against servers that lie in known ways: each verdict right, with a clear
message and no traceback."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from fixtures.fake_servers import running
from mtpkit.cli import main
from mtpkit.schemas import validate
from mtpkit.verify.loads import real_loads

QUICK = ["--loads", "code", "--runs", "1", "--max-tokens", "40", "--json"]


def _verify(url: str, *extra: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["verify-run", "--endpoint", url, *QUICK, *extra])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    doc = json.loads(result.stdout)
    validate(doc, "verify_run")
    return result.exit_code, doc


def _status(doc: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in doc["checks"]}


def _check(doc: dict, name: str) -> dict:
    return next(c for c in doc["checks"] if c["name"] == name)


def test_honest_server_passes_and_is_counted_from_usage() -> None:
    with running("honest") as url:
        code, doc = _verify(url)
    assert code == 0, doc["checks"]
    status = _status(doc)
    assert status["answer"] == status["streaming"] == status["counting"] == "pass"
    assert status["speedup"] == "info" and "no MTP switch" in _check(doc, "speedup")["summary"]
    counting = _check(doc, "counting")["evidence"]
    assert counting["tokens"] == counting["chunks"] == 40
    row = doc["speed"]["loads"]["code"]["as served"]
    assert row["decode_tps"]["p50"] > 0 and row["tokens"] == [40]


def test_multi_token_chunks_pass_and_tok_s_counts_tokens() -> None:
    with running("multi_token") as url:
        code, doc = _verify(url)
    assert code == 0, doc["checks"]
    counting = _check(doc, "counting")["evidence"]
    assert counting["tokens"] == 40 and counting["chunks"] == 14
    assert counting["tokens_per_chunk"] == pytest.approx(40 / 14)
    with running("honest") as url:
        _, honest = _verify(url)
    ratio = (doc["speed"]["loads"]["code"]["as served"]["decode_tps"]["p50"]
             / honest["speed"]["loads"]["code"]["as served"]["decode_tps"]["p50"])
    assert ratio > 1.5, "three tokens per chunk must count as three tokens, not one"


@pytest.mark.parametrize(("mode", "check", "words"), [
    ("drop_short", "streaming", "chars lost"),  # short content chunks dropped when streaming
    ("reasoning_only", "answer", "only to the reasoning channel"),
    ("no_usage", "counting", "cannot be counted"),
])
def test_each_lie_fails_its_check(mode: str, check: str, words: str) -> None:
    with running(mode) as url:
        code, doc = _verify(url)
    assert code == 1
    verdict = _check(doc, check)
    assert verdict["status"] == "fail" and words in verdict["summary"], verdict
    failed = {c["name"] for c in doc["checks"] if c["status"] == "fail"}
    assert failed <= {check, "answer_thinking"}, failed
    if mode == "drop_short":
        assert verdict["evidence"]["stream_chars"] < verdict["evidence"]["whole_chars"]


@pytest.mark.parametrize(("mode", "words"), [("stall", "stalled"), ("malformed", "malformed SSE")])
def test_broken_streams_fail_with_one_clear_message(mode: str, words: str) -> None:
    with running(mode, stall_s=3.0) as url:
        code, doc = _verify(url, "--timeout", "1")
    assert code == 1
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert failed and words in failed[-1]["summary"] and "\n" not in failed[-1]["summary"]


def test_unreachable_endpoint_is_a_one_line_error() -> None:
    result = CliRunner().invoke(main, ["verify-run", "--endpoint", "http://127.0.0.1:9/v1"])
    assert result.exit_code == 2 and "error [endpoint.unreachable]" in result.output
    assert "Traceback" not in result.output


def test_floors_without_evidence_fail() -> None:
    with running("honest") as url:
        code, doc = _verify(url, "--min-speedup", "1.2", "--min-accept", "0.4")
    assert code == 1
    assert _status(doc)["speedup"] == "fail" and _status(doc)["acceptance"] == "fail"


def test_load_nonces_are_fresh_or_drawn_from_a_seed() -> None:
    """Fresh nonces differ call to call; seeded ones repeat per seed (a paired bench)."""
    zen = real_loads(["translation"])["translation"]
    assert zen.fresh() != zen.fresh() and zen.fresh().endswith("\n" + zen.text)
    first, second = random.Random(7), random.Random(7)
    drawn = [zen.fresh(first) for _ in range(3)]
    assert drawn == [zen.fresh(second) for _ in range(3)] and len(set(drawn)) == 3
    assert drawn[0] != zen.fresh(random.Random(8))
