"""Find chat templates where transformers looks, and test-render them in jinja2's sandbox.

Templates are untrusted code. Before anything renders, the parsed template is searched for
reaches into Python internals (underscore attributes, `attr('__...')`); such a template is
reported, never executed. What the static check cannot see (a computed name such as
`attr('_' ~ '_class__')`) the sandbox stops while rendering: ImmutableSandboxedEnvironment, as
transformers uses, with arithmetic that would run as one endless C call refused, and a
wall-clock bound on compiling and rendering in whichever thread renders.
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.nodes as nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError, UndefinedError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mtpkit.loaders.config import read_json
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.paths import bundle_file

RENDER_SECONDS = 5
MAX_REPEAT = 1 << 20  # items or characters one `*` may build
MAX_POWER_BITS = 1 << 16  # bits one integer `**` may produce
MAX_EXTRA_VARIABLES = 3
STANDARD_CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? Answer in one word."},
]
# Special tokens that mean "this tokenizer speaks a chat format", so a template must exist.
CHAT_MARKERS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>", "<｜User｜>",
                "<|user|>", "[INST]", "<|turn>", "<|start|>")


class GenerationBlocks(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant spans for
    training masks); for rendering, the block is its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _RaisedByTemplate(Exception):
    """The template called raise_exception(): it rejects the conversation, it is not broken."""


# What rendering an untrusted template can raise, short of the sandbox stopping it.
RENDER_ERRORS = (_RaisedByTemplate, TemplateError, TimeoutError, TypeError, ValueError, KeyError,
                 AttributeError, IndexError, RecursionError, ArithmeticError)


@dataclass
class TemplateReport:
    source: str | None = None  # where the default template came from
    named: list[str] = field(default_factory=list)
    text: str | None = None
    renders: bool | None = None
    rendered: str | None = None
    dropped_system: bool = False
    thinking: bool = False  # reads enable_thinking
    opens_reasoning: bool = False  # generation prompt ends inside <think>
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "named": self.named, "renders": self.renders,
                "dropped_system": self.dropped_system, "supports_thinking": self.thinking,
                "generation_prompt_opens_reasoning": self.opens_reasoning}


def _from_tokenizer_config(value: Any) -> tuple[str | None, dict[str, str]]:
    if isinstance(value, str):
        return value, {}
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value
                 if isinstance(t, dict) and isinstance(t.get("name"), str)
                 and isinstance(t.get("template"), str)}
        return named.pop("default", None), named
    return None, {}


def locate(root: Path, tokenizer_config: dict[str, Any],
           findings: list[Finding] | None = None) -> tuple[str | None, str | None, dict[str, str]]:
    """(source, default template, named templates) as transformers loads them: template files
    (chat_template.jinja, additional_chat_templates/*.jinja), when any exist, replace the
    tokenizer_config.json entries entirely; the legacy chat_template.json is the last resort."""
    seen = [] if findings is None else findings
    extra = sorted((root / "additional_chat_templates").glob("*.jinja"))
    named = {p.stem: path.read_text("utf-8") for p in extra
             if (path := bundle_file(root, f"additional_chat_templates/{p.name}", seen))}
    jinja_file = bundle_file(root, "chat_template.jinja", seen)
    if jinja_file is not None:
        return "chat_template.jinja", jinja_file.read_text("utf-8"), named
    if named:
        return None, None, named
    default, named = _from_tokenizer_config(tokenizer_config.get("chat_template"))
    if default is not None:
        return "tokenizer_config.json", default, named
    legacy = bundle_file(root, "chat_template.json", seen)
    if legacy is not None:
        try:
            value = read_json(legacy)
        except (ValueError, OSError, UnicodeDecodeError):
            value = None
        if isinstance(value, dict) and isinstance(value.get("chat_template"), str):
            return "chat_template.json", value["chat_template"], named
    return None, None, named


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox with `*` and `**` checked before they run: `9 ** (9 ** 9)` or `'a' * 10 ** 12`
    is one C call that no time bound interrupts (and jinja2 would fold it while compiling)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and _is_int(left) and _is_int(right) and right > 0 and \
                right * abs(left).bit_length() > MAX_POWER_BITS:
            raise SecurityError(f"{left} ** {right} is over {MAX_POWER_BITS} bits")
        if operator == "*":
            items, times = (left, right) if _is_int(right) else (right, left)
            if isinstance(items, str | list | tuple) and _is_int(times) and \
                    len(items) * times > MAX_REPEAT:
                raise SecurityError(f"repeating {len(items)} items {times} times is over "
                                    f"{MAX_REPEAT}")
        return super().call_binop(context, operator, left, right)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[loopcontrols, GenerationBlocks])

    def raise_exception(message: str) -> None:
        raise _RaisedByTemplate(message)

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
               sort_keys: bool = False) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def unsafe_reach(source: str) -> str | None:
    """The first reach into Python internals in the template, or None. Raises on bad syntax."""
    tree = _environment().parse(source)
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
            return f".{node.attr}"
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and str(
                node.arg.value).startswith("_"):
            return f"[{node.arg.value!r}]"
        if isinstance(node, nodes.Filter) and node.name == "attr" and any(
                isinstance(a, nodes.Const) and str(a.value).startswith("_") for a in node.args):
            return "|attr(" + ", ".join(repr(a.value) for a in node.args
                                        if isinstance(a, nodes.Const)) + ")"
    return None


class _Expired(BaseException):
    """Raised inside a render past its deadline; a BaseException, so that no `except Exception`
    on the way (jinja2's, a filter's) swallows it."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Set (None: clear) the exception a thread raises at its next bytecode (CPython API)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc else None)


def _bounded(work: Callable[[], str], seconds: float) -> str:
    """work() or TimeoutError after `seconds`, in any thread (serve renders in its request
    threads, where SIGALRM cannot reach): a timer raises _Expired in the rendering thread at its
    next bytecode, so a template loop ends there; nothing of the render survives."""
    target, lock, state = threading.get_ident(), threading.Lock(), {"done": False, "fired": False}

    def expire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _raise_in(target, _Expired)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        try:
            return work()
        finally:
            timer.cancel()
            with lock:
                state["done"] = True
                if state["fired"]:  # fired as the work ended: drop it if not yet delivered
                    _raise_in(target, None)
    except _Expired:
        raise TimeoutError(f"rendering took longer than {seconds}s") from None


def render(source: str, messages: list[dict[str, Any]], special: dict[str, str],
           **kwargs: Any) -> str:
    """Render a chat template in the sandbox (the caller has already checked unsafe_reach);
    compiling counts against the bound too."""
    def work() -> str:
        template = _environment().from_string(source)
        return template.render(messages=messages, add_generation_prompt=True, **special, **kwargs)

    return _bounded(work, RENDER_SECONDS)


def describe_failure(exc: BaseException) -> str:
    """One line saying why a render failed, for someone who cannot see the template."""
    detail = " ".join(str(exc).split())[:200]
    if isinstance(exc, _RaisedByTemplate):
        return f"the chat template rejects these messages: {detail}"
    if isinstance(exc, SecurityError):
        return f"the sandbox stopped the chat template: {detail}"
    if isinstance(exc, TimeoutError):
        return f"the chat template ran too long: {detail}"
    return f"the chat template fails on these messages: {type(exc).__name__}: {detail}"


def _render_standard(report: TemplateReport, source: str, context: dict[str, Any]) -> str:
    try:
        return render(source, STANDARD_CONVERSATION, context)
    except _RaisedByTemplate:
        # Some formats reject a system turn (Gemma: "System role not supported").
        report.dropped_system = True
        return render(source, STANDARD_CONVERSATION[1:], context)


def _try_render(report: TemplateReport, source: str, special: dict[str, str], where: str) -> None:
    context: dict[str, Any] = dict(special)
    needed: list[str] = []
    try:
        for _ in range(MAX_EXTRA_VARIABLES + 1):
            try:
                report.rendered = _render_standard(report, source, context)
                break
            except UndefinedError as exc:
                # A template written for one runtime may expect a variable such as `functions`;
                # give it an empty one and say so, rather than call the template broken.
                name = re.match(r"'(\w+)' is undefined", str(exc))
                if not name or name[1] in context or len(needed) == MAX_EXTRA_VARIABLES:
                    raise
                needed.append(name[1])
                context[name[1]] = ""  # empty, iterable, concatenable
    except SecurityError as exc:
        report.renders = False
        report.findings.append(finding("template.unsafe", f"sandbox stopped it: {exc}", where))
        return
    except RENDER_ERRORS as exc:
        report.renders = False
        report.findings.append(finding("template.render_failed",
                                       f"standard conversation fails: {type(exc).__name__}: "
                                       f"{str(exc)[:200]}", where))
        return
    report.renders = True
    if needed:
        report.findings.append(finding(
            "template.render_failed", "renders only when the caller passes "
            + ", ".join(f"`{n}`" for n in needed) + " (not a standard chat-template variable)",
            where, severity="warning"))
    if "Italy" not in report.rendered:
        report.findings.append(finding("template.render_failed", "the rendered prompt does not "
                                       "contain the last user message", where, severity="warning"))
    report.opens_reasoning = report.rendered.rstrip().endswith("<think>")


def check_template(root: Path, tokenizer_config: dict[str, Any], special: dict[str, str],
                   vocab_has_chat_markers: bool) -> TemplateReport:
    report = TemplateReport()
    try:
        source, text, named = locate(root, tokenizer_config, report.findings)
    except (OSError, UnicodeDecodeError) as exc:
        report.findings.append(finding("template.invalid", f"unreadable: {exc}", "chat_template"))
        return report
    report.source, report.text, report.named = source, text, sorted(named)
    if text is None:
        if vocab_has_chat_markers:
            report.findings.append(finding(
                "template.missing", "the tokenizer has chat special tokens but no chat template "
                "exists (chat_template.jinja, tokenizer_config.json); apply_chat_template fails "
                "and mlx-lm's server silently concatenates roles", "chat_template.jinja"))
        return report
    if source == "chat_template.json":
        report.findings.append(finding("template.legacy_location", "the only template is in the "
                                       "legacy processor file chat_template.json",
                                       "chat_template.json"))
    for where, body in [(source, text), *((f"additional_chat_templates/{n}.jinja", b)
                                          for n, b in sorted(named.items()))]:
        try:
            reach = unsafe_reach(body)
        except TemplateSyntaxError as exc:
            report.findings.append(finding("template.invalid", f"line {exc.lineno}: {exc.message}",
                                           where))
            report.renders = False if where == source else report.renders
            continue
        if reach:
            report.findings.append(finding("template.unsafe", f"reaches into Python internals "
                                           f"({reach}); not rendered", where))
            report.renders = False if where == source else report.renders
            continue
        if where == source:
            report.thinking = "enable_thinking" in body
            _try_render(report, body, special, where)
    return report

