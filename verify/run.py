"""`mtpkit verify-run`: end-to-end checks of a local bundle or an OpenAI-compatible endpoint,
each passing or failing with its evidence, and speed measured the honest way (warm-up, a nonce
in every prompt, real-content loads with fixed ceilings, baseline first, steady decode after the
first 64 tokens, P50/P95 over runs). With depth "auto" a target that takes it (mtpkit serve, a
local bundle) chooses each round's depth itself and reports its choices and predicted speedup;
for a target that takes only numbers, a depth sweep picks this machine's best depth. A draft
source ("head", "lookup", "both", "model") goes with every speculative request; each load's row records
the source the target used and its telemetry per source. Before anything runs it says what it
will do and about how long that takes, as a range; each step's line gives the time spent and
the range left, re-estimated from the seconds per token the finished requests took; `stop` (the
first Ctrl-C) ends it after the request in flight, with what was measured so far marked
incomplete. TTFT is measured like for like: every figure from a prompt behind a fresh nonce
(cold), and `speed.ttft` says so."""

from __future__ import annotations

import math
import statistics
import time
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
    usage_doubt,
)
from mtpkit.verify.endpoint import TURN_TOKENS, EndpointError
from mtpkit.verify.loads import DEFAULT_LOADS, Load, real_loads

QUESTION = ("In two or three sentences, explain what a hash table is and why looking up a key "
            "in one is usually fast.")
ANSWER_TOKENS = 160
WARMUP_TOKENS = 16
SWEEP = (1, 2, 3, 4)
RUNS, MAX_TOKENS = 3, 256  # the defaults
CPU_RUNS, CPU_MAX_TOKENS = 1, 128  # on a CPU backend: minutes, not half an hour (64 steady tokens)
TEMPLATE_TOKENS = 16  # a chat template's own tokens around a message, roughly
TTFT_TOKENS = 4  # an endpoint's cold MTP TTFT, from a short request of its own per run
# Before any answer, the cost curve's figure as a range: it prices prefill and plain steps
# only (no HTTP, rendering or MTP rounds). After answers: the measured seconds per priced
# second, a factor of 1 + their spread either way, and at least 1 + SPREAD / sqrt(answers).
CURVE_RANGE = (0.75, 1.5)
SPREAD = 0.5
SERVING_REQUESTS = 6  # serving_checks' turns: 3 over the prefix cache, 3 on the Messages API


class Target(Protocol):
    def ask(self, messages: list[dict] | None = None, prompt: str | None = None, *,
            max_tokens: int, stream: bool, depth: int | str | None = None,
            thinking: bool | None = None, draft: str | None = None) -> Answer: ...


@dataclass
class VerifyOptions:
    depth: str | int = "auto"
    loads: tuple[str, ...] = DEFAULT_LOADS
    runs: int = RUNS
    max_tokens: int = MAX_TOKENS
    drop: int = 64
    min_accept: float | None = None
    min_speedup: float | None = None
    draft: str | None = None  # "head", "lookup", "both" or "model" (None: the target's default)
    cpu_defaults: bool = False  # runs / max_tokens defaulted to the CPU backend's

    @classmethod
    def sized(cls, runs: int | None, max_tokens: int | None, cpu: bool,
              **kw: Any) -> VerifyOptions:
        """Options with runs / max_tokens as given, else the defaults: on a CPU backend the
        CPU's, so a default run takes minutes there."""
        cpu = cpu and (runs is None or max_tokens is None)
        return cls(runs=runs or (CPU_RUNS if cpu else RUNS),
                   max_tokens=max_tokens or (CPU_MAX_TOKENS if cpu else MAX_TOKENS),
                   cpu_defaults=cpu, **kw)

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
    count: Callable[[str], int] | None = None  # the target's tokenizer (None: a rough count)

    def tokens(self, text: str) -> int:
        """Prompt tokens of `text`, for the time estimate: the tokenizer's, else ~3.5 chars
        each, plus a chat template's own few."""
        return (self.count(text) if self.count else round(len(text) / 3.5)) + TEMPLATE_TOKENS


