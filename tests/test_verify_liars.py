"""verify-run --endpoint against endpoints that lie in the ways a hostile or broken server can:
streams that never end are stopped at a bound (tokens, bytes, wall seconds) and named; usage
inflated past what was streamed fails counting; a wrong-typed field is a failed check with a
schema-valid report, never a traceback. And the TTFT figures compare like with like."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from fixtures.fake_servers import COLD_S, WRONG_TYPES, running
from mtpkit.cli import main
from mtpkit.schemas import validate
from mtpkit.verify import endpoint as endpoint_mod
from mtpkit.verify.answer import Answer, Chunk
from mtpkit.verify.checks import counting_check
from mtpkit.verify.run import Clock, Facts, Rates, span

QUICK = ["--loads", "code", "--runs", "1", "--max-tokens", "40", "--json"]


class Overran(Exception):
    """The command ran past the time a bounded read needs (not an OSError: no handler in the
    code under test may swallow it)."""


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging when a read is not bounded."""
    def overran(*_: object) -> None:
        raise Overran(f"still running after {seconds} s")

    before = signal.signal(signal.SIGALRM, overran)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def _verify(url: str, *extra: str, seconds: int = 30) -> tuple[int, dict, str]:
    """The real command in process: exit code, its --json document (schema-checked), stderr."""
    with deadline(seconds):
        result = CliRunner().invoke(main, ["verify-run", "--endpoint", url, *QUICK, *extra])
    assert not isinstance(result.exception, Overran), "an unbounded read: the run never ended"
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    doc = json.loads(result.stdout)
    validate(doc, "verify_run")
    return result.exit_code, doc, result.stderr


def _check(doc: dict, name: str) -> dict:
    return next(c for c in doc["checks"] if c["name"] == name)


def _failed(doc: dict) -> set[str]:
    return {c["name"] for c in doc["checks"] if c["status"] == "fail"}


def test_endless_valid_chunks_stop_at_the_token_bound() -> None:
    """Valid text chunks forever: stopped at max_tokens + 1 chunks, the bound named."""
    start = time.perf_counter()
    with running("endless") as url:
        code, doc, _ = _verify(url)
    assert code == 1 and time.perf_counter() - start < 20
    endpoint = _check(doc, "endpoint")
    assert endpoint["status"] == "fail", doc["checks"]
    assert "went past its tokens bound (40 text chunks for max_tokens 40) at 41 text chunks" \
        in endpoint["summary"], endpoint
    assert endpoint["evidence"]["bound"] == "tokens" and endpoint["evidence"]["text_chunks"] == 41


def test_endless_empty_chunks_stop_at_the_byte_bound() -> None:
    with running("endless_empty") as url:
        code, doc, _ = _verify(url)
    assert code == 1
    evidence = _check(doc, "endpoint")["evidence"]
    bound = endpoint_mod.BASE_BYTES + 40 * endpoint_mod.BYTES_PER_TOKEN
    assert evidence["bound"] == "bytes" and evidence["max_bytes"] == bound
    assert bound < evidence["bytes"] <= bound + 1024, "read past the bound, by at most a line"
    assert "went past its bytes bound" in _check(doc, "endpoint")["summary"]


def test_an_endless_whole_body_stops_at_the_byte_bound() -> None:
    with running("endless_body") as url:
        code, doc, _ = _verify(url)
    assert code == 1
    endpoint = _check(doc, "endpoint")
    assert endpoint["evidence"]["bound"] == "bytes", endpoint


