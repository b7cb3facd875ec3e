"""verify-run --report: one self-contained HTML page whose charts are labelled and drawn from the
run's own numbers, written even when checks fail; --compare overlays an earlier run; bad inputs
are one-line errors before the run. (The page in a real browser: tests/test_page_browser.py.)"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from fixtures.fake_servers import running
from mtpkit.cli import main
from mtpkit.schemas import validate
from mtpkit.verify import report as report_mod
from mtpkit.verify.charts import per_round, positions

LOADS = "code,memo,translation"
# every chart's axis labels, in the order the page draws them
LABELS = [("load", "decode tok/s (bar P50, tick P95)"), ("draft position", "drafts kept (%)"),
          *[("round of the generation", "decode tok/s")] * 3,
          ("verify rows T", "c(T) / c(1)"), ("load", "TTFT ms (bar P50, tick P95)")]


def _svgs(html: str) -> list[str]:
    return re.findall(r"<svg\b.*?</svg>", html, re.S)


def _texts(svg: str) -> str:
    return " ".join(re.findall(r"<text\b[^>]*>([^<]*)</text>", svg))


@pytest.fixture(scope="module")
def local_run(built, tmp_path_factory) -> tuple[dict, str, Path]:
    """A 3-load verify-run of a tiny bundle at a forced depth (every step a verified round)."""
    out = tmp_path_factory.mktemp("report")
    page = out / "report.html"
    result = CliRunner().invoke(main, ["verify-run", str(built("mimo")), "--loads", LOADS,
                                       "--runs", "2", "--max-tokens", "24", "--depth", "2",
                                       "--json", "--report", str(page)])
    assert result.exit_code in (0, 1), result.output
    doc = json.loads(result.stdout)
    return doc, page.read_text(encoding="utf-8"), out


def test_rounds_are_recorded_and_agree_with_the_counters(local_run) -> None:
    doc, _, _ = local_run
    validate(doc, "verify_run")
    for name, row in doc["speed"]["loads"].items():
        runs = row["mtp"]["rounds"]
        assert len(runs) == 2 and row["plain"]["rounds"] is None, name
        sources = row["mtp"]["sources"]
        # the timeline and the per-source counters count the same rounds and kept drafts
        assert sum(len(r["t"]) for r in runs) == sum(s["rounds"] for s in sources.values())
        assert sum(sum(r["kept"]) for r in runs) == sum(sum(s["accepted"]) for s in sources.values())
        for r in runs:
            # depth 2 throughout; the last round drafts only what the token ceiling leaves
            assert set(r["depth"][:-1]) == {2} and r["depth"][-1] in (1, 2)
            assert all(0 <= k <= d for k, d in zip(r["kept"], r["depth"], strict=True))
            assert r["t"] == sorted(r["t"]) and r["t"][0] == 0.0
            steps = [b - a for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)]
            assert steps == [k + 1 for k in r["kept"][1:]], "each round commits kept + 1 tokens"
            assert all(v > 0 for v in per_round(r)["tps"])


def test_report_is_self_contained_small_and_every_chart_labelled(local_run) -> None:
    doc, html, _ = local_run
    assert len(html.encode()) < 1 << 20
    assert "<script" not in html and "<link" not in html and "<img" not in html
    assert "default-src 'none'" in html  # the browser itself refuses any fetch
    # no reference leaves the file (SVG namespaces are names, not fetches)
    refs = re.findall(r'(?:href|src)="([^"]*)"', html)
    assert all(r.startswith("#") for r in refs), refs
    svgs = _svgs(html)
    assert len(svgs) == len(LABELS)
    for svg, (x, y) in zip(svgs, LABELS, strict=True):
        text = _texts(svg)
        assert x in text and y in text, (x, y, text[:300])
        axes = len(re.findall(r'<g id="axes_\d+"', svg))
        assert axes and len(re.findall(r'<g id="[\w-]+-ylabel-\d+"', svg)) == axes
        assert re.search(r'<g id="[\w-]+-xlabel-\d+"', svg)
    # the numbers on the page are the run's
    verdict = "PASS" if doc["passed"] else "FAIL"
    assert f'id="verdict">{verdict}<' in html
    for check in doc["checks"]:
        assert f"<td>{check['name']}</td>" in html
    code = doc["speed"]["loads"]["code"]["mtp"]["decode_tps"]
    assert f">{code['p50']:.1f}<" in html and f">{code['p95']:.1f}<" in html
    assert doc["record"]["fingerprint"]["sha256"] in html
    assert "Load memo: acceptance and speed over the rounds" in _texts(svgs[3])


def test_cost_curve_is_recorded_when_measured_or_cached_and_drawn_with_the_depths(
        built, tmp_path: Path, monkeypatch) -> None:
    from mtpkit.verify.charts import costs_chart
    from mtpkit.verify.local import open_local

    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    target, _, _ = open_local(str(built("mimo")))
    assert target.costs(2) is None, "a forced depth never measures a curve for a report"
    measured = target.costs("auto")
    assert len(measured["verify"]) == 16 and measured["ratios"][0] == 1.0 and measured["measured"]
    cached = target.costs(2)  # now the cache holds it
    assert cached["verify"] == measured["verify"] and not cached["measured"]
    svg = costs_chart(measured, {0: 40, 1: 7, 3: 2})
    text = _texts(svg)
    assert "verify c(T) / c(1)" in text and "d1: 7" in text and "d3: 2" in text
    assert "no cost curve" not in text and "d0" not in text
    assert "no cost curve" in _texts(costs_chart(None, {}))


def test_positions_stop_at_the_last_drafted() -> None:
    mode = {"acceptance_by_depth": [0.5, 0.25, 0.0, 0.0],
            "sources": {"head": {"proposed": [4, 4, 0, 0], "accepted": [2, 1, 0, 0]},
                        "lookup": {"proposed": [2, 2, 2, 0], "accepted": [1, 0, 0, 0]}}}
    assert positions(mode) == [0.5, 0.25, 0.0]
    assert positions({"acceptance_by_depth": [0.4, 0.2]}) == [0.4, 0.2]  # no counters: all


def test_report_is_written_when_checks_fail(built, tmp_path: Path) -> None:
    page = tmp_path / "failed.html"
    result = CliRunner().invoke(main, ["verify-run", str(built("mimo")), "--loads", "code",
                                       "--runs", "1", "--max-tokens", "16", "--depth", "1",
                                       "--min-speedup", "1000", "--report", str(page)])
    assert result.exit_code == 1
    html = page.read_text()
    assert 'id="verdict">FAIL<' in html
    assert re.search(r"<td>speedup</td><td><span class=\"verdict fail\">fail</span>", html)
    assert "floor 1000.00x" in html


def test_compare_overlays_the_earlier_run_and_lists_what_changed(local_run) -> None:
    doc, _, out = local_run
    earlier = copy.deepcopy(doc)
    earlier["record"]["machine"]["versions"]["mlx"] = "0.0.1"
    for row in earlier["speed"]["loads"].values():
        for mode in ("plain", "mtp"):
            tps = row[mode]["decode_tps"]
            tps["p50"], tps["p95"] = 2 * tps["p50"], 2 * tps["p95"]
    path = out / "earlier.json"
    path.write_text(json.dumps(earlier))
    page = out / "compared.html"
    result = CliRunner().invoke(main, ["verify-run", "--report", str(page), "--compare", str(path),
                                       "--endpoint", "http://127.0.0.1:9", "--timeout", "1"])
    assert result.exit_code == 2 and "endpoint.unreachable" in result.output  # read, then run
    html = report_mod.render(doc, report_mod.load_earlier(path), "earlier.json")
    assert "compared with <code>earlier.json</code>" in html
    changed = re.findall(r'<tr class="changed"><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>', html)
    assert ("machine.versions.mlx", "0.0.1", doc["record"]["machine"]["versions"]["mlx"]) in changed
    assert len(changed) == 1, changed
    # decode P95 headline halved against the earlier doubled numbers: -50%
    assert "-50.0% vs earlier" in html
    svgs = _svgs(html)
    assert "mtp (earlier)" in _texts(svgs[0]) and "code (earlier)" in _texts(svgs[1])


def test_untrusted_strings_are_escaped(local_run) -> None:
    doc, _, _ = local_run
    evil = copy.deepcopy(doc)
    evil["target"]["name"] = "<script>alert(1)</script>"
    evil["speed"]["loads"] = {"<img src=x onerror=alert(1)>": evil["speed"]["loads"]["code"]}
    evil["checks"][0]["summary"] = "</td><script>x</script>"
    html = report_mod.render(evil, doc, "<b>old</b>.json")
    assert "<script" not in html and "<img" not in html and "<b>old" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_an_endpoint_report_says_what_it_cannot_show(tmp_path: Path) -> None:
    page = tmp_path / "endpoint.html"
    with running("honest") as url:
        result = CliRunner().invoke(main, ["verify-run", "--endpoint", url, "--loads", "code",
                                           "--runs", "1", "--max-tokens", "24", "--report", str(page)])
    assert result.exit_code == 0, result.output
    html = page.read_text()
    svgs = _svgs(html)
    assert "no per-round telemetry from this target" in _texts(svgs[2])
    assert "no cost curve" in _texts(svgs[3])
    assert "as served" in _texts(svgs[0])


@pytest.mark.parametrize(("setup", "args", "code"), [
    (None, ["--compare", "{d}/missing.json", "--report", "{d}/r.html"], "compare.unreadable"),
    ("not json {", ["--compare", "{d}/in.json", "--report", "{d}/r.html"], "compare.invalid"),
    ('{"target": 1}', ["--compare", "{d}/in.json", "--report", "{d}/r.html"], "compare.invalid"),
    (None, ["--compare", "{d}/in.json"], "usage"),
    (None, ["--report", "{d}"], "report.unwritable"),
    (None, ["--report", "{d}/no/such/dir/r.html"], "report.unwritable"),
])
def test_bad_report_inputs_are_one_line_errors_before_the_run(tmp_path: Path, setup, args,
                                                               code) -> None:
    if setup is not None:
        (tmp_path / "in.json").write_text(setup)
    argv = [a.format(d=tmp_path) for a in args]
    result = CliRunner().invoke(main, ["verify-run", "--endpoint", "http://127.0.0.1:9", *argv])
    assert result.exit_code == 2, result.output
    assert f"error [{code}]" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r.html").exists()


def test_oversized_compare_file_is_refused(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"x": "y" * 4096}))
    monkeypatch.setattr(report_mod, "MAX_COMPARE_BYTES", 1024)
    with pytest.raises(report_mod.UserError, match="over") as err:
        report_mod.load_earlier(path)
    assert err.value.code == "compare.invalid"


def test_a_failed_write_is_a_user_error_and_leaves_no_file(local_run, tmp_path: Path,
                                                            monkeypatch) -> None:
    doc, _, _ = local_run

    def full(texts: dict) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_mod, "replace_files", full)
    with pytest.raises(report_mod.UserError, match="No space left") as err:
        report_mod.write(doc, tmp_path / "r.html")
    assert err.value.code == "report.unwritable" and not (tmp_path / "r.html").exists()


def _summary(html: str) -> str:
    """The run's summary sentence as a reader sees it (tags out, whitespace collapsed)."""
    p = re.search(r'<p id="summary">(.*?)</p>', html, re.S)
    assert p, "no summary paragraph"
    return " ".join(re.sub(r"<[^>]+>", "", p[1]).split())