@dataclass
class Report:
    target: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    speed: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    interrupted: dict[str, int] | None = None  # {"runs_measured", "runs_planned"} after Ctrl-C

    @property
    def passed(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        doc = {"target": self.target, "passed": self.passed,
               "checks": [c.to_dict() for c in self.checks], "speed": self.speed,
               "record": self.record}
        if self.interrupted is not None:
            doc |= {"incomplete": True, "interrupted": self.interrupted}
        return doc


class Stopped(Exception):
    """The first Ctrl-C: end after the request in flight, keeping what was measured."""


def duration(seconds: float) -> str:
    """45 s, 3 min 10 s, 1 h 05 min: how long, in words a reader takes in at a glance."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")




@dataclass(frozen=True)
class Rates:
    """What a request costs here, by the plan's reckoning: seconds per prompt token (prefill)
    and per generated token (decode). From the cost curve where known (a verify pass over 16
    rows, per row, and the plain step), else a guess whose ratio alone matters: the clock
    scales the plan by the seconds it sees."""

    prompt_s: float = 0.1
    step_s: float = 1.0
    measured: bool = False

    @classmethod
    def of(cls, costs: Mapping[str, Any] | None) -> Rates:
        if not costs or not costs.get("verify") or not costs.get("plain"):
            return cls()
        return cls(costs["verify"][-1] / len(costs["verify"]), costs["plain"], True)

    def seconds(self, requests: list[tuple[int, int]]) -> float:
        """The cost of (prompt tokens, max tokens) requests."""
        return sum(prompt * self.prompt_s + tokens * self.step_s for prompt, tokens in requests)


def per_load(options: VerifyOptions, facts: Facts, load: Load,
             modes: int) -> list[tuple[int, int]]:
    """(prompt tokens, max tokens) of one load's requests: a warm-up and the runs per mode,
    and an endpoint's cold TTFT request per run when both modes share the run's prompt."""
    prompt = facts.tokens(load.text)
    out = [(prompt, WARMUP_TOKENS)] * modes + [(prompt, options.max_tokens)] * (options.runs * modes)
    if modes == 2 and facts.kind == "endpoint":
        out += [(prompt, TTFT_TOKENS)] * options.runs
    return out


def planned_requests(options: VerifyOptions, facts: Facts, loads: Mapping[str, Load],
                     modes: int = 2) -> list[tuple[int, int]]:
    """(prompt tokens, max tokens) of every request the run makes: the answer checks
    (thinking on asks 4x), the two probes, each load's requests, and an endpoint's serving
    checks after them."""
    answer = min(ANSWER_TOKENS, options.max_tokens)
    question, hi = facts.tokens(QUESTION), facts.tokens("Hi")
    out = [(question, answer), (question, answer), (hi, 4), (hi, 4)]
    if facts.thinking is not False:
        out.append((question, 4 * answer))
    for load in loads.values():
        out += per_load(options, facts, load, modes)
    if facts.kind == "endpoint":
        out += [(facts.tokens(real_loads(["memo"])["memo"].text), TURN_TOKENS)] * SERVING_REQUESTS
    return out


def _text(args: tuple[Any, ...], kw: dict[str, Any]) -> str:
    messages = args[0] if args else kw.get("messages")
    if messages:
        return "".join(str(m.get("content", "")) for m in messages)
    return str(kw.get("prompt") or "")


def span(low: float, high: float) -> str:
    """A range of seconds in words ("2 min 10 s to 3 min 40 s"; one figure when both read
    the same)."""
    lo, hi = duration(low), duration(high)
    return f"about {lo}" if lo == hi else f"{lo} to {hi}"


class Clock:
    """The target, metered: the plan's requests, what each should cost (Rates) and the seconds
    each took, so every progress line says the time spent and the range left. Before the
    first answer the range is the cost curve's (when known: CURVE_RANGE); after it, the plan's
    rest at the seconds per priced second the answers took (priced at the tokens they
    generated), as wide as those ratios spread and narrowing as answers come; the low end also
    assumes answers keep stopping as early as they have. `stop` is asked before each
    request (the first Ctrl-C: raise Stopped). Every answer's reported usage is audited
    (`usage_doubt`): the first lie is kept for the counting check."""

    def __init__(self, target: Target, facts: Facts, planned: list[tuple[int, int]],
                 rates: Rates, stop: Callable[[], bool]) -> None:
        self.target, self.facts, self.rates, self.stop = target, facts, rates, stop
        self.planned_s = rates.seconds(planned)
        self.done_s = 0.0  # the plan's seconds for the requests made
        self.samples: list[tuple[float, float, float]] = []  # priced as generated, as asked, taken
        self.requests = 0
        self.doubt: tuple[int, str] | None = None  # (request number, why its usage is wrong)
        self.start = time.perf_counter()

    def plan(self, requests: list[tuple[int, int]], sign: int = 1) -> None:
        """Add (or, sign -1, drop) requests from the plan."""
        self.planned_s += sign * self.rates.seconds(requests)

    def ask(self, *args: Any, max_tokens: int, **kw: Any) -> Answer:
        if self.stop():
            raise Stopped
        self.requests += 1
        prompt = self.facts.tokens(_text(args, kw))
        asked = self.rates.seconds([(prompt, max_tokens)])
        start = time.perf_counter()
        try:
            answer = self.target.ask(*args, max_tokens=max_tokens, **kw)
        finally:
            self.done_s += asked
        taken = time.perf_counter() - start
        tokens = answer.tokens if answer.tokens is not None and answer.tokens <= max_tokens \
            else max_tokens
        self.samples.append((self.rates.seconds([(prompt, tokens)]), asked, taken))
        if not self.facts.exact_ids and self.doubt is None:
            doubt = usage_doubt(answer, max_tokens)
            self.doubt = (self.requests, doubt) if doubt else None
        return answer

    def left_s(self) -> tuple[float, float] | None:
        """The range of seconds the rest of the plan should take (None: nothing to go by)."""
        rest = max(self.planned_s - self.done_s, 0.0)
        priced = sum(p for p, _, _ in self.samples)
        if not priced:
            return (rest * CURVE_RANGE[0], rest * CURVE_RANGE[1]) if self.rates.measured else None
        point = sum(t for _, _, t in self.samples) / priced
        if not point:
            return 0.0, 0.0
        # the answers' own spread (their ratios, each weighted by its priced seconds), and no
        # narrower than SPREAD / sqrt(answers); a ratio's range: a factor either way
        spread = math.sqrt(sum(p * (t / p - point) ** 2 for p, _, t in self.samples if p)
                           / priced) / point
        factor = 1 + max(spread, SPREAD / math.sqrt(len(self.samples)))
        early = priced / sum(a for _, a, _ in self.samples)  # share of the asked tokens made
        return rest * point / factor * early, rest * point * factor

    def note(self, what: str) -> str:
        left = self.left_s()
        return (f"{what} ({duration(time.perf_counter() - self.start)} in"
                + (f", {span(*left)} left)" if left is not None else ")"))


def plan_text(options: VerifyOptions, facts: Facts, rates: Rates) -> str:
    """What verify-run is about to do and about how long it takes, said before it starts."""
    loads = real_loads(options.loads)
    modes = "1 mode (as served)" if options.depth == 0 else "2 modes (plain, then MTP)"
    requests = planned_requests(options, facts, loads, 1 if options.depth == 0 else 2)
    serving = ", the serving checks after them" if facts.kind == "endpoint" else ""
    what = (f"plan: {plural(len(loads), 'load')} ({', '.join(loads)}) x "
            f"{plural(options.runs, 'run')} x {modes} x {options.max_tokens} tokens, after the "
            f"answer checks and a warm-up per load and mode{serving}: {len(requests)} requests")
    if options.cpu_defaults:
        what += (f"; defaults for a CPU backend ({plural(CPU_RUNS, 'run')} of {CPU_MAX_TOKENS} "
                 f"tokens, not {RUNS} of {MAX_TOKENS}: --runs and --max-tokens change them)")
    if rates.measured:
        total = rates.seconds(requests)
        return (what + f"; {span(total * CURVE_RANGE[0], total * CURVE_RANGE[1])} by this "
                f"machine's cost curve (plain step {1000 * rates.step_s:.1f} ms, prefill "
                f"{1000 * rates.prompt_s:.2f} ms a token; re-estimated as answers come)")
    return what + "; the time left follows the first answer"


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
    except EndpointError as exc:
        if exc.status is None:  # not a refusal: the endpoint misbehaved, which is reported
            raise
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


def _speed_row(answers: dict[str, list[Answer]], drop: int,
               first: dict[str, list[Answer]] | None = None,
               trusted: Callable[[Answer], bool] = lambda a: True) -> dict[str, Any]:
    """One load's figures per mode; first: where a mode's TTFT comes from answers of its own
    (an endpoint's cold requests), not its runs; trusted: whether an answer's token count can
    be true (no tok/s from one that cannot: the counting check fails on it)."""
    row: dict[str, Any] = {}
    for mode, runs in answers.items():
        tps = [t for a in runs if trusted(a) and (t := a.decode_tps(drop)) is not None]
        accept = [a.mtp["acceptance_by_depth"] for a in runs
                  if a.mtp and a.mtp.get("acceptance_by_depth")]
        predicted = [p for a in runs if a.mtp and (p := a.mtp.get("predicted_speedup"))]
        timed = (first or {}).get(mode) or runs
        row[mode] = {
            "decode_tps": percentiles(tps),
            "ttft_s": percentiles([a.ttft_s for a in timed if a.ttft_s is not None]),
            "prefill_tps": percentiles([a.prefill_tps for a in timed if a.prefill_tps]),
            "ttft_cached": max((a.cached_tokens / a.prompt_tokens for a in timed
                                if a.cached_tokens is not None and a.prompt_tokens),
                               default=None),
            "tokens": [a.tokens if trusted(a) else None for a in runs],
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


def _pick_depth(target: Clock, options: VerifyOptions, loads: dict[str, Load],
                progress: Callable[[str], None]) -> tuple[int, dict[str, Any]]:
    """Sweep depths on the code load (one run each, baseline first): the fastest depth, and
    the sweep (whose "recommended" is 0 when no depth beats plain decoding here)."""
    if options.depth != "auto":
        return int(options.depth), {}
    load = loads.get("code") or next(iter(loads.values()))
    prompt = target.facts.tokens(load.text)
    target.plan([(prompt, WARMUP_TOKENS), (prompt, options.max_tokens)] * (1 + len(SWEEP)))

    def timed(depth: int, tokens: int = options.max_tokens) -> Answer:
        return _ask(target, load.fresh(), load.chat, max_tokens=tokens, stream=True, depth=depth,
                    **options.drafting(depth))

    for depth in (0, *SWEEP):
        timed(depth, WARMUP_TOKENS)
    base = timed(0)
    sweep = {}
    for depth in SWEEP:
        progress(target.note(f"depth sweep: {depth}"))
        answer = timed(depth)
        plain, mtp = base.decode_tps(options.drop), answer.decode_tps(options.drop)
        sweep[depth] = {"decode_tps": mtp, "speedup": mtp / plain if plain and mtp else None,
                        "acceptance_by_depth": (answer.mtp or {}).get("acceptance_by_depth")}
    best = max(sweep, key=lambda d: sweep[d]["speedup"] or 0.0)
    recommended = best if (sweep[best]["speedup"] or 0.0) > 1.0 else 0
    return best, {"load": load.name, "plain_decode_tps": base.decode_tps(options.drop),
                  "depths": sweep, "fastest": best, "recommended": recommended}


def run(target: Target, facts: Facts, options: VerifyOptions,
        progress: Callable[[str], None] = lambda s: None, stop: Callable[[], bool] = lambda: False,
        costs: Mapping[str, Any] | None = None) -> Report:
    """The checks and the speed measurement. progress: told the plan first, then each step
    with the time spent and left; stop: asked between requests (true: end now, marked
    incomplete); costs: this machine's cost curve, for the estimate before any answer."""
    report = Report({"kind": facts.kind, "name": facts.name})
    checks = report.checks
    rates = Rates.of(costs)
    progress(plan_text(options, facts, rates))
    clock = Clock(target, facts, planned_requests(options, facts, real_loads(options.loads),
                                           1 if options.depth == 0 else 2), rates, stop)
    done = [0]  # measured runs (all modes of one prompt), for the incomplete marker
    try:
        _functional(clock, facts, options, checks, progress)
        _speed(clock, facts, options, report, progress, done)
    except EndpointError as exc:
        checks.append(Check("endpoint", FAIL, str(exc), exc.evidence))
    except Stopped:
        planned = options.runs * len(real_loads(options.loads))
        report.interrupted = {"runs_measured": done[0], "runs_planned": planned}
        checks.append(Check("incomplete", FAIL, f"interrupted after {done[0]} of "
                            f"{plural(planned, 'run')}: the checks after it did not run",
                            dict(report.interrupted)))
    _audit_usage(checks, clock)
    return report


def _audit_usage(checks: list[Check], clock: Clock) -> None:
    """Usage that lied on any request (not only the counting check's pair) fails counting:
    inflated counts would inflate every tok/s figure."""
    if clock.doubt is None:
        return
    number, doubt = clock.doubt
    failed = Check("counting", FAIL, f"request {number} of the run: {doubt}: the token count "
                   "is wrong", {"request": number, "source": "usage"})
    at = next((i for i, c in enumerate(checks) if c.name == "counting"), None)
    if at is None:
        checks.append(failed)
    elif checks[at].status != FAIL:
        failed.evidence |= checks[at].evidence
        checks[at] = failed


def _functional(target: Clock, facts: Facts, options: VerifyOptions, checks: list[Check],
                progress: Callable[[str], None]) -> None:
    progress(target.note("answer"))
    if facts.template is not None:
        checks.append(facts.template)
        if facts.template.status == FAIL:
            return
    tokens = min(ANSWER_TOKENS, options.max_tokens)
    try:
        whole = _ask(target, QUESTION, True, max_tokens=tokens, stream=False)
    except EndpointError as exc:
        if exc.status is None:  # not refused: the endpoint misbehaved (the endpoint check)
            raise
        checks.append(Check("template", FAIL, f"a chat request failed: {exc}"))
        return
    if facts.template is None:
        checks.append(Check("template", PASS, "the endpoint renders chat requests"))
    checks.append(answer_check("answer", whole, "plain chat answer"))
    if facts.thinking is False:
        checks.append(Check("answer_thinking", INFO, "the template has no thinking switch"))
    else:
        progress(target.note("answer with thinking on"))
        thinking = _ask(target, QUESTION, True, max_tokens=4 * tokens, stream=False,
                        thinking=True)
        checks.append(answer_check("answer_thinking", thinking, "with thinking on"))
    progress(target.note("streaming"))
    streamed = _ask(target, QUESTION, True, max_tokens=tokens, stream=True)
    checks.append(streaming_check(whole, streamed))
    checks.append(counting_check(whole, streamed, "ids" if facts.exact_ids else "usage",
                                 tokens))


def _speed(target: Clock, facts: Facts, options: VerifyOptions, report: Report,
           progress: Callable[[str], None], done: list[int]) -> None:
    """Warm-up, then runs x modes per load, baseline first. Stopped (Ctrl-C) between requests:
    the loads measured so far are recorded, and the checks over them made, before it goes on
    up to run()."""
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
    modes = {"plain": 0, "mtp": depth} if control and depth else {"as served": None}
    if options.depth != 0 and len(modes) == 1:  # the plan counted two modes
        for load in loads.values():
            target.plan(per_load(options, facts, load, 2), -1)
            target.plan(per_load(options, facts, load, 1))
    # a caching endpoint answers the MTP run warm (it repeats the plain run's prompt, for the
    # exactness check): its TTFT comes from a short request behind a nonce of its own
    # (verify-run's in-process service keeps no prefix cache)
    cold_probe = len(modes) == 2 and facts.kind == "endpoint"

    def trusted(answer: Answer) -> bool:
        return facts.exact_ids or usage_doubt(answer, options.max_tokens) is None

    rows, exact = {}, []
    planned = options.runs * len(loads)

    def record() -> None:
        report.speed = {"depth": depth, "draft": options.draft, "mtp_control": control,
                        "sweep": sweep, "loads": rows, "runs": options.runs,
                        "max_tokens": options.max_tokens, "drop": options.drop,
                        "ttft": _ttft_basis(rows, cold_probe),
                        **({"defaults": "cpu"} if options.cpu_defaults else {})}
        if rows:
            checks.append(_exactness(exact, facts, depth))
            checks.extend(_speed_checks(rows, options, control, depth))

    try:
        for name, load in loads.items():
            progress(target.note(f"{name} warm-up"))
            for d in modes.values():  # warm-up, each mode
                _ask(target, load.fresh(), load.chat, max_tokens=WARMUP_TOKENS, stream=True,
                     depth=d, **options.drafting(d))
            answers: dict[str, list[Answer]] = {m: [] for m in modes}
            first: dict[str, list[Answer]] = {"mtp": []} if cold_probe else {}
            try:
                for run in range(options.runs):
                    progress(target.note(f"{name} run {run + 1}/{options.runs} "
                                         f"[{done[0] + 1} of {planned}]"))
                    prompt = load.fresh()
                    pair = {mode: _ask(target, prompt, load.chat, max_tokens=options.max_tokens,
                                       stream=True, depth=d, **options.drafting(d))
                            for mode, d in modes.items()}  # baseline first, same prompt
                    for mode, answer in pair.items():
                        answers[mode].append(answer)
                    if cold_probe:
                        d = modes["mtp"]
                        first["mtp"].append(_ask(target, load.fresh(), load.chat,
                                                 max_tokens=TTFT_TOKENS, stream=True, depth=d,
                                                 **options.drafting(d)))
                    done[0] += 1
                    if len(modes) == 2:
                        exact.append(_same(pair["plain"], pair["mtp"]))
            finally:
                if any(answers.values()):
                    rows[name] = _speed_row(answers, options.drop, first, trusted)
    except Stopped:
        record()  # what was measured so far, and the checks over it
        raise
    record()


def _ttft_basis(rows: dict[str, dict], cold_probe: bool) -> dict[str, Any]:
    """How TTFT was measured, for the report: cold in every mode (each figure from a prompt
    behind a fresh nonce), unless the endpoint says a TTFT request read most of its prompt from
    a cache anyway."""
    how = ("each mode's TTFT from prompts behind nonces of their own (the MTP runs repeat the "
           "plain runs' prompts, so MTP's TTFT comes from a short request per run)"
           if cold_probe else "every prompt behind a fresh nonce")
    warm = [f"{name} {mode}" for name, row in rows.items() for mode, m in row.items()
            if isinstance(m, dict) and (m.get("ttft_cached") or 0) >= 0.5]
    if warm:
        return {"state": "mixed", "how": how + "; yet the endpoint reports most of a prompt "
                "read from its cache for " + ", ".join(warm)}
    return {"state": "cold", "how": how}


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
    accept = statistics.median(accepts) if accepts else None  # as the page's headline
    evidence = {"depth1_by_load": {k: (r.get("mtp", {}).get("acceptance_by_depth") or [None])[0]
                                   for k, r in rows.items()}}
    if accept is None:
        status = FAIL if options.min_accept is not None else INFO
        if any(r.get("mtp", {}).get("depths") for r in rows.values()):  # auto: plain only
            said = "no speculative round ran (auto decoded plainly: rounds priced slower here)"
        else:
            said = "acceptance not reported by the target"
        out.append(Check("acceptance", status, said, evidence))
    else:
        floor = options.min_accept
        status = FAIL if floor is not None and accept < floor else PASS
        floor_text = f", floor {100 * floor:.0f}%" if floor is not None else ""
        out.append(Check("acceptance", status, f"depth-1 acceptance {100 * accept:.1f}% "
                         f"(median over loads){floor_text}", evidence))
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
