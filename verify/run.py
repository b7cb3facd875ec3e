"""`mtpkit verify-run`: end-to-end checks of a local bundle or an OpenAI-compatible endpoint,
each passing or failing with its evidence, and speed measured the honest way (warm-up, a nonce
in every prompt, real-content loads with fixed ceilings, baseline first, steady decode after the
first 64 tokens, P50/P95 over runs). With depth "auto" a target that takes it (mtpkit serve, a
local bundle) chooses each round's depth itself and reports its choices and predicted speedup;
for a target that takes only numbers, a depth sweep picks this machine's best depth. A draft
source ("head", "lookup", "both") goes with every speculative request; each load's row records
the source the target used and its telemetry per source."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any, Protocol

from mtpkit.verify.answer import Answer
from mtpkit.verify.checks import (
    FAIL,
    INFO,
    PASS,
    Check,
    answer_check,
    counting_check,
    percentiles,
    streaming_check,
)
from mtpkit.verify.endpoint import EndpointError
from mtpkit.verify.loads import DEFAULT_LOADS, Load, real_loads

QUESTION = ("In two or three sentences, explain what a hash table is and why looking up a key "
            "in one is usually fast.")
ANSWER_TOKENS = 160
WARMUP_TOKENS = 16
SWEEP = (1, 2, 3, 4)


class Target(Protocol):
    def ask(self, messages: list[dict] | None = None, prompt: str | None = None, *,
            max_tokens: int, stream: bool, depth: int | str | None = None,
            thinking: bool | None = None, draft: str | None = None) -> Answer: ...


@dataclass
class VerifyOptions:
    depth: str | int = "auto"
    loads: tuple[str, ...] = DEFAULT_LOADS
    runs: int = 3
    max_tokens: int = 256
    drop: int = 64
    min_accept: float | None = None
    min_speedup: float | None = None
    draft: str | None = None  # "head", "lookup" or "both" (None: the target's default)

    def drafting(self, depth: int | str | None) -> dict[str, Any]:
        """The draft argument of a request at `depth`: only speculative requests name one (a
        target that takes no draft source is then asked nothing new)."""
        return {"draft": self.draft} if self.draft and depth else {}


@dataclass
class Facts:
    """What the caller knows about the target beyond its answers."""

    kind: str  # "bundle" | "endpoint"
    name: str
    template: Check | None = None  # a local bundle's template verdict
    thinking: bool | None = None  # the template has a thinking switch (None: unknown)
    exact_ids: bool = False  # answers carry token ids


@dataclass
class Report:
    target: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    speed: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "passed": self.passed,
                "checks": [c.to_dict() for c in self.checks], "speed": self.speed,
                "record": self.record}


def _ask(target: Target, text: str, chat: bool, **kw: Any) -> Answer:
    if chat:
        return target.ask([{"role": "user", "content": text}], **kw)
    return target.ask(prompt=text, **kw)


def _mtp_control(target: Target) -> bool:
    """Does the target honour a per-request MTP depth (reported back in usage)?"""
    answer = target.ask([{"role": "user", "content": "Hi"}], max_tokens=4, stream=False, depth=0)
    return isinstance(answer.mtp, dict) and answer.mtp.get("depth") == 0


def _auto_control(target: Target, options: VerifyOptions) -> bool:
    """Does the target take depth "auto" (reporting the depths it chose in usage)? A target
    that refuses it (an older server: HTTP 400) or ignores it gets a depth sweep instead."""
    try:
        answer = target.ask([{"role": "user", "content": "Hi"}], max_tokens=4, stream=False,
                            depth="auto", **options.drafting("auto"))
    except EndpointError:
        return False
    return isinstance(answer.mtp, dict) and isinstance(answer.mtp.get("depths"), dict)


def depths_text(depths: Mapping[str, int] | Mapping[int, int]) -> str:
    """Rounds per chosen depth as "plain 40 / d1 3 / d2 10" (plain: plain steps)."""
    items = sorted((int(d), n) for d, n in depths.items())
    return " / ".join(("plain" if d == 0 else f"d{d}") + f" {n}" for d, n in items) or "-"


def _merged(runs: list[dict[str, int]]) -> dict[str, int] | None:
    """Chosen depths summed over runs (None: no run reported any)."""
    total: dict[int, int] = {}
    for depths in runs:
        for d, n in depths.items():
            total[int(d)] = total.get(int(d), 0) + n
    return {str(d): total[d] for d in sorted(total)} or None


def mean_by_position(rows: list[list[float]]) -> list[float]:
    """Per draft position, the mean over the runs that drafted it (a run reports only the
    positions it drafted, so rows differ in length)."""
    return [statistics.mean(v for v in col if v is not None)
            for col in zip_longest(*rows, fillvalue=None)]


def _sources(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per-source telemetry summed over runs: rounds, drafts proposed and kept per position,
    and the acceptance they make (None: no run reported any)."""
    total: dict[str, dict[str, Any]] = {}
    for sources in runs:
        for name, s in sources.items():
            t = total.setdefault(name, {"rounds": 0, "proposed": [], "accepted": []})
            t["rounds"] += s["rounds"]
            for key in ("proposed", "accepted"):
                t[key] = [a + b for a, b in zip_longest(t[key], s[key], fillvalue=0)]
    return {name: {**t, "acceptance_by_depth": [a / p if p else 0.0 for a, p in zip(
        t["accepted"], t["proposed"], strict=True)]} for name, t in total.items()} or None