def test_summary_reads_as_a_sentence(local_run) -> None:
    """Issue 34: "1 runs of 256 tokens ... first 64) ." Now: "1 run", no space before "."."""
    doc, html, _ = local_run
    assert "2 runs of 24 tokens per load and mode (steady decode after the first 64)." in \
        _summary(html)
    one = copy.deepcopy(doc)
    one["speed"] |= {"runs": 1, "defaults": "cpu"}
    text = _summary(report_mod.render(one))
    assert "1 run of 24 tokens" in text and "1 runs" not in text
    assert "the defaults for a CPU backend" in text
    assert not re.search(r"\s[.,;]", text), text
    compared = _summary(report_mod.render(one, doc, "earlier.json"))
    assert compared.count(".json (dashed / hollow in the charts).") == 1, compared
    assert not re.search(r"\s[.,;]", compared), compared


def test_summary_says_the_curve_was_measured_before_any_timed_request(local_run) -> None:
    doc, _, _ = local_run
    timed = copy.deepcopy(doc)
    timed["speed"]["costs"] = {"verify": [0.01, 0.02], "plain": 0.01, "draft": 0.005,
                               "ratios": [1.0, 2.0], "seconds": 12.34, "measured": True}
    text = _summary(report_mod.render(timed))
    assert "The cost curve was measured before the first request (12.3 s): no run's TTFT " \
        "includes it." in text


