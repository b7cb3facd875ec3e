"""`mtpkit tune`: this machine's measured cost curve for a bundle (decoder/costs.py), where it is
cached, and the depth `--depth auto` starts from at a few acceptance levels (decoder/policy.py).
Also the one-line summary `serve` prints at start-up."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpkit.decoder.costs import CONTEXT, CostCurve, cache_dir, cache_key, cached
from mtpkit.decoder.policy import DepthPolicy

if TYPE_CHECKING:
    from mtpkit.decoder.runner import Runner

ACCEPTANCE = (0.3, 0.5, 0.7, 0.9)  # a_1 levels the picks are shown at (a_i = a_1 ** i)


def _cache_file(key: dict[str, Any] | None) -> Path | None:
    """The cache file of `key`, named as decoder/costs.py names it (None: not cached)."""
    if not key:
        return None
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / f"{name}.json"


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


def report(runner: Runner, bundle: str, refresh: bool = False) -> dict[str, Any]:
    """The cost curve document `mtpkit tune --json` prints: CostCurve.to_dict() plus the
    bundle, whether it was measured now or read from the cache, the cache file and the picks."""
    key = cache_key(runner.root, runner.load_options) if runner.root is not None else None
    measured = refresh or key is None or cached(key) is None
    curve = runner.costs(refresh)
    path = _cache_file(curve.key)
    max_depth = runner.policy("auto")[0]
    lookup_depth = runner.policy("auto", "lookup")[0]
    return {"bundle": bundle, **curve.to_dict(), "context": CONTEXT, "measured": measured,
            "cache": str(path if path is not None and path.exists() else cache_dir()),
            "max_depth": max_depth, "picks": picks(curve, max_depth) if runner.head else [],
            "lookup_picks": picks(curve, lookup_depth, "lookup")}


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
    lines.append(f"  plain step {1000 * doc['plain']:.2f} ms (pipelined), head draft step "
                 + (f"{1000 * doc['draft']:.2f} ms" if doc["picks"] else "- (no MTP head)"))
    if doc["picks"]:
        lines.append(f"  --depth auto's first pick (a_i = a_1^i, depth <= {doc['max_depth']}; "
                     "then it follows the acceptance it sees):")
        lines += _pick_lines(doc["picks"])
    else:
        lines.append("  no MTP head: --depth auto drafts from the context (lookup) where a match "
                     "pays, and decodes plainly elsewhere")
    lines.append("  a context (lookup) match as long as the depth allows, drafted for free:")
    lines += _pick_lines(doc["lookup_picks"])
    return "\n".join(lines)


def summary(runner: Runner, draft: str | None = None) -> str:
    """One line for `serve --depth auto` at start-up (measures the curve once, or reads it)."""
    curve = runner.costs()
    ratios = curve.ratios()
    shown = " ".join(f"{t}:{ratios[t - 1]:.2f}" for t in (2, 4, 8, 16) if t <= len(ratios))
    if runner.draft_source("auto", draft) == "lookup":
        why = "no MTP head, " if runner.head is None else ""
        return (f"depth auto: {why}context lookup drafts chosen per round from this machine's "
                f"costs (verify c(T)/c(1) {shown}; c(1) {1000 * curve.verify[0]:.2f} ms, plain "
                f"step {1000 * curve.plain:.2f} ms; mtpkit tune shows more)")
    starts = ", ".join(f"a_1 {100 * p['acceptance']:.0f}% -> "
                       + (f"d{p['depth']}" if p["depth"] else "plain")
                       for p in picks(curve, runner.policy("auto")[0]))
    return (f"depth auto: chosen per round from this machine's costs (verify c(T)/c(1) {shown}; "
            f"c(1) {1000 * curve.verify[0]:.2f} ms, plain step {1000 * curve.plain:.2f} ms, head "
            f"draft {1000 * curve.draft:.2f} ms; starts at {starts}; mtpkit tune shows more)")

