"""verify-run --report against its targets: a 3-load report under 1 MB, open in under 1 s, every
chart labelled. Measured in headless Debian chromium (Playwright), each open in a fresh page:
navigation start to the load event (and the wall time of the open), against an empty page
opened the same way (the browser's own floor, the baseline). Also the time to render the page.

    .venv/bin/python bench/bench_report.py --doc run.json [--compare earlier.json] [--opens 15]
    .venv/bin/python bench/bench_report.py            # a 3-load run of a tiny fixture bundle first

The report is written next to the results (bench/results/report.html) for a look.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import RESULTS, save, summary  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LOAD_EVENT = "() => performance.getEntriesByType('navigation')[0].loadEventEnd"
LABELS = """() => Array.from(document.querySelectorAll('figure.chart svg')).map(svg => {
  const shown = (sel) => Array.from(svg.querySelectorAll(sel)).filter(g => Array.from(
      g.querySelectorAll('text')).some(t => t.getBBox().width > 0)).length;
  return [svg.querySelectorAll('g[id^="axes_"]').length, shown('g[id*="-xlabel-"]'),
          shown('g[id*="-ylabel-"]')];
})"""


def fixture_run(work: Path) -> Path:
    """A 3-load verify-run (2 runs each, 128 tokens, depth auto) of a tiny fixture bundle."""
    bundle = work / "bundle"
    subprocess.run([sys.executable, str(Path(__file__).parents[1] / "tests/fixtures/build.py"),
                    "deepseek_v3", str(bundle)], check=True, capture_output=True)
    out = work / "run.json"
    with open(out, "w") as fh:
        subprocess.run([sys.executable, "-m", "mtpkit.cli", "verify-run", str(bundle), "--runs",
                        "2", "--max-tokens", "128", "--json"], stdout=fh, check=False)
    return out


def opens(paths: list[Path], n: int) -> dict[str, dict[str, list[float]]]:
    """Per page: n opens in fresh pages (one browser, fresh profile), the load event and the
    wall time in ms, and each chart's (axes, visible x labels, visible y labels)."""
    from playwright.sync_api import sync_playwright

    out: dict[str, dict] = {p.name: {"load_ms": [], "wall_ms": []} for p in paths}
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM,
                                                        headless=True, args=FLAGS)
        for i in range(n + 1):  # the first round warms the browser up and is not counted
            for path in paths:
                page = context.new_page()
                start = time.perf_counter()
                page.goto(path.as_uri(), wait_until="load")
                wall = 1000 * (time.perf_counter() - start)
                if i == 0:
                    out[path.name]["charts"] = page.evaluate(LABELS)
                else:
                    out[path.name]["load_ms"].append(page.evaluate(LOAD_EVENT))
                    out[path.name]["wall_ms"].append(wall)
                page.close()
        context.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, help="a verify-run --json document (default: run one)")
    parser.add_argument("--compare", type=Path, help="an earlier one to overlay")
    parser.add_argument("--opens", type=int, default=15)
    parser.add_argument("--renders", type=int, default=5)
    args = parser.parse_args()

    from mtpkit.verify.report import load_earlier, render

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        doc_path = args.doc or fixture_run(work)
        doc = json.loads(doc_path.read_text())  # as verify-run renders its own run
        earlier = load_earlier(args.compare) if args.compare else None
        name = args.compare.name if args.compare else None
        render(doc, earlier, name)  # import matplotlib and warm its caches once
        times = []
        for _ in range(args.renders):
            start = time.perf_counter()
            html = render(doc, earlier, name)
            times.append(time.perf_counter() - start)
        RESULTS.mkdir(exist_ok=True)
        report = RESULTS / "report.html"
        report.write_text(html, encoding="utf-8")
        empty = work / "empty.html"
        empty.write_text("<!DOCTYPE html><html><head><meta charset=utf-8><title>x</title></head>"
                         "<body><p>x</p></body></html>")
        measured = opens([report, empty], args.opens)
    page = measured[report.name]
    charts = page.pop("charts")
    labelled = [c for c in charts if c[0] >= 1 and c[1] >= 1 and c[2] == c[0]]
    result = {
        "doc": str(doc_path), "compare": str(args.compare) if args.compare else None,
        "loads": list(doc["speed"].get("loads") or {}), "bytes": len(html.encode()),
        "charts": len(charts), "charts_labelled": len(labelled), "chart_axes": charts,
        "render_s": summary(times),
        "open": {k: summary(v) for k, v in page.items()},
        "empty_page_open": {k: summary(v) for k, v in measured[empty.name].items()
                            if k != "charts"},
        "chromium": subprocess.run([CHROMIUM, "--version"], capture_output=True,
                                   text=True).stdout.strip(),
    }
    path = save("report", result)
    print(json.dumps({k: v for k, v in result.items() if k != "chart_axes"}, indent=1))
    print(f"saved {path}; the page: {report}", file=sys.stderr)


if __name__ == "__main__":
    main()
