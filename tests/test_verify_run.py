"""verify-run against servers that lie in known ways: each verdict right, with a clear
message and no traceback."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fixtures.fake_servers import running
from fixtures.serving import interruptible
from mtpkit.cli import main
from mtpkit.schemas import validate
from mtpkit.verify.loads import real_loads

QUICK = ["--loads", "code", "--runs", "1", "--max-tokens", "40", "--json"]
DURATION = r"\d+ (s|min \d\d s)"
SPAN = rf"(about {DURATION}|{DURATION} to {DURATION})"  # a range, or one figure when both agree


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
    # a stream that lost most of its text no longer carries the tokens its usage reports
    also = {"counting"} if mode == "drop_short" else set()
    assert failed <= {check, "answer_thinking", *also}, failed
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


# A real `mtpkit verify-run` on a fixture bundle, as a terminal runs it (Ctrl-C included).
def _verify_process(bundle: Path, cache: Path, *options: str, stdout: Any = subprocess.PIPE
                    ) -> subprocess.Popen:
    """stdout: a file where stderr is read line by line (a full stdout pipe would block it)."""
    return subprocess.Popen([sys.executable, "-m", "mtpkit.cli", "verify-run", str(bundle),
                             *options], stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MTPKIT_CACHE": str(cache)},
                            preexec_fn=interruptible)


def _ctrl_c_after(proc: subprocess.Popen, said: str) -> str:
    """Send Ctrl-C once stderr has said `said`; everything it wrote to stderr."""
    assert proc.stderr is not None
    seen = []
    while not any(said in s for s in seen):
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "".join(seen)
        seen.append(line)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return "".join(seen) + err


def test_plan_eta_and_cpu_defaults_are_said_before_the_runs(built, tmp_path: Path) -> None:
    """Issue 34: a default run on a CPU said nothing for half an hour. Now the curve comes
    first (no run's TTFT pays for it), then the plan with an estimate (a range), then a line
    per step with the time spent and the range left; on a CPU backend the defaults are fewer,
    shorter runs."""
    from mtpkit.verify.local import cpu_backend

    proc = _verify_process(built("mimo"), tmp_path / "cache", "--loads", "code,memo", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode in (0, 1), err
    doc = json.loads(out)
    validate(doc, "verify_run")
    runs, tokens = (1, 128) if cpu_backend() else (3, 256)
    assert (doc["speed"]["runs"], doc["speed"]["max_tokens"]) == (runs, tokens)
    assert doc["speed"].get("defaults") == ("cpu" if cpu_backend() else None)
    lines = err.splitlines()
    curve = next(i for i, s in enumerate(lines) if s.startswith("measuring this machine's"))
    plan = next(i for i, s in enumerate(lines) if s.startswith("verify-run: plan: "))
    assert curve < plan < next(i for i, s in enumerate(lines) if s.startswith("verify-run: answer"))
    said = lines[plan]
    assert f"2 loads (code, memo) x {runs} run{'s' if runs > 1 else ''} x 2 modes" in said
    assert f"x {tokens} tokens" in said
    assert re.search(rf"; {SPAN} by this machine's cost curve \(plain step [\d.]+ ms, prefill "
                     r"[\d.]+ ms a token; re-estimated as answers come\)$", said), said
    assert ("defaults for a CPU backend" in said) == cpu_backend()
    steps = [s for s in lines if re.match(r"verify-run: (code|memo) run \d", s)]
    assert len(steps) == 2 * runs
    for step in steps:
        assert re.search(rf"\[\d of \d\] \(\d+ s in, {SPAN} left\)$", step), step
    assert doc["speed"]["costs"]["measured"], "measured up front, above, and recorded"


def test_first_ctrl_c_reports_what_was_measured_marked_incomplete(built, tmp_path: Path) -> None:
    """Issue 34: Ctrl-C printed "Aborted!" and wrote nothing. The first Ctrl-C ends after the
    request in flight; the JSON and the page hold the runs measured, marked incomplete; exit 1."""
    page, json_out = tmp_path / "r.html", (tmp_path / "out.json").open("w")
    proc = _verify_process(built("mimo"), tmp_path / "cache", "--loads", "code,memo", "--runs",
                           "3", "--max-tokens", "400", "--depth", "2", "--json", "--report",
                           str(page), stdout=json_out)
    err = _ctrl_c_after(proc, "[2 of 6]")  # the first run is measured, the second runs
    json_out.close()
    out = (tmp_path / "out.json").read_text()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "Aborted!" not in err
    doc = json.loads(out)
    validate(doc, "verify_run")
    measured = doc["interrupted"]["runs_measured"]
    assert doc["incomplete"] is True and doc["interrupted"]["runs_planned"] == 6
    assert 1 <= measured < 6 and not doc["passed"]
    assert f"interrupted after {measured} of 6 runs" in err
    assert _check(doc, "incomplete")["status"] == "fail"
    assert sum(len(r["plain"]["tokens"]) for r in doc["speed"]["loads"].values()) == measured
    html = page.read_text()
    assert f"incomplete: interrupted after {measured} of 6 runs" in html
    assert 'id="verdict">FAIL<' in html


def test_ctrl_c_while_the_curve_is_measured_still_reports(built, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C before the first request (the cost curve is being measured) writes the report
    too: nothing measured, marked incomplete, exit 1, no "Aborted!". (The Ctrl-C lands in the
    measurement itself: a real signal's timing would race a fixture's 0.3 s curve.)"""
    from mtpkit.verify.local import Local

    def interrupted(self: Any, depth: Any, progress: Any = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Local, "costs", interrupted)
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    page = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["verify-run", str(built("mimo")), "--loads", "code",
                                       "--json", "--report", str(page)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "Aborted!" not in result.output
    doc = json.loads(result.stdout)
    validate(doc, "verify_run")
    assert doc["incomplete"] is True and doc["interrupted"]["runs_measured"] == 0
    assert "incomplete: interrupted after 0 of" in page.read_text()


def test_a_second_ctrl_c_interrupts_at_once(built, tmp_path: Path) -> None:
    proc = _verify_process(built("mimo"), tmp_path / "cache", "--loads", "code", "--runs", "50",
                           "--max-tokens", "400", "--depth", "2", stdout=subprocess.DEVNULL)
    assert proc.stderr is not None
    while "code run 1/50" not in (line := proc.stderr.readline()):
        assert line or proc.poll() is None
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)  # not the 100 runs left
    assert proc.returncode != 0
