"""Chat templates: transformers' precedence, sandboxed rendering of ~70 real published
templates without false alarms, and hostile templates reported without being executed (what the
sandbox processes bound, whatever a template does, is tests/test_template_bounds.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from fixtures.tokenizer import CHATML_THINKING
from mtpkit.loaders import templates
from mtpkit.loaders.templates import check_template

REAL = Path(os.environ.get("MTPKIT_REAL_TEMPLATES",
                           Path(__file__).resolve().parents[1] / ".venv" / "real-templates"))
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def _real() -> list[Path]:
    found = sorted(REAL.glob("*.jinja"))
    assert len(found) >= 60, f"real templates missing in {REAL}: run bash scripts/test.sh"
    return found


def _check(tmp_path: Path, text: str, **tokenizer_config):
    (tmp_path / "chat_template.jinja").write_text(text)
    return check_template(tmp_path, tokenizer_config, SPECIAL, True)


def test_every_real_template_renders_without_error(tmp_path):
    failures = {}
    for path in _real():
        folder = tmp_path / path.stem
        folder.mkdir()
        report = _check(folder, path.read_text())
        errors = [f.message for f in report.findings if f.severity == "error"]
        if errors or not report.renders:
            failures[path.name] = errors
    assert failures == {}


def test_real_templates_known_behaviours(tmp_path):
    by_name = {p.name: p for p in _real()}
    qwen = _check(tmp_path, by_name["Qwen3.5-4B.jinja"].read_text())
    assert qwen.thinking and qwen.opens_reasoning  # the reasoning-channel trap
    gemma_dir = tmp_path / "g"
    gemma_dir.mkdir()
    gemma = _check(gemma_dir, by_name["google-gemma-2-2b-it.jinja"].read_text())
    assert gemma.renders and gemma.dropped_system and gemma.findings == []


def test_renders_exactly(tmp_path):
    report = _check(tmp_path, CHATML_THINKING)
    assert report.rendered == (
        "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nAnd of Italy? Answer in one word.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert templates.render(CHATML_THINKING, [{"role": "user", "content": "x"}], {},
                            enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_precedence_follows_transformers(tmp_path):
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "legacy"}))
    assert templates.locate(tmp_path, {})[:2] == ("chat_template.json", "legacy")
    listed = [{"name": "default", "template": "from-config"}, {"name": "tool_use", "template": "t"}]
    source, text, named = templates.locate(tmp_path, {"chat_template": listed})
    assert (source, text, sorted(named)) == ("tokenizer_config.json", "from-config", ["tool_use"])
    # template files, once any exist, replace the tokenizer_config entries entirely
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "rag.jinja").write_text("r")
    assert templates.locate(tmp_path, {"chat_template": listed}) == (None, None, {"rag": "r"})
    (tmp_path / "chat_template.jinja").write_text("file")
    source, text, named = templates.locate(tmp_path, {"chat_template": listed})
    assert (source, text, sorted(named)) == ("chat_template.jinja", "file", ["rag"])


HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages['__class__'] }}",
    "{{ messages|attr('__init__') }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% set x = namespace() %}{{ x._TemplateReference__context }}",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_templates_are_reported_not_run(tmp_path, text, monkeypatch):
    calls = []
    monkeypatch.setattr(templates, "_render", lambda *a, **k: calls.append(a))
    report = _check(tmp_path, text)
    assert [f.code for f in report.findings] == ["template.unsafe"]
    assert calls == []


def test_sandbox_stops_what_static_check_cannot_see(tmp_path):
    report = _check(tmp_path, "{% set l = [] %}{{ l.append(1) }}{{ messages[0].content }}")
    assert [f.code for f in report.findings] == ["template.unsafe"]
    assert "sandbox stopped it" in report.findings[0].message


def test_computed_attribute_name_is_stopped_by_the_sandbox_at_render_time(tmp_path):
    """A name built at run time passes the static check; only the sandbox stands between it
    and the class: printed it is empty, used it is a SecurityError (template.unsafe)."""
    reach = "{{ (messages|attr('_' ~ '_class__')).mro() }}"
    assert templates.unsafe_reach(reach) is None
    report = _check(tmp_path, reach)
    assert [f.code for f in report.findings] == ["template.unsafe"] and not report.renders
    assert report.findings[0].message == (
        "sandbox stopped it: access to attribute '__class__' of 'list' object is unsafe.")
    assert templates.render("{{ messages|attr('_' ~ '_class__') }}", [], {}) == ""


def test_arithmetic_bombs_are_refused_before_they_run(tmp_path):
    """`9 ** (9 ** 9)` is one C call (about an hour of CPU, folded by jinja2 while compiling) and
    `'a' * 10 ** 12` one allocation: the sandbox process's bounds would end either, but refusing
    them before they run says why, at once."""
    for i, bomb in enumerate(["{{ 9 ** (9 ** 9) }}", "{{ 'a' * 10 ** 12 }}",
                              "{{ [0] * 10 ** 7 }}"]):
        (folder := tmp_path / str(i)).mkdir()
        start = time.monotonic()
        report = _check(folder, bomb)
        assert [f.code for f in report.findings] == ["template.unsafe"], bomb
        assert time.monotonic() - start < 2, bomb
    assert templates.render("{{ 2 ** 10 }} {{ '=' * 3 }} {{ 2 * 'ab' }} {{ [1] * 2 }}", [],
                            {}) == "1024 === abab [1, 1]"


RUNAWAY = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"


def test_runaway_template_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(templates, "RENDER_SECONDS", 1)
    report = _check(tmp_path, RUNAWAY)
    assert [f.code for f in report.findings] == ["template.render_failed"]
    assert report.findings[0].message == (
        "standard conversation fails: TimeoutError: rendering took longer than 1s")


def test_runaway_template_is_bounded_outside_the_main_thread(monkeypatch):
    """serve renders in its request threads: the bound holds in any thread."""
    monkeypatch.setattr(templates, "RENDER_SECONDS", 1)
    raised: list[BaseException] = []

    def work() -> None:
        try:
            templates.render(RUNAWAY, [], {})
        except BaseException as exc:  # whatever ends the render is the answer
            raised.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the render was not stopped"
    assert [type(e) for e in raised] == [TimeoutError] and time.monotonic() - start < 3


def test_a_finished_render_leaves_its_sandbox_to_the_next(monkeypatch):
    """serve renders every request: it pays a pipe round trip, not a process start, and a render
    that ended in time leaves nothing behind to end the next one."""
    monkeypatch.setattr(templates, "RENDER_SECONDS", 0.2)
    assert templates.render("{{ messages[0].content }}", [{"content": "x"}], {}) == "x"
    child = templates._POOL.idle[-1].proc.pid
    time.sleep(0.5)  # past the deadline
    assert templates.render("{{ messages[0].content }}", [{"content": "y"}], {}) == "y"
    assert templates._POOL.idle[-1].proc.pid == child


def test_arithmetic_errors_are_render_failed_not_a_crash(tmp_path):
    report = _check(tmp_path, "{{ messages|length / 0 }}")
    assert [f.code for f in report.findings] == ["template.render_failed"]
    assert report.findings[0].message == (
        "standard conversation fails: ZeroDivisionError: division by zero")


def test_template_that_rejects_everything_is_render_failed(tmp_path):
    report = _check(tmp_path, "{{ raise_exception('no') }}")
    assert [f.code for f in report.findings] == ["template.render_failed"]
    assert report.findings[0].message == "standard conversation fails: _RaisedByTemplate: no"


def test_generation_blocks_and_loop_controls(tmp_path):
    text = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
            "{% generation %}{{ m.content }}{% endgeneration %}|{% endfor %}")
    report = _check(tmp_path, text)
    assert report.findings == [] and report.rendered.startswith("What is the capital")