def _speed_row(answers: dict[str, list[Answer]], drop: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for mode, runs in answers.items():
        tps = [t for a in runs if (t := a.decode_tps(drop)) is not None]
        accept = [a.mtp["acceptance_by_depth"] for a in runs
                  if a.mtp and a.mtp.get("acceptance_by_depth")]
        predicted = [p for a in runs if a.mtp and (p := a.mtp.get("predicted_speedup"))]
        row[mode] = {
            "decode_tps": percentiles(tps),
            "ttft_s": percentiles([a.ttft_s for a in runs if a.ttft_s is not None]),
            "prefill_tps": percentiles([a.prefill_tps for a in runs if a.prefill_tps]),
            "tokens": [a.tokens for a in runs],
            "acceptance_by_depth": mean_by_position(accept) if accept else None,
            "peak_memory_bytes": max((a.peak_memory_bytes or 0 for a in runs), default=0) or None,
            "depths": _merged([a.mtp["depths"] for a in runs if a.mtp and a.mtp.get("depths")]),
            "predicted_speedup": statistics.median(predicted) if predicted else None,
            "draft": next((a.mtp["draft"] for a in runs if a.mtp and a.mtp.get("draft")), None),
            "sources": _sources([a.mtp["sources"] for a in runs
                                 if a.mtp and isinstance(a.mtp.get("sources"), dict)]),
            "rounds": [a.mtp["rounds"] for a in runs
                       if a.mtp and (a.mtp.get("rounds") or {}).get("t")] or None,
        }
    plain, mtp = row.get("plain", {}).get("decode_tps"), row.get("mtp", {}).get("decode_tps")
    row["speedup"] = mtp["p50"] / plain["p50"] if plain and mtp and plain["p50"] > 0 else None
    row["predicted_speedup"] = row.get("mtp", {}).get("predicted_speedup")
    return row


def _same(a: Answer, b: Answer) -> bool:
    if a.ids is not None and b.ids is not None:
        return a.ids == b.ids
    return a.content == b.content and a.reasoning == b.reasoning


def _pick_depth(target: Target, options: VerifyOptions, loads: dict[str, Load],
                progress: Callable[[str], None]) -> tuple[int, dict[str, Any]]:
    """Sweep depths on the code load (one run each, baseline first): the fastest depth, and
    the sweep (whose "recommended" is 0 when no depth beats plain decoding here)."""
    if options.depth != "auto":
        return int(options.depth), {}
    load = loads.get("code") or next(iter(loads.values()))

    def timed(depth: int, tokens: int = options.max_tokens) -> Answer:
        return _ask(target, load.fresh(), load.chat, max_tokens=tokens, stream=True, depth=depth,
                    **options.drafting(depth))

    for depth in (0, *SWEEP):
        timed(depth, WARMUP_TOKENS)
    base = timed(0)
    sweep = {}
    for depth in SWEEP:
        progress(f"depth sweep: {depth}")
        answer = timed(depth)
        plain, mtp = base.decode_tps(options.drop), answer.decode_tps(options.drop)
        sweep[depth] = {"decode_tps": mtp, "speedup": mtp / plain if plain and mtp else None,
                        "acceptance_by_depth": (answer.mtp or {}).get("acceptance_by_depth")}
    best = max(sweep, key=lambda d: sweep[d]["speedup"] or 0.0)
    recommended = best if (sweep[best]["speedup"] or 0.0) > 1.0 else 0
    return best, {"load": load.name, "plain_decode_tps": base.decode_tps(options.drop),
                  "depths": sweep, "fastest": best, "recommended": recommended}


def run(target: Target, facts: Facts, options: VerifyOptions,
        progress: Callable[[str], None] = lambda s: None) -> Report:
    report = Report({"kind": facts.kind, "name": facts.name})
    checks = report.checks
    try:
        _functional(target, facts, options, checks, progress)
        _speed(target, facts, options, report, progress)
    except EndpointError as exc:
        checks.append(Check("endpoint", FAIL, str(exc)))
    return report


def _functional(target: Target, facts: Facts, options: VerifyOptions, checks: list[Check],
                progress: Callable[[str], None]) -> None:
    progress("answer")
    if facts.template is not None:
        checks.append(facts.template)
        if facts.template.status == FAIL:
            return
    tokens = min(ANSWER_TOKENS, options.max_tokens)
    try:
        whole = _ask(target, QUESTION, True, max_tokens=tokens, stream=False)
    except EndpointError as exc:
        checks.append(Check("template", FAIL, f"a chat request failed: {exc}"))
        return
    if facts.template is None:
        checks.append(Check("template", PASS, "the endpoint renders chat requests"))
    checks.append(answer_check("answer", whole, "plain chat answer"))
    if facts.thinking is False:
        checks.append(Check("answer_thinking", INFO, "the template has no thinking switch"))
    else:
        progress("answer with thinking on")
        thinking = _ask(target, QUESTION, True, max_tokens=4 * tokens, stream=False,
                        thinking=True)
        checks.append(answer_check("answer_thinking", thinking, "with thinking on"))
    progress("streaming")
    streamed = _ask(target, QUESTION, True, max_tokens=tokens, stream=True)
    checks.append(streaming_check(whole, streamed))
    checks.append(counting_check(whole, streamed, "ids" if facts.exact_ids else "usage"))


def _speed(target: Target, facts: Facts, options: VerifyOptions, report: Report,
           progress: Callable[[str], None]) -> None:
    checks = report.checks
    loads = real_loads(options.loads)
    control = _mtp_control(target)
    depth: int | str | None = None
    sweep: dict[str, Any] = {}
    if control and options.depth == "auto" and _auto_control(target, options):
        depth = "auto"  # the target chooses each round's depth from its measured costs
    elif control:
        depth, sweep = _pick_depth(target, options, loads, progress)
    if not control:
        progress("the target has no MTP switch: measuring it as served")
    rows, exact = {}, []
    for name, load in loads.items():
        modes = {"plain": 0, "mtp": depth} if control and depth else {"as served": None}
        for d in modes.values():  # warm-up, each mode
            _ask(target, load.fresh(), load.chat, max_tokens=WARMUP_TOKENS, stream=True, depth=d,
                 **options.drafting(d))
        answers: dict[str, list[Answer]] = {m: [] for m in modes}
        for run in range(options.runs):
            progress(f"{name} run {run + 1}/{options.runs}")
            prompt = load.fresh()
            for mode, d in modes.items():  # baseline first, same prompt for every mode
                answers[mode].append(_ask(target, prompt, load.chat, max_tokens=options.max_tokens,
                                          stream=True, depth=d, **options.drafting(d)))
            if len(modes) == 2:
                exact.append(_same(answers["plain"][-1], answers["mtp"][-1]))
        rows[name] = _speed_row(answers, options.drop)
    report.speed = {"depth": depth, "draft": options.draft, "mtp_control": control,
                    "sweep": sweep, "loads": rows,
                    "runs": options.runs, "max_tokens": options.max_tokens, "drop": options.drop}
    checks.append(_exactness(exact, facts, depth))
    checks.extend(_speed_checks(rows, options, control, depth))


def _exactness(exact: list[bool], facts: Facts, depth: int | str | None) -> Check:
    if not exact:
        why = "no MTP depth to compare" if depth == 0 else "the target has no MTP switch"
        return Check("exactness", INFO, f"not checked: {why}")
    what = "token ids" if facts.exact_ids else "text"
    evidence = {"compared": len(exact), "identical": sum(exact), "by": what, "depth": depth}
    if all(exact):
        return Check("exactness", PASS, f"greedy MTP output equals plain output ({what}, "
                     f"{len(exact)} prompts, depth {depth})", evidence)
    return Check("exactness", FAIL, f"greedy MTP output differs from plain on "
                 f"{len(exact) - sum(exact)} of {len(exact)} prompts (in bf16 a verify pass can "
                 "flip a near-tie; float32 weights prove the rule)", evidence)


def _speed_checks(rows: dict[str, dict], options: VerifyOptions, control: bool,
                  depth: int | str | None) -> list[Check]:
    speedups = [r["speedup"] for r in rows.values() if r.get("speedup")]
    accepts = [r["mtp"]["acceptance_by_depth"][0] for r in rows.values()
               if r.get("mtp", {}).get("acceptance_by_depth")]
    out = []
    speedup = statistics.median(speedups) if speedups else None
    evidence = {"speedup_by_load": {k: r.get("speedup") for k, r in rows.items()}, "depth": depth}
    predicted = [p for r in rows.values() if (p := r.get("predicted_speedup"))]
    if predicted:
        evidence["predicted_by_load"] = {k: r.get("predicted_speedup") for k, r in rows.items()}
    if speedup is None:
        why = ("the target has no MTP switch" if not control else
               "depth 0 asked" if depth == 0 else "too few tokens")
        status = FAIL if options.min_speedup is not None else INFO
        out.append(Check("speedup", status, f"speedup not measured: {why}", evidence))
    else:
        floor = options.min_speedup
        status = FAIL if floor is not None and speedup < floor else PASS
        slower = "; slower than plain here: serve with depth 0" if speedup <= 1.0 else ""
        guess = f", predicted {statistics.median(predicted):.2f}x" if predicted else ""
        out.append(Check("speedup", status, f"MTP depth {depth} {speedup:.2f}x plain decoding "
                         f"(median over loads{guess})" + (f", floor {floor:.2f}x" if floor else "")
                         + slower, evidence))
    accept = statistics.mean(accepts) if accepts else None
    evidence = {"depth1_by_load": {k: (r.get("mtp", {}).get("acceptance_by_depth") or [None])[0]
                                   for k, r in rows.items()}}
    if accept is None:
        status = FAIL if options.min_accept is not None else INFO
        out.append(Check("acceptance", status, "acceptance not reported by the target", evidence))
    else:
        floor = options.min_accept
        status = FAIL if floor is not None and accept < floor else PASS
        out.append(Check("acceptance", status, f"depth-1 acceptance {100 * accept:.1f}%"
                         + (f", floor {100 * floor:.0f}%" if floor is not None else ""), evidence))
    return out


def table(doc: dict[str, Any]) -> str:
    """The human table verify-run prints."""
    lines = [f"verify-run {doc['target']['kind']} {doc['target']['name']}", ""]
    width = max(len(c["name"]) for c in doc["checks"]) if doc["checks"] else 8
    lines += [f"  {c['status'].upper():4}  {c['name']:<{width}}  {c['summary']}"
              for c in doc["checks"]]
    speed = doc.get("speed") or {}
    for name, row in (speed.get("loads") or {}).items():
        parts = []
        for mode in ("plain", "mtp", "as served"):
            tps = (row.get(mode) or {}).get("decode_tps")
            if tps:
                parts.append(f"{mode} {tps['p50']:.1f} tok/s (P95 {tps['p95']:.1f})")
        ttft = next(((row.get(m) or {}).get("ttft_s") for m in ("plain", "as served")
                     if (row.get(m) or {}).get("ttft_s")), None)
        if ttft:
            parts.append(f"TTFT {1000 * ttft['p50']:.0f} ms")
        accept = (row.get("mtp") or {}).get("acceptance_by_depth")
        if accept:
            parts.append("acceptance " + " / ".join(f"{100 * a:.0f}%" for a in accept))
        if row.get("speedup"):
            parts.append(f"speedup {row['speedup']:.2f}x")
        if row.get("predicted_speedup"):
            parts.append(f"predicted {row['predicted_speedup']:.2f}x")
        if (row.get("mtp") or {}).get("depths"):
            parts.append(f"depths {depths_text(row['mtp']['depths'])}")
        if (row.get("mtp") or {}).get("sources"):
            parts.append("drafts " + " / ".join(f"{name} {s['rounds']} rounds" for name, s in
                                                row["mtp"]["sources"].items()))
        lines.append(f"  load {name}: " + ", ".join(parts))
    fp = doc["record"].get("fingerprint", {}).get("sha256")
    verdict = "PASS" if doc["passed"] else "FAIL"
    lines += ["", f"{verdict}" + (f"  (weights sha256 {fp[:16]}...)" if fp else "")]
    return "\n".join(lines)
