"""`verify-run --report PATH`: the run as one self-contained HTML page (inline SVG charts, inline
CSS, no script, and a Content-Security-Policy that forbids any fetch), for whoever decides: the
three numbers first (acceptance P50, decode P95, peak memory), then every check's verdict, the
charts, the per-load table and the record. `--compare EARLIER.json` overlays an earlier run's
numbers and lists what changed between the two records ("fast last week, slow today")."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import jsonschema

from mtpkit.convert.writer import replace_files
from mtpkit.loaders.findings import UserError
from mtpkit.schemas import validate

MAX_COMPARE_BYTES = 64 << 20  # a verify-run document is kilobytes; refuse to parse a giant


def _fmt(value: Any, spec: str = ".1f", scale: float = 1.0, unit: str = "") -> str:
    """A number for the page; a missing one (None, or a field an older run lacks): "-"."""
    if value is None or isinstance(value, jinja2.Undefined):
        return "-"
    return format(scale * value, spec) + unit


def _template() -> jinja2.Template:
    source = resources.files("mtpkit.verify").joinpath("report.html.j2").read_text("utf-8")
    env = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True)
    env.filters |= {"num": _fmt, "pct": lambda v: _fmt(v, ".1f", 100, "%"),
                    "ms": lambda v: _fmt(v, ".0f", 1000, " ms"),
                    "mib": lambda v: _fmt(v or None, ",.0f", 2**-20, " MiB"),
                    "plural": lambda n, word: f"{n} {word}" + ("" if n == 1 else "s")}
    return env.from_string(source)


def load_earlier(path: Path) -> dict[str, Any]:
    """An earlier `verify-run --json` document to compare with (read before the run, so a bad
    file costs nothing)."""
    hint = "pass a file written by mtpkit verify-run --json"
    try:
        if path.stat().st_size > MAX_COMPARE_BYTES:
            raise UserError("compare.invalid", f"{path} is over {MAX_COMPARE_BYTES >> 20} MiB", hint)
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError("compare.unreadable", f"cannot read {path}: {exc.strerror}", hint) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError("compare.invalid", f"{path} is not JSON ({exc})", hint) from None
    try:
        validate(doc, "verify_run")
    except jsonschema.ValidationError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "top level"
        raise UserError("compare.invalid", f"{path} is not a verify-run report ({where}: "
                        f"{exc.message[:160]})", hint) from None
    return doc


def check_writable(path: Path) -> None:
    """Refuse a report path that cannot be written, before the (long) run."""
    if path.is_dir():
        raise UserError("report.unwritable", f"{path} is a directory", "name a file, e.g. report.html")
    if not path.parent.is_dir():
        raise UserError("report.unwritable", f"{path.parent} does not exist",
                        "create the folder first, or name a file in an existing one")


def _loads(doc: dict[str, Any]) -> dict[str, Any]:
    return (doc.get("speed") or {}).get("loads") or {}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fast_mode(row: dict[str, Any]) -> dict[str, Any]:
    """The mode whose speed the headline shows: MTP when measured against plain, else as served."""
    return row.get("mtp") or row.get("as served") or row.get("plain") or {}


def headline(doc: dict[str, Any]) -> dict[str, float | None]:
    """The three numbers (and the speedup): depth-1 acceptance P50 over loads, decode tok/s
    P50/P95 (medians over loads of each load's run percentiles), peak memory over everything."""
    rows = _loads(doc).values()
    modes = [m for r in rows for m in (r.get("plain"), r.get("mtp"), r.get("as served")) if m]
    return {
        "acceptance_p50": _median([a[0] for r in rows
                                   if (a := (r.get("mtp") or {}).get("acceptance_by_depth"))]),
        "decode_p50": _median([t["p50"] for r in rows if (t := _fast_mode(r).get("decode_tps"))]),
        "decode_p95": _median([t["p95"] for r in rows if (t := _fast_mode(r).get("decode_tps"))]),
        "speedup": _median([s for r in rows if (s := r.get("speedup"))]),
        "peak_memory_bytes": max((m.get("peak_memory_bytes") or 0 for m in modes), default=0) or None,
    }


def _flat(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flat(f"{prefix}.{key}" if prefix else str(key), inner)
    else:
        yield prefix, value


def changes(doc: dict[str, Any], earlier: dict[str, Any]) -> list[dict[str, Any]]:
    """What differs between the two runs' records and options: versions, weights, machine,
    target, depth, draft, runs, token ceilings."""
    def facts(d: dict[str, Any]) -> dict[str, Any]:
        speed = d.get("speed") or {}
        record = d.get("record") or {}
        out = dict(_flat("machine", record.get("machine") or {}))
        out["weights sha256"] = (record.get("fingerprint") or {}).get("sha256")
        out["target"] = f"{d['target']['kind']} {d['target']['name']}"
        out |= {f"option {k}": speed.get(k) for k in ("depth", "draft", "runs", "max_tokens", "drop")}
        return out

    now, then = facts(doc), facts(earlier)
    return [{"what": k, "earlier": then.get(k), "now": now.get(k),
             "changed": then.get(k) != now.get(k)} for k in sorted(now.keys() | then.keys())]


def _chosen(rows: dict[str, Any], depth: Any) -> dict[int, int]:
    """Rounds per drafted depth over all loads (a forced depth: that depth)."""
    total: dict[int, int] = {}
    for row in rows.values():
        for d, n in ((row.get("mtp") or {}).get("depths") or {}).items():
            total[int(d)] = total.get(int(d), 0) + n
    if not total and isinstance(depth, int) and depth > 0:
        total[depth] = sum(len(r["t"]) for row in rows.values()
                           for r in ((row.get("mtp") or {}).get("rounds") or []))
    return total


def _ttft_title(ttft: dict[str, Any] | None) -> str:
    """The TTFT chart's caption: how TTFT was measured (an older run's document does not say)."""
    if not ttft:
        return "TTFT and peak memory"
    return f"TTFT ({ttft['state']}: {ttft['how']}) and peak memory"


def render(doc: dict[str, Any], earlier: dict[str, Any] | None = None,
           earlier_name: str | None = None) -> str:
    from mtpkit.verify import charts  # matplotlib: imported only when a report is drawn

    rows = _loads(doc)
    before = _loads(earlier) if earlier else None
    speed = doc.get("speed") or {}
    costs = speed.get("costs")
    figures = [
        ("Decode speed per load", charts.decode_chart(rows, before)),
        ("Acceptance per draft position", charts.acceptance_chart(rows, before)),
        *((f"Over the rounds: {name}", charts.rounds_chart(name, row))
          for name, row in rows.items()),
        ("Verify cost curve", charts.costs_chart(costs, _chosen(rows, speed.get("depth")),
                                                 ((earlier or {}).get("speed") or {}).get("costs"))),
        (_ttft_title(speed.get("ttft")),
         charts.ttft_memory_chart(rows, before, (speed.get("ttft") or {}).get("state"))),
    ]
    return _template().render(
        doc=doc, rows=rows, speed=speed, head=headline(doc),
        earlier_head=headline(earlier) if earlier else None, earlier_name=earlier_name,
        changes=changes(doc, earlier) if earlier else None, figures=figures,
        accepted={name: charts.positions(row.get("mtp") or {}) for name, row in rows.items()},
        evidence={c["name"]: json.dumps(c["evidence"], indent=1, sort_keys=True)
                  for c in doc["checks"]},
        record=doc.get("record") or {})


def write(doc: dict[str, Any], path: Path, earlier: dict[str, Any] | None = None,
          earlier_name: str | None = None) -> None:
    """Render and replace `path` atomically (a half-written report never exists)."""
    html = render(doc, earlier, earlier_name)
    try:
        replace_files({path: html})
    except OSError as exc:
        raise UserError("report.unwritable", f"cannot write {path}: {exc.strerror}",
                        "choose a writable --report path") from None