def test_a_line_dribbled_forever_stops_at_the_wall_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte every 20 ms inside one SSE line never trips the stall timeout nor the byte bound:
    the wall bound (--timeout plus SECONDS_PER_TOKEN a token asked) cuts it."""
    monkeypatch.setattr(endpoint_mod, "SECONDS_PER_TOKEN", 0.02)
    start = time.perf_counter()
    with running("dribble") as url:
        code, doc, _ = _verify(url, "--timeout", "1")
    assert code == 1 and time.perf_counter() - start < 15
    endpoint = _check(doc, "endpoint")
    assert endpoint["evidence"]["bound"] == "seconds", endpoint
    assert "went past its seconds bound (1.8 s for max_tokens 40)" in endpoint["summary"]
    assert 1.8 <= endpoint["evidence"]["seconds"] < 4


def test_request_timeout_flag_bounds_a_dribbled_line() -> None:
    """The wall bound given on the command line (--request-timeout), not derived."""
    start = time.perf_counter()
    with running("dribble") as url:
        code, doc, _ = _verify(url, "--timeout", "1", "--request-timeout", "1.5")
    assert code == 1 and time.perf_counter() - start < 15
    endpoint = _check(doc, "endpoint")
    assert endpoint["evidence"]["bound"] == "seconds", endpoint
    assert 1.5 <= endpoint["evidence"]["seconds"] < 3.5


def test_inflated_usage_fails_counting() -> None:
    """completion_tokens at 1000x the tokens streamed (above max_tokens) passed every check."""
    with running("inflated") as url:
        code, doc, _ = _verify(url)
    assert code == 1
    counting = _check(doc, "counting")
    assert counting["status"] == "fail"
    assert "usage reports 40000 tokens, above the max_tokens 40 asked" in counting["summary"]
    assert _failed(doc) == {"counting"}, doc["checks"]
    row = doc["speed"]["loads"]["code"]["as served"]
    assert row["tokens"] == [None] and row["decode_tps"] is None, "no tok/s from a lie"


@pytest.mark.parametrize(("mode", "field"), [
    ("str_tokens", "completion: usage.completion_tokens: a string (\"40\"), not integer"),
    ("str_mtp", "completion: usage.mtp: a string (\"fast\"), not object or null"),
    ("str_delta", "stream chunk: choices[0].delta: a string (\"A \"), not object or null"),
    ("choices_object", "completion: choices: an object, not array"),
    ("numeric_content", "completion: choices[0].message.content: an integer (5), not string or null"),
])
def test_a_wrong_typed_field_is_a_failed_check_not_a_traceback(mode: str, field: str) -> None:
    with running(mode) as url:
        code, doc, _ = _verify(url)
    assert code == 1
    endpoint = _check(doc, "endpoint")
    assert endpoint["status"] == "fail" and endpoint["summary"].startswith("malformed ")
    assert field in endpoint["summary"], (WRONG_TYPES[mode], endpoint["summary"])


def test_a_liar_through_a_real_process_writes_json_and_no_traceback() -> None:
    """The console entry point as a terminal runs it: exit 1, valid JSON, no traceback."""
    with running("str_delta") as url:
        proc = subprocess.run([sys.executable, "-m", "mtpkit.cli", "verify-run", "--endpoint",
                               url, *QUICK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)
    validate(doc, "verify_run")
    assert "endpoint" in _failed(doc)


def test_ttft_compares_cold_with_cold(tmp_path: Path) -> None:
    """A caching endpoint answered the MTP run (the plain run's prompt again) from its prefix
    cache, and the chart compared that warm TTFT with a cold plain one. Each mode's TTFT now
    comes from prompts behind nonces of their own, and the document and the page say so."""
    page = tmp_path / "r.html"
    with running("caching") as url:
        code, doc, err = _verify(url, "--depth", "2", "--report", str(page))
    assert code == 0, doc["checks"]
    row = doc["speed"]["loads"]["code"]
    plain, mtp = row["plain"]["ttft_s"]["p50"], row["mtp"]["ttft_s"]["p50"]
    assert plain >= COLD_S and mtp >= COLD_S, (plain, mtp)
    assert row["plain"]["ttft_cached"] == row["mtp"]["ttft_cached"] == 0
    assert doc["speed"]["ttft"]["state"] == "cold"
    assert _check(doc, "exactness")["status"] == "pass"  # still on the same prompt
    assert "serving checks" in next(s for s in err.splitlines() if "plan:" in s)
    html = page.read_text()
    assert "Time to first token (cold, every mode)" in html
    assert "TTFT (cold: each mode&#39;s TTFT from prompts behind nonces of their own" in html


def test_eta_is_a_range_that_learns() -> None:
    """The plan's figure is a range, and so is each step's: wide before any answer, from
    the seconds per token the answers took after."""
    assert span(130, 220) == "2 min 10 s to 3 min 40 s" and span(40.2, 40.4) == "about 40 s"

    class Target:
        def ask(self, *_: object, max_tokens: int, **__: object) -> Answer:
            time.sleep(0.01 * max_tokens)
            return Answer("x " * max_tokens, "", max_tokens, 5, "length")

    costs = {"verify": [0.01] * 16, "plain": 0.001}
    facts = Facts("endpoint", "t")
    clock = Clock(Target(), facts, [(facts.tokens("x"), 20)] * 5, Rates.of(costs), lambda: False)
    before = clock.left_s()
    assert before is not None and before[1] > before[0]
    for _ in range(3):
        clock.ask([{"role": "user", "content": "x"}], max_tokens=20, stream=True)
    low, high = clock.left_s() or (0, 0)
    # two requests of 0.2 s each are left: the range holds them, and is no point figure
    assert low < 0.4 < high and high < 3 * 0.4, (low, high)
    assert clock.note("step").endswith(" left)") and " to " in clock.note("step")


def test_usage_above_the_text_streamed_fails_counting() -> None:
    """Inflated under max_tokens: more tokens than bytes of text can carry."""
    streamed = Answer("ab", "", 300, 5, "length", [Chunk(0.1, "ab")])
    whole = Answer("ab", "", 300, 5, "length")
    check = counting_check(whole, streamed, "usage", 512)
    assert check.status == "fail" and "300 tokens for 2 bytes of text" in check.summary


def test_whatever_the_endpoint_sends_stays_on_one_line() -> None:
    """A key or an error message with a newline would break the report's one-line summary."""
    doc = {"choices": [{"message": {"content": "x"}}], "usage": {"mtp": {"depths": {"a\nb": "x"}}}}
    with pytest.raises(endpoint_mod.EndpointError) as caught:
        endpoint_mod.checked(doc, "completion", "completion")
    assert str(caught.value) == 'malformed completion: usage.mtp.depths["a\\nb"]: a string ("x"), ' \
        "not integer"
    assert endpoint_mod._message('{"error": {"message": "bad\\nthing"}}') == "bad thing"