def test_headline_acceptance_is_its_checks_figure() -> None:
    """Issue 34: the headline read 95.2% (median over loads), the check 96.0% (their mean)."""
    from mtpkit.verify.run import VerifyOptions, _speed_checks

    tps = {"p50": 10.0, "p95": 11.0, "n": 1}
    rows = {name: {"plain": {"decode_tps": tps}, "speedup": 1.1,
                   "mtp": {"decode_tps": tps, "acceptance_by_depth": [a, 0.5]}}
            for name, a in (("code", 0.940), ("memo", 0.952), ("translation", 0.988))}
    check = next(c for c in _speed_checks(rows, VerifyOptions(), True, "auto")
                 if c.name == "acceptance")
    head = report_mod.headline({"speed": {"loads": rows}})
    assert f"{100 * head['acceptance_p50']:.1f}%" == "95.2%"
    assert check.summary.startswith("depth-1 acceptance 95.2% (median over loads)"), check.summary


def test_no_acceptance_says_whether_auto_decoded_plainly() -> None:
    """Auto reporting only plain steps is not a target that hides its acceptance: the check
    says which (a --min-accept floor fails both)."""
    from mtpkit.verify.run import VerifyOptions, _speed_checks

    tps = {"p50": 10.0, "p95": 11.0, "n": 1}
    plainly = {"code": {"plain": {"decode_tps": tps}, "speedup": 1.0,
                        "mtp": {"decode_tps": tps, "acceptance_by_depth": [], "depths": {"0": 47}}}}
    silent = {"code": {"plain": {"decode_tps": tps}, "speedup": 1.0,
                       "mtp": {"decode_tps": tps}}}
    for rows, said in ((plainly, "auto decoded plainly"), (silent, "not reported")):
        for floor, status in ((None, "info"), (0.5, "fail")):
            check = next(c for c in _speed_checks(rows, VerifyOptions(min_accept=floor), True,
                                                  "auto") if c.name == "acceptance")
            assert check.status == status and said in check.summary, check


def test_an_interrupted_run_is_marked_incomplete(local_run) -> None:
    doc, _, _ = local_run
    cut = copy.deepcopy(doc) | {"incomplete": True,
                                "interrupted": {"runs_measured": 2, "runs_planned": 6}}
    validate(cut, "verify_run")
    html = report_mod.render(cut)
    banner = re.search(r'<p class="incomplete" id="incomplete">(.*?)</p>', html, re.S)
    assert banner and "incomplete: interrupted after 2 of 6 runs" in re.sub(r"<[^>]+>", "",
                                                                          banner[1])
    assert 'id="incomplete"' not in report_mod.render(doc)
