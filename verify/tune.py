"""`mtpkit tune`: this machine's measured cost curve for a bundle (decoder/tuning/costs.py), where it is
cached, and the depth `--depth auto` starts from at a few acceptance levels (decoder/tuning/policy.py),
at each context measured and at the longest the model takes (the curve priced there).
Also the line `serve` prints at start-up, and the stderr progress display of a measurement that
generate, serve and tune pass down (the decoder itself prints nothing)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mtpkit.decoder.tuning.batch_costs import Told
from mtpkit.decoder.tuning.costs import (
    LONGEST,
    RETRY_SHARE,
    Progress,
    Tick,
    noisy,
)
from mtpkit.decoder.tuning.curve import CostCurve
from mtpkit.decoder.tuning.policy import DepthPolicy
from mtpkit.decoder.tuning.store import cache_dir, cache_file

if TYPE_CHECKING:
    from mtpkit.decoder.runner import Runner

ACCEPTANCE = (0.3, 0.5, 0.7, 0.9)  # a_1 levels the picks are shown at (a_i = a_1 ** i)


def _cache_file(key: dict[str, Any] | None) -> Path | None:
    """The cache file of `key`, named as decoder/tuning/costs.py names it (None: not cached)."""
    return cache_file(key) if key else None


def picks(curve: CostCurve, max_depth: int, source: str = "head") -> list[dict[str, Any]]:
    """The depth the policy picks before any round is seen, for a prior acceptance a_1 with
    geometric decay (a_i = a_1 ** i), and the speedup over plain decoding it predicts. For
    "lookup": drafting is free, and a match is taken as long as max_depth allows."""
    out = []
    for a1 in ACCEPTANCE:
        policy = DepthPolicy(curve, max_depth, prior=a1, sources=(source,))
        depth = policy.choose(max_depth)[1]
        out.append({"acceptance": a1, "depth": depth,
                    "tokens_per_round": 1.0 + sum(policy.acceptance(source)[:depth]),
                    "predicted_speedup": policy.predicted_speedup(depth, source)})
    return out


def by_context(curve: CostCurve, longest: int | None, max_depth: int, source: str
               ) -> list[dict[str, Any]]:
    """The curve as --depth auto prices a round at each context measured and at the longest
    the model takes (extrapolated where beyond them; LONGEST where it declares none), with the
    first picks there."""
    measured = curve.contexts()
    top = longest or LONGEST
    out = []
    for length in measured + ([top] if top > measured[-1] else []):
        at = curve.at(length)
        out.append({"context": length, "measured": length in measured, "verify": at.verify,
                    "plain": at.plain, "picks": picks(at, max_depth, source)})
    return out


def report(runner: Runner, bundle: str, refresh: bool = False,
           progress: Progress | None = None, batch: int | None = None,
           told: Told | None = None) -> dict[str, Any]:
    """The cost curve document `mtpkit tune --json` prints: CostCurve.stored() (the curve and
    how far to trust it: spread, when, the machine's load) plus the bundle, whether it was
    measured now or read from the cache, the cache file and the picks. progress: told how a
    measurement goes (`progress_bar()` draws it on stderr). `batch`: also the round costs of
    batches of up to that many rows (decoder/tuning/batch_costs.py; `told` hears how their timing
    goes: `batch_lines()`)."""
    began = time.time()
    curve = runner.costs(refresh, progress)
    measured = not curve.key or curve.measured_at >= began  # (read once: store.py's one line)
    path = _cache_file(curve.key)
    max_depth = runner.policy("auto")[0]
    lookup_depth = runner.policy("auto", "lookup")[0]
    doc = {"bundle": bundle, **curve.stored(), "measured": measured,
           "cache": str(path if path is not None and path.exists() else cache_dir()),
           "max_depth": max_depth, "picks": picks(curve, max_depth) if runner.head else [],
           "lookup_picks": picks(curve, lookup_depth, "lookup"),
           "by_context": by_context(curve, runner.context, *((max_depth, "head") if runner.head
                                                             else (lookup_depth, "lookup")))}
    if batch is not None:
        paid, timed = runner.batch_costs(batch, refresh, told)
        doc["batch"] = {"max_batch": batch, "measured": timed, "head": runner.head is not None,
                        "round_ms": {f"{rows},{shape}": round(1000 * statistics.median(t), 3)
                                     for (rows, shape), t in sorted(paid.items()) if t}}
        if runner.trunk.passes is not None:
            doc["batch"]["untraced"] = [f"{rows},{w}" for (rows, w), stock
                                        in sorted(runner.trunk.passes.stock_rows.items()) if stock]
    return doc


def batch_lines(most: int | None = None, file: Any = None) -> Told:
    """How timing a batch's rounds goes, one line per shape on stderr, with the seconds left as
    a range once a shape has been timed: from the mean shape so far (low) to every shape left
    costing the dearest one seen, scaled to `most` rows (high: later shapes run more rows)."""
    out = sys.stderr if file is None else file
    start = time.perf_counter()
    last = [start, 0]  # when the shape in flight began, and its rows
    dearest: dict[int, float] = {}  # rows -> the longest shape timed at that many rows

    def show(what: str, done: int, total: int) -> None:
        now = time.perf_counter()
        spent = now - start
        if what == "start":
            click.echo(f"timing batched rounds for --depth auto: {total} shapes (tune keeps "
                       "them per bundle, dtype and versions)", file=out)
            return
        if what == "done":
            click.echo(f"  batch rounds: timed in {spent:.0f} s", file=out)
            return
        if last[1]:
            dearest[last[1]] = max(dearest.get(last[1], 0.0), now - last[0])
        last[:] = [now, int(what.split(" ", 1)[0]) if what[:1].isdigit() else 0]
        left = ""
        if done and dearest:
            rows = max(dearest)
            low = spent / done * (total - done)
            high = dearest[rows] * max(most or rows, rows) / rows * (total - done)
            left = ", about " + _left(low, high)
        click.echo(f"  batch rounds: {what} ({done}/{total}, {spent:.0f} s{left})", file=out)

    return show


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.0f} min"


def _left(low: float, high: float) -> str:
    """Seconds left as a range, "40 s left, up to 70 s" (one figure where both read the same)."""
    low, high = _seconds(low), _seconds(max(low, high))
    return f"{low} left" + (f", up to {high}" if high != low else "")


def _spans(rows: list[int]) -> str:
    """1 2 3 6 -> "1-3, 6"."""
    out: list[str] = []
    for t in sorted(rows):
        if out and out[-1].split("-")[-1] == str(t - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{t}"
        else:
            out.append(str(t))
    return ", ".join(out)


def how_measured(curve: CostCurve | dict[str, Any]) -> str:
    """How a curve was measured, in a few words: its duration, the widths interpolated, the
    widths re-measured and smoothed (empty for a curve given by hand)."""
    doc = curve.to_dict() if isinstance(curve, CostCurve) else curve
    if not doc["timed"]:
        return ""
    parts = [f"measured in {doc['seconds']:.1f} s"]
    if len(doc["timed"]) < len(doc["verify"]):
        parts.append(f"T {_spans(doc['timed'])} timed, the rest interpolated")
    if doc["remeasured"]:
        parts.append(f"T {_spans(doc['remeasured'])} re-measured (a wider pass came out "
                     "cheaper)")
    if doc["longer"]:
        parts.append(f"at {', '.join(str(p['context']) for p in doc['longer'])} tokens too "
                     "(priced linearly in the context between, extrapolated beyond)")
    else:
        parts.append("at one context: priced alike at every context")
    if doc["smoothed"]:
        widths = doc["widths"]
        parts.append("smoothed: " + ", ".join(f"T {t} priced and verified at width "
                                              f"{widths[t - 1]}" for t in doc["smoothed"])
                     + " (cheaper twice; mtpkit tune --refresh measures again)")
    return "; ".join(parts)


def progress_bar(file: Any = None) -> Progress:
    """A measurement shown on stderr: what is measured and why, at most how long (the budget)
    before anything runs, then a bar (on a terminal; elsewhere, in a log, one line with the
    plan), then how it went. The seconds left are shown once the probes have made a plan: the
    plan's figure, stretched by the wall-clock time the timings did not count, up to that
    plus the share a re-measurement may take (RETRY_SHARE of the plan, at most of the budget)."""
    out = sys.stderr if file is None else file
    terminal = hasattr(out, "isatty") and out.isatty()
    state: dict[str, Any] = {}

    def show(tick: Tick) -> None:
        bar = state.get("bar")
        if tick.phase == "start":
            state["start"] = time.perf_counter()
            click.echo("measuring this machine's verify costs for --depth auto (once per "
                       "bundle, dtype and versions; cached): at most about "
                       f"{tick.budget_s:.0f} s", file=out)
            if terminal:  # the ETA is the plan's, not a rate's: the bar shows it as its item
                bar = state["bar"] = click.progressbar(
                    length=1000, label="  verify costs", file=out, show_eta=False, width=30,
                    item_show_func=lambda item: item)
                bar.__enter__()
        elif tick.phase == "plan" and not terminal:
            click.echo(f"  verify costs: about {tick.total_s:.0f} s in all ({tick.what})",
                       file=out)
        elif tick.phase == "done":
            if bar is not None:
                bar.update(1000 - bar.pos, "done")
                bar.render_finish()
            assert tick.curve is not None
            click.echo(f"  {how_measured(tick.curve)}", file=out)
            if note := noisy(tick.curve):
                click.echo(f"  {note}", file=out)
        elif bar is not None:  # "plan" or "step"
            state["planned"] = state.get("planned") or tick.phase == "plan"
            left = "probing"
            if state["planned"]:
                wall = time.perf_counter() - state.get("start", time.perf_counter())
                stretch = max(1.0, wall / tick.done_s) if tick.done_s > 0 else 1.0
                retry = RETRY_SHARE * min(tick.budget_s, tick.total_s)
                left = _left(tick.eta_s * stretch, (tick.eta_s + retry) * stretch)
            bar.current_item = f"{tick.what}: {left}"
            moved = max(min(int(1000 * tick.done_s / max(tick.total_s, 1e-9)), 1000) - bar.pos, 0)
            if moved:
                bar.update(moved)
            else:
                bar.render_progress()

    return show


REFERENCE_WINDOW_S = 2.0  # the recent rate the reference bar compares with the whole run's


class ReferenceBar:
    """generate --compare's plain reference run on stderr: said before it starts, then a bar
    on a terminal (elsewhere a line per stage), as its warm-ups, prefill and tokens come. Each
    stage before the first token shows what the first warm-up took (they prefill the same
    prompt); the decode ETA counts from the first token, is shown once a second of decoding
    has been seen, and spans the whole run's rate and the last seconds' rate."""

    def __init__(self, total: int, file: Any = None) -> None:
        self.out = sys.stderr if file is None else file
        click.echo(f"warming up, then plain decoding first (the reference for --compare): up "
                   f"to {total} tokens", file=self.out)
        self.bar: Any = None
        if hasattr(self.out, "isatty") and self.out.isatty():
            self.bar = click.progressbar(length=total, label="  plain reference", file=self.out,
                                         show_eta=False, width=30, item_show_func=lambda x: x)
            self.bar.__enter__()
        self.seen: list[tuple[float, int]] = []  # (when, tokens) of every report

    def stage(self, what: str, seconds: float | None) -> None:
        note = what + (f", about {_seconds(seconds)}" if seconds is not None else "")
        if self.bar is None:
            click.echo(f"  {note}", file=self.out)
        else:  # (update() renders only past a step)
            self.bar.current_item = note
            self.bar.render_progress()

    def __call__(self, done: int, most: int) -> None:
        if self.bar is None:
            return
        now = time.perf_counter()
        self.seen.append((now, done))
        first_t, first_n = self.seen[0]
        item = "measuring the rate"
        if now - first_t >= 1.0 and done > first_n:
            recent_t, recent_n = next((t, n) for t, n in self.seen
                                      if now - t <= REFERENCE_WINDOW_S)
            rates = [(done - first_n) / (now - first_t)]
            if now - recent_t > 0.25 and done > recent_n:
                rates.append((done - recent_n) / (now - recent_t))
            left = most - done
            item = _left(left / max(rates), left / min(rates) * 1.1)
        self.bar.update(done - self.bar.pos, item)
        if done >= most:
            self.bar.render_finish()


def _pick_lines(found: list[dict[str, Any]]) -> list[str]:
    return [f"    a_1 {100 * p['acceptance']:.0f}%: "
            + (f"depth {p['depth']}" if p["depth"] else "plain decoding")
            + f", predicted {p['predicted_speedup']:.2f}x" for p in found]


def render_text(doc: dict[str, Any]) -> str:
    ms = [1000 * c for c in doc["verify"]]
    backend = doc["key"].get("backend", "?") if doc["key"] else "?"
    lines = [f"mtpkit tune {doc['bundle']}  ({backend}; "
             + ("measured now" if doc["measured"] else "from the cache") + f": {doc['cache']})",
             f"  verify pass over T rows at a {doc['context']}-token context:",
             "     T   c(T) ms   c(T)/c(1)   cheapest width"]
    lines += [f"  {t:>4}  {c:>8.2f}  {r:>10.2f}  {w:>15}" for t, (c, r, w) in
              enumerate(zip(ms, doc["ratios"], doc["widths"], strict=True), 1)]
    if note := how_measured(doc):
        lines.append(f"  {note}")
    lines.append(f"  plain step {1000 * doc['plain']:.2f} ms (pipelined), head draft step "
                 + (f"{1000 * doc['draft']:.2f} ms" if doc["picks"] else "- (no MTP head)"))
    lines += _context_text(doc)
    if doc["picks"]:
        lines.append(f"  --depth auto's first pick (a_i = a_1^i, depth <= {doc['max_depth']}; "
                     "then it follows the acceptance it sees):")
        lines += _pick_lines(doc["picks"])
    else:
        lines.append("  no MTP head: --depth auto drafts from the context (lookup) where a match "
                     "pays, and decodes plainly elsewhere")
    lines.append("  a context (lookup) match as long as the depth allows, drafted for free:")
    lines += _pick_lines(doc["lookup_picks"])
    if (batch := doc.get("batch")) is not None:
        lines += _batch_text(batch)
    return "\n".join(lines)


SHOWN = (1, 2, 4, 8, 16)  # the widths the by-context table shows


def _context_text(doc: dict[str, Any]) -> list[str]:
    """The cost by context as a table: c(T) at a few widths, the plain step, the first picks."""
    if not doc["longer"]:
        return []
    which = "head" if doc["picks"] else "context"
    lines = [f"  by context, as --depth auto prices a round there (ms; * extrapolated), and its "
             f"first pick ({which} drafts) at a_1 "
             + "/".join(f"{100 * a:.0f}" for a in ACCEPTANCE) + "%:",
             "     context" + "".join(f"{f'c({t})':>9}" for t in SHOWN) + "    plain   picks"]
    for row in doc["by_context"]:
        name = f"{row['context']}{'' if row['measured'] else '*'}"
        costs = "".join(f"{1000 * row['verify'][t - 1]:>9.2f}" for t in SHOWN)
        chosen = ", ".join(f"d{p['depth']}" if p["depth"] else "plain" for p in row["picks"])
        lines.append(f"  {name:>10}{costs}{1000 * row['plain']:>9.2f}   {chosen}")
    return lines


def _batch_text(batch: dict[str, Any]) -> list[str]:
    """The batch round costs as a table: rows by shape (plain steps, plain rounds, depths)."""
    if not batch["head"]:
        return ["  batch rounds: no MTP head to time (a batch times its rounds as it decodes)"]
    costs: dict[int, dict[int, float]] = {}
    for name, ms in batch["round_ms"].items():
        rows, shape = (int(part) for part in name.split(","))
        costs.setdefault(rows, {})[shape] = ms
    depths = sorted({s for by in costs.values() for s in by if s > 0}
                    | {-1 - s for by in costs.values() for s in by if s < -1})
    head = "".join(f"{'depth ' + str(k):>10}" for k in depths)
    lines = [f"  batch rounds, ms ({'timed now' if batch['measured'] else 'from the cache'}; "
             "pipelined where the batch pipelines them, else synchronous):",
             f"    rows  plain step  plain round{head}"]
    for rows in sorted(costs):
        by = costs[rows]

        def cell(*keys: int, by: dict[int, float] = by) -> str:
            found = next((by[k] for k in keys if k in by), None)
            return "-" if found is None else f"{found:.2f}"
        cells = "".join(f"{cell(-1 - k, k):>10}" for k in depths)
        lines.append(f"    {rows:>4}  {cell(-1):>10}  {cell(0):>11}{cells}")
    if "untraced" in batch:
        faster = ", ".join(f"{r} rows x {w}" for r, w in
                           (name.split(",") for name in batch["untraced"])) or "none"
        lines.append(f"    passes faster untraced than traced here (run so): {faster}")
    return lines


def batch_summary(runner: Runner) -> str:
    """What `serve` says of its batches' round prices at start-up (after `summary`)."""
    table = runner.paid
    timed = {*table.ratios, *table.seeded} if table is not None else set()
    sizes = sorted({rows for rows, _, _ in timed if rows > 1})
    if sizes:
        return (f"batches: round prices for {', '.join(map(str, sizes))} rows, timed once for "
                "this bundle (as mtpkit tune --max-batch N times them); the cost curve prices "
                "the rest, and every round corrects the prices as it runs")
    why = ("no MTP head: nothing to time up front" if runner.head is None
           else "mtpkit tune BUNDLE --max-batch N times them once, up front")
    return f"batches: priced by the cost curve, corrected as rounds run ({why})"


def summary(runner: Runner, draft: str | None = None, verbose: bool = False,
            progress: Progress | None = None) -> str:
    """What `serve --depth auto` says at start-up (measures the curve once, telling `progress`,
    or reads it): one short line; with `verbose`, the curve's ratios and the first picks."""
    began = time.time()
    curve = runner.costs(progress=progress)
    fresh = not curve.key or curve.measured_at >= began
    if not verbose:
        path = _cache_file(curve.key)
        where = (f"measured now, cached in {path}" if fresh and path is not None else
                 f"from the cache {path}" if path is not None else "measured now")
        return (f"depth auto: chosen per round from this machine's costs ({where}; --verbose "
                "or mtpkit tune shows them)")
    ratios = curve.ratios()
    shown = " ".join(f"{t}:{ratios[t - 1]:.2f}" for t in (2, 4, 8, 16) if t <= len(ratios))
    note = f"; {how_measured(curve)}" if how_measured(curve) else ""
    if runner.draft_source("auto", draft) == "lookup":
        why = "no MTP head, " if runner.head is None else ""
        return (f"depth auto: {why}context lookup drafts chosen per round from this machine's "
                f"costs (verify c(T)/c(1) {shown}; c(1) {1000 * curve.verify[0]:.2f} ms, plain "
                f"step {1000 * curve.plain:.2f} ms{note}; mtpkit tune shows more)")
    starts = ", ".join(f"a_1 {100 * p['acceptance']:.0f}% -> "
                       + (f"d{p['depth']}" if p["depth"] else "plain")
                       for p in picks(curve, runner.policy("auto")[0]))
    return (f"depth auto: chosen per round from this machine's costs (verify c(T)/c(1) {shown}; "
            f"c(1) {1000 * curve.verify[0]:.2f} ms, plain step {1000 * curve.plain:.2f} ms, head "
            f"draft {1000 * curve.draft:.2f} ms; starts at {starts}{note}; mtpkit tune shows "
            "more)")
