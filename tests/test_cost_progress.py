"""Issue 34, the cost curve: the first `--depth auto` run of a bundle says what it measures and
how long it will take, shows a bar with an ETA on stderr, holds a time budget, and checks the
curve (a wider pass timed cheaper than a narrower one is re-measured, then smoothed and
flagged); a cached curve that fails the check is measured again; library calls print nothing.

Measured times are injected through measure()'s `timer` argument (the seam that times every
call), so a loaded machine's curve is reproduced exactly, without a loaded machine."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import mtpkit
from mtpkit.decoder.runner import Runner
from mtpkit.decoder.tuning import costs, store
from mtpkit.decoder.tuning.costs import Tick
from mtpkit.decoder.tuning.curve import CONTEXT, CostCurve, breaks
from mtpkit.verify.tune import render_text, report, summary

EXE = shutil.which("mtpkit", path=os.path.dirname(sys.executable)) or "mtpkit"
MEASURING = ("measuring this machine's verify costs for --depth auto (once per bundle, dtype "
             "and versions; cached): at most about")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A fresh user's environment: an empty XDG cache, no suite cache."""
    env = {k: v for k, v in os.environ.items() if k != "MTPKIT_CACHE"}
    return {**env, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", **extra}


def _on_a_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run a command with stderr on a pseudo-terminal (as a user's shell has it): exit code,
    stdout, everything written to the terminal."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            raise AssertionError(f"silent for 120 s: {seen[-2000:]!r}")
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out = proc.stdout.read() if proc.stdout else b""
    code = proc.wait(timeout=60)
    os.close(master)
    return code, out.decode(), seen.decode(errors="replace")


def test_first_generate_says_what_it_measures_and_shows_a_bar_with_an_eta(
        built: Callable[..., Path], tmp_path: Path) -> None:
    bundle = built("qwen3_5")
    args = [EXE, "generate", str(bundle), "Hi", "--raw", "--max-tokens", "4"]
    code, out, term = _on_a_terminal(args, _env(tmp_path))
    assert code == 0, term
    assert re.search(re.escape(MEASURING) + r" \d+ s\r?\n", term), "said first: " + term
    assert re.search(r"verify costs\s+\[[#-]+\]\s+\d+%\s+verify T=\d+: \d+ s left", term), term
    assert re.search(r"measured in \d+\.\d s", term), term
    assert term.index("at most about") < term.index("measured in")
    stored = list((tmp_path / "xdg" / "mtpkit" / "costs").glob("*.json"))
    assert len(stored) == 1, "measured once and cached in $XDG_CACHE_HOME/mtpkit/costs"

    stale = "stale" in json.loads(stored[0].read_text())  # its own plain steps ran 1.5x
    # faster than it measured them on a busy machine (costs.check_plain): measured again
    again = subprocess.run(args, capture_output=True, text=True, env=_env(tmp_path))
    assert again.returncode == 0
    assert ("measuring again" in again.stderr) == stale, again.stderr
    assert stale or "measuring" not in again.stderr, "the cache answers"


def test_progress_without_a_terminal_is_a_few_lines_with_the_plan(
        built: Callable[..., Path], tmp_path: Path) -> None:
    proc = subprocess.run([EXE, "tune", str(built("qwen3_5")), "--json"], capture_output=True,
                          text=True, env=_env(tmp_path, MTPKIT_COST_BUDGET="7"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines and lines[0] == MEASURING + " 7 s", lines
    assert re.fullmatch(r"  verify costs: about \d+ s in all \(\d+ widths x \d+ passes; then up "
                        r"to 3840 tokens\)", lines[1]), lines  # (the fixture's 4,096 less a GRAIN)
    assert re.match(r"  measured in \d+\.\d s; .*at (\d+ tokens too|one context)", lines[2]), \
        lines  # as far as the budget reached
    assert lines[3:] == [] or len(lines) == 4 and "busy machine" in lines[3], lines  # (a noisy
    # measurement says so: costs.noisy)
    doc = json.loads(proc.stdout)
    assert doc["measured"] and doc["timed"] and doc["seconds"] > 0


def _linear_timer(base: float, per_row: float, plain_step: float = 0.0,
                  odd: Callable[[int, int], float | None] | None = None,
                  calls: list[tuple[str, int]] | None = None) -> costs.Timer:
    """A timer whose verify pass over T rows "takes" base + per_row * T seconds (odd(T, n), the
    n-th verify of T rows, may say otherwise), a plain step plain_step (default c(1))."""
    seen: dict[int, int] = {}

    def timer(kind: str, size: int, run: Callable[[], object]) -> float:
        run()
        if calls is not None:
            calls.append((kind, size))
        if kind in ("verify", "warm-up"):
            seen[size] = seen.get(size, 0) + (kind == "verify")
            forced = odd(size, seen[size]) if odd is not None and kind == "verify" else None
            return forced if forced is not None else base + per_row * size
        if kind == "plain":
            return size * (plain_step or base + per_row)
        return 0.001

    return timer


@pytest.fixture
def runner(built: Callable[..., Path], tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> Runner:
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    return mtpkit.load(built("qwen3_5"))


def test_the_measurement_holds_its_budget(runner: Runner) -> None:
    calls: list[tuple[str, int]] = []
    ticks: list[Tick] = []
    timer = _linear_timer(0.01, 0.002, calls=calls)
    tight = costs.measure(runner, budget_s=1.5, timer=timer, progress=ticks.append)
    assert tight.seconds <= 1.5, f"{tight.seconds:.2f} s of a 1.5 s budget"
    assert tight.timed == list(costs.SPARSE_ROWS), "all 16 widths do not fit: a few, interpolated"
    assert tight.verify == pytest.approx([0.01 + 0.002 * t for t in range(1, 17)])
    assert [t.phase for t in ticks][:2] == ["start", "step"] and ticks[-1].phase == "done"
    assert ticks[0].budget_s == 1.5 and ticks[-1].curve is tight
    plan = next(t for t in ticks if t.phase == "plan")
    assert plan.total_s <= 1.5 + 1e-9, "the plan fits the budget"
    assert ("warm-up", 4) not in calls, "no compile seen: a width's first pass is a timing"
    for before, after in zip(ticks, ticks[1:], strict=False):
        assert after.done_s >= before.done_s and after.done_s <= after.total_s + 1e-9

    calls.clear()
    roomy = costs.measure(runner, budget_s=100.0, timer=_linear_timer(0.01, 0.002, calls=calls))
    assert roomy.timed == list(range(1, 17)) and roomy.seconds <= 100.0
    prefills = [i for i, (kind, _) in enumerate(calls) if kind == "prefill"] + [len(calls)]
    first = calls[:prefills[6]]  # (64, pairs of 64, 128, then 64 tokens; the longer contexts')
    passes = sum(1 for kind, rows in first if kind == "verify" and rows == 4)
    assert passes == costs.MIN_REPEATS, "timings that agree stop a width early"


def test_load_after_the_probes_costs_passes_not_the_budget(runner: Runner) -> None:
    """The probes planned the passes; then every pass took twice as long, give or take 10% (a
    CI machine got busy): rows take fewer passes, and the whole stays within the budget and its
    retry share, give or take the pass that found it out."""
    probes = {1: 1, costs.MAX_ROWS: 1}  # each probe width's warm-up and first verify
    count = [0]

    def timer(kind: str, size: int, run: Callable[[], object]) -> float:
        run()
        idle = 0.01 + 0.002 * size
        if kind in ("verify", "warm-up") and probes.get(size, 0) > 0:
            probes[size] -= kind == "verify"
            return idle
        count[0] += 1
        busy = 2 * (1.1 if count[0] % 2 else 0.9)
        return busy * (size * 0.012 if kind == "plain" else idle if kind != "draft" else 0.001)

    for budget in (1.5, 4.0):
        probes.update({1: 1, costs.MAX_ROWS: 1})
        curve = costs.measure(runner, budget_s=budget, timer=timer)
        longest = 2.2 * (0.01 + 0.002 * costs.MAX_ROWS)
        assert curve.seconds <= budget * (1 + costs.RETRY_SHARE) + longest, (budget, curve.seconds)
        assert breaks(curve.verify) == []


def test_a_cheaper_wider_pass_that_goes_away_is_remeasured(runner: Runner) -> None:
    """c(1) 215 ms > c(2) 154 ms while the machine was loaded (issue 34): timed again, fixed."""
    state = {"loaded": True}

    def odd(rows: int, n: int) -> float | None:
        if rows == 16 and n >= 2:  # the last width of the first pass: the load is gone
            state["loaded"] = False
        return 0.215 if rows == 1 and state["loaded"] else None

    curve = costs.measure(runner, budget_s=100.0, timer=_linear_timer(0.14, 0.007, odd=odd),
                          longer=[])  # (the first context's checks: test_context_costs.py)
    assert curve.remeasured == [1, 2] and curve.smoothed == []
    assert curve.verify[0] == pytest.approx(0.147) and breaks(curve.verify) == []
    assert curve.width(1) == 1


def test_a_cheaper_wider_pass_that_stays_is_smoothed_and_flagged(runner: Runner) -> None:
    curve = costs.measure(runner, budget_s=100.0, timer=_linear_timer(
        0.14, 0.007, odd=lambda rows, n: 0.215 if rows == 1 else None), longer=[])
    assert curve.remeasured == [1, 2] and curve.smoothed == [1]
    assert curve.verify[0] == curve.verify[1] == pytest.approx(0.154)
    assert curve.width(1) == 2, "priced at width 2, so verified at width 2 (padding)"
    assert all(b >= a for a, b in zip(curve.verify, curve.verify[1:], strict=False))

    spike = costs.measure(runner, budget_s=100.0, timer=_linear_timer(  # 4:8.45 next to 8:1.17
        0.14, 0.007, odd=lambda rows, n: 8.45 * 0.147 if rows == 4 else None), longer=[])
    assert spike.smoothed == [4] and 4 in spike.remeasured
    assert spike.ratios()[3] == pytest.approx(spike.ratios()[4]) and max(spike.ratios()) < 2
    assert spike.width(4) == 5

    doc = {"bundle": "b", **curve.to_dict(), "context": CONTEXT, "measured": True,
           "cache": "c", "max_depth": 0, "picks": [], "lookup_picks": []}
    text = render_text(doc)
    assert "T 1-2 re-measured" in text and "T 1 priced and verified at width 2" in text


def test_a_cached_curve_that_breaks_the_check_is_measured_again(runner: Runner) -> None:
    assert runner.root is not None
    key = costs.cache_key(runner.root, runner.load_options)
    broken = [0.215, 0.154] + [0.154 + 0.007 * t for t in range(14)]  # as an old version cached
    costs.store(CostCurve(broken, 0.14, 0.01, key))
    assert runner.costs().verify != broken, "a curve that fails the check is not trusted"
    assert breaks(runner.costs().verify) == []
    stored = json.loads(next(store.cache_dir().glob("*.json")).read_text())
    assert stored["verify"] == runner.costs().verify and stored["timed"], "and is replaced"


def test_library_calls_print_nothing(runner: Runner, capfd: pytest.CaptureFixture[str]) -> None:
    curve = runner.costs()
    report(runner, "b")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "") and curve.timed and curve.seconds > 0


def test_serve_prints_one_short_line_unless_verbose(runner: Runner, tmp_path: Path) -> None:
    shown: list[str] = []
    line = summary(runner, progress=lambda t: shown.append(t.phase))
    assert shown[0] == "start" and shown[-1] == "done", "measured now, with progress"
    assert line.startswith("depth auto: ") and "measured now, cached in" in line
    assert "c(T)/c(1)" not in line and "--verbose" in line
    again = summary(mtpkit.load(runner.root))
    assert "from the cache" in again and "c(T)/c(1)" not in again
    verbose = summary(runner, verbose=True)
    assert "c(T)/c(1)" in verbose and "starts at" in verbose and "measured in" in verbose


def test_real_serve_says_one_line_about_costs(built: Callable[..., Path], tmp_path: Path) -> None:
    proc = subprocess.Popen([EXE, "serve", str(built("qwen3_5")), "--port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=_env(tmp_path))
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(x.startswith("serving") for x in lines):
            lines.append(proc.stderr.readline().rstrip("\n"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert any(x.startswith(MEASURING) for x in lines), lines
    depth = [x for x in lines if x.startswith("depth auto:")]
    assert len(depth) == 1 and "c(T)/c(1)" not in depth[0] and "cached in" in depth[0], lines


def test_the_real_smollm2_curve_is_measured_in_the_budget(smollm2_bf16: Path,
                                                          tmp_path: Path) -> None:
    """The bundle of the issue (SmolLM2-135M) on this machine: within its budget (20 s, and
    the retry share) by its own clock; the wall clock, imports and compiles on a loaded machine
    included, within 60 s."""
    runner = mtpkit.load(smollm2_bf16, dtype="float32")
    start = time.perf_counter()
    curve = costs.measure(runner)
    took = time.perf_counter() - start
    assert took <= 60 and curve.seconds <= costs.BUDGET_S * (1 + costs.RETRY_SHARE) + 2, took
    assert breaks(curve.verify) == []


def test_compare_says_it_runs_plain_first_with_a_bar(built: Callable[..., Path],
                                                     tmp_path: Path) -> None:
    """generate --compare (what scripts/demo.sh runs) warms up and decodes plain first, many
    seconds with nothing on stdout: it says so, with a bar and an ETA on a terminal."""
    args = [EXE, "generate", str(built("qwen3_5")), "Hi", "--raw", "--depth", "2",
            "--max-tokens", "24", "--compare"]
    code, out, term = _on_a_terminal(args, _env(tmp_path))
    assert code == 0, term
    said = "warming up, then plain decoding first (the reference for --compare): up to 24 tokens"
    assert said in term, term
    assert re.search(r"plain reference\s+\[[#-]+\]\s+\d+%", term), term
    assert term.index(said) < term.index("[plain ") and "speedup" in term
    # the seconds before the first token (two warm-ups and the prefill) are said too, each
    # after the first with what the first warm-up took
    assert re.search(r"the reference's prefill, about \d+ s", term), term
    piped = subprocess.run(args, capture_output=True, text=True, env=_env(tmp_path), timeout=300)
    assert piped.returncode == 0 and said in piped.stderr and "plain reference" not in piped.stderr
    stages = [line for line in piped.stderr.splitlines() if line.startswith("  warm-up")
              or line.startswith("  the reference's")]
    assert stages[0] == "  warm-up 1 of 2 (plain)", piped.stderr
    assert re.fullmatch(r"  warm-up 2 of 2 \(depth 2\), about \d+ s", stages[1]), stages
    assert re.fullmatch(r"  the reference's prefill, about \d+ s", stages[2]), stages
