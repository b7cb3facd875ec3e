"""verify-run's report and serve's chat page in a real headless Chromium (Debian's chromium, driven
by Playwright; scripts/setup.sh test installs both): the charts render (pixels drawn, axes
labelled), nothing is fetched from anywhere, and the page streams an answer from a live
`mtpkit serve` on loopback under the API's key rule."""

from __future__ import annotations

import io
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from playwright.sync_api import BrowserContext, Page, expect, sync_playwright

from fixtures.serving import serve_process
from mtpkit.cli import main

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "page-test-key"


@contextmanager
def browser(profile: Path) -> Iterator[BrowserContext]:
    """Chromium with a fresh profile (no download of Playwright's own browsers: Debian's)."""
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


# every word of a table's cells (the folded evidence aside) that the layout broke across lines
# (a word's text range with boxes on two lines): "mod e", "P9 5", "translat ion"
SPLIT_WORDS = """table => Array.from(table.querySelectorAll('th, td')).flatMap(cell => {
    const split = [];
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
        if (n.parentElement.closest('details')) continue;  // the evidence: folded JSON
        for (const m of n.data.matchAll(/\\S+/g)) {
            const range = document.createRange();
            range.setStart(n, m.index);
            range.setEnd(n, m.index + m[0].length);
            const lines = new Set(Array.from(range.getClientRects()).filter(
                r => r.width > 0).map(r => Math.round(r.top)));
            if (lines.size > 1) split.push(m[0]);
        }
    }
    return split;
})"""


def drawn_share(png: bytes) -> float:
    """Share of the pixels that are not the white background."""
    gray = np.asarray(Image.open(io.BytesIO(png)).convert("L"))
    return float((gray < 235).mean())


def test_report_charts_render_labelled_in_chromium(built, tmp_path: Path) -> None:
    report = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["verify-run", str(built("deepseek_v3")), "--loads",
                                       "code,memo,translation", "--runs", "1", "--max-tokens", "24",
                                       "--depth", "2", "--report", str(report)])
    assert result.exit_code in (0, 1) and report.exists(), result.output
    requests: list[str] = []
    with browser(tmp_path / "profile") as context:
        page = context.new_page()
        page.on("request", lambda r: requests.append(r.url))
        page.goto(report.as_uri(), wait_until="load")
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        charts = page.locator("figure.chart svg")
        assert charts.count() == 7
        for i in range(charts.count()):
            chart = charts.nth(i)
            box = chart.bounding_box()
            assert box and box["width"] > 300 and box["height"] > 150, box
            assert drawn_share(chart.screenshot()) > 0.02, f"chart {i} looks blank"
            # every axes has a y label and the chart an x label, laid out as visible text
            axes, xs, ys = chart.evaluate("""svg => {
                const shown = (sel) => Array.from(svg.querySelectorAll(sel)).map(
                    g => Array.from(g.querySelectorAll('text')).filter(
                        t => t.getBBox().width > 0).map(t => t.textContent).join(' '));
                return [svg.querySelectorAll('g[id^="axes_"]').length,
                        shown('g[id*="-xlabel-"]'), shown('g[id*="-ylabel-"]')];
            }""")
            assert axes >= 1 and len(ys) == axes and all(ys), (i, axes, ys)
            assert xs and all(xs), (i, xs)
        assert page.locator("#verdict").inner_text() in ("PASS", "FAIL")
        assert page.locator("#checks tr").count() > 5
        # issue 34: "1 runs of 256 tokens ... first 64) ." and headers cut mid-word ("mod e")
        summary = page.locator("#summary").inner_text()
        assert "1 run of 24 tokens per load and mode (steady decode after the first 64)." \
            in summary and not re.search(r"\s[.,;]", summary), summary
        for table in ("#loads", "#checks"):
            split = page.locator(table).evaluate(SPLIT_WORDS)
            assert split == [], f"{table}: words broken across lines: {split}"
        headers = page.locator("#loads th")
        assert headers.count() == 12
        for i in range(headers.count()):
            fits = headers.nth(i).evaluate("th => th.scrollWidth <= th.clientWidth")
            assert fits, headers.nth(i).inner_text()
    assert requests == [report.as_uri()], "the report fetched something besides itself"
    assert (tmp_path / "report.png").stat().st_size > 10_000


@pytest.fixture
def live_serve(built) -> Iterator[str]:
    """`mtpkit serve` as a subprocess on loopback with an API key; yields its base URL."""
    with serve_process(built("deepseek_v3"), "--depth", "2", "--api-key", KEY,
                       "--dtype", "float32") as url:
        yield url


def _api(url: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode() if body else None,
                                 {"Content-Type": "application/json"}
                                 | ({"Authorization": f"Bearer {key}"} if key else {}))
    try:
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.status, json.loads(res.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _ask(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")
    # a locator assertion, not a page function: the page's CSP forbids evaluating strings
    expect(page.locator("#status")).to_have_text(re.compile(r"^(done|error)$"), timeout=60_000)


def test_page_streams_an_answer_from_live_serve_under_the_key_rule(live_serve: str,
                                                                    tmp_path: Path) -> None:
    url = live_serve
    with urllib.request.urlopen(url + "/", timeout=10) as res:  # the page itself is public
        csp = res.headers["Content-Security-Policy"]
        assert res.status == 200 and res.headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert _api(url + "/v1/models", key=None)[0] == 401  # the API keeps its rule
    question = "Name three colors."
    requests: list[str] = []
    with browser(tmp_path / "profile") as context:
        page = context.new_page()
        page.on("request", lambda r: requests.append(r.url))
        page.goto(url + "/", wait_until="load")
        page.fill("#max", "24")
        page.select_option("#depth", "2")
        _ask(page, question)  # no key typed: the API refuses, the page says so
        assert page.locator(".msg.error").inner_text() == "invalid API key"
        assert page.locator("#tps").inner_text() == "-"
        page.fill("#key", KEY)
        _ask(page, question)
        assert page.locator("#status").inner_text() == "done"
        answer = page.locator(".msg.assistant").last.get_attribute("data-raw")
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        tps = float(page.locator("#tps").inner_text())
        bars = page.locator("#accept .bar").count()
        sparkline = page.locator("#spark polyline").get_attribute("points")
        strip_png = page.locator("header").screenshot()
    # the same request through the API: greedy, so the same text, and the strip shows its usage
    status, doc = _api(url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": question}], "max_tokens": 24, "mtp_depth": 2})
    assert status == 200
    assert answer == doc["choices"][0]["message"]["content"] and answer.strip()
    mtp = doc["usage"]["mtp"]
    assert tps > 0 and mtp["decode_tps"] > 0
    assert bars == len(mtp["acceptance_by_depth"]) == 2
    assert sparkline and len(sparkline.split()) == 1  # one answer so far
    assert drawn_share(strip_png) > 0.01
    assert all(r.startswith(url) for r in requests), requests  # nothing from anywhere else
    assert any(r.endswith("/v1/chat/completions") for r in requests)


MARKDOWN = ("# Plan\n\nUse `parse()` with **care** and _intent_, see [the docs](https://example.com/d)"
            " or [this](javascript:document.title='pwned').\n\n"
            "<img src=x onerror=\"document.title='pwned'\">\n\n"
            "```python\nprint('<b>bold?</b>')\n```\n\n- one\n- two <script>x()</script>\n")


def test_page_renders_markdown_safely_and_sends_its_controls(live_serve: str,
                                                             tmp_path: Path) -> None:
    """The model's Markdown is drawn (code fences, headings, lists, inline marks, http(s)
    links) and its HTML stays text; the sampling controls are the request's fields."""
    bodies: list[dict] = []
    half = len(MARKDOWN) // 2  # two chunks: the fence and the list arrive mid-stream

    def answer(route) -> None:  # noqa: ANN001 (Playwright's Route)
        bodies.append(json.loads(route.request.post_data))
        events = [{"choices": [{"index": 0, "delta": {"content": part}}]}
                  for part in (MARKDOWN[:half], MARKDOWN[half:])]
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"},
                      body="".join(f"data: {json.dumps(e)}\n\n" for e in events)
                      + "data: [DONE]\n\n")

    dialogs: list[str] = []
    with browser(tmp_path / "profile") as context:
        page = context.new_page()
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.route("**/v1/chat/completions", answer)
        page.goto(live_serve + "/", wait_until="load")
        title = page.title()
        page.fill("#max", "12")
        page.fill("#temperature", "0.7")
        page.fill("#top_p", "0.9")
        page.fill("#top_k", "40")
        page.select_option("#depth", "3")
        _ask(page, "Show me.")
        box = page.locator(".msg.assistant").last
        assert page.locator("#status").inner_text() == "done"
        assert box.get_attribute("data-raw") == MARKDOWN
        assert box.locator("img, script, b").count() == 0, box.inner_html()
        assert "<img src=x onerror=" in box.text_content() and "<script>x()</script>" in \
            box.text_content()
        assert page.title() == title and dialogs == []
        code = box.locator("pre > code")
        assert code.count() == 1 and code.text_content() == "print('<b>bold?</b>')"
        assert code.get_attribute("class") == "language-python"
        assert box.locator("h1").text_content() == "Plan"
        assert box.locator("ul > li").all_text_contents() == ["one", "two <script>x()</script>"]
        assert box.locator("p code").text_content() == "parse()"
        assert box.locator("strong").text_content() == "care"
        assert box.locator("em").text_content() == "intent"
        links = box.locator("a")
        assert links.count() == 1 and links.get_attribute("href") == "https://example.com/d"
        assert "[this](javascript:" in box.text_content()
        page.fill("#temperature", "0")
        page.fill("#top_k", "")  # empty: the server's default
        _ask(page, "Again.")
    assert bodies[0] | {"messages": None} == {
        "messages": None, "stream": True, "max_tokens": 12, "temperature": 0.7, "top_p": 0.9,
        "top_k": 40, "mtp_depth": 3}
    assert bodies[1]["temperature"] == 0 and bodies[1]["top_k"] == 0
    assert bodies[1]["messages"][-2] == {"role": "assistant", "content": MARKDOWN}
