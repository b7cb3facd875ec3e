"""Find chat templates where transformers looks, and test-render them in a sandbox whose bounds
hold whatever the template does.

Templates are untrusted code. Nothing of one is parsed, compiled or rendered in this process:
child processes do it (loaders/template_sandbox.py: jinja2's ImmutableSandboxedEnvironment, as
transformers uses, with arithmetic bombs refused), each under an address-space and a CPU-time
limit and killed at a wall-clock deadline, since one long C call (an integer product, `center`,
`format`) holds the GIL past any bound a thread can set, and with it every thread of serve. A few
children are kept and reused, so that a render pays a pipe round trip and no start-up, and one
stuck render does not hold up another thread's. Before anything renders, the parsed template is
searched for reaches into Python internals (underscore attributes, `attr('__...')`); such a
template is reported, never rendered. What that static check cannot see (a computed name such
as `attr('_' ~ '_class__')`) the sandbox stops while rendering. Templates over 128 KiB are
refused unparsed.
"""

from __future__ import annotations

import atexit
import builtins
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import markupsafe
from jinja2.exceptions import (
    FilterArgumentError,
    SecurityError,
    TemplateAssertionError,
    TemplateError,
    TemplateRuntimeError,
    TemplateSyntaxError,
    UndefinedError,
)

from mtpkit.loaders import template_sandbox
from mtpkit.loaders.config import read_json
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.paths import bundle_file
from mtpkit.loaders.template_sandbox import (
    MAX_OUTPUT_CHARS,
    MAX_TEMPLATE_BYTES,
    MEMORY_BYTES,
    OverLimit,
    _RaisedByTemplate,
    oversize,
)

RENDER_SECONDS = 5  # wall clock for one render, or for all of doctor's renders of a template
STARTUP_SECONDS = 30  # for a child to start (not counted against a render)
SANDBOXES = 4  # children rendering at once; a fifth render waits for one
IDLE_SANDBOXES = 2  # children kept between renders
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

# What a render raises on the template's account, the sandbox stopping it included (SecurityError
# and its OverLimit, TimeoutError); anything else is this machine's (RuntimeError: no sandbox).
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


def _read_template(path: Path) -> str:
    """A template file, read no further than one byte past the size cap: an oversized one
    (refused unparsed later) never costs its whole size in memory."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_TEMPLATE_BYTES + 1)
    return data.decode("utf-8", errors="strict" if len(data) <= MAX_TEMPLATE_BYTES else "ignore")


def locate(root: Path, tokenizer_config: dict[str, Any],
           findings: list[Finding] | None = None) -> tuple[str | None, str | None, dict[str, str]]:
    """(source, default template, named templates) as transformers loads them: template files
    (chat_template.jinja, additional_chat_templates/*.jinja), when any exist, replace the
    tokenizer_config.json entries entirely; the legacy chat_template.json is the last resort."""
    seen = [] if findings is None else findings
    extra = sorted((root / "additional_chat_templates").glob("*.jinja"))
    named = {p.stem: _read_template(path) for p in extra
             if (path := bundle_file(root, f"additional_chat_templates/{p.name}", seen))}
    jinja_file = bundle_file(root, "chat_template.jinja", seen)
    if jinja_file is not None:
        return "chat_template.jinja", _read_template(jinja_file), named
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


# The child: this interpreter, isolated (-I: no environment variables, user site or current
# directory on sys.path), running template_sandbox.py; jinja2's and markupsafe's folders are
# appended to its path in case they are installed where -I does not look (a user site).
_BOOT = ("import runpy, sys; sys.path += sys.argv[2:]; "
         "runpy.run_path(sys.argv[1], run_name='__main__')")
_COMMAND = [sys.executable, "-I", "-c", _BOOT, template_sandbox.__file__,
            *dict.fromkeys(str(Path(m.__file__).resolve().parents[1]) for m in (jinja2, markupsafe))]
_JINJA_ERRORS: dict[str, type[Exception]] = {c.__name__: c for c in (
    TemplateError, TemplateRuntimeError, UndefinedError, SecurityError, FilterArgumentError,
    OverLimit, _RaisedByTemplate)}
_BUILTIN_ERRORS = tuple(c for c in RENDER_ERRORS if c.__module__ == "builtins")
_NAMED: dict[str, type[TemplateRuntimeError]] = {}


class _Gone(Exception):
    """The child had ended before it was asked (it can be replaced, nothing was rendered)."""


class _Child:
    """One sandbox process and its pipes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     bufsize=0)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.stdout, selectors.EVENT_READ)
        self.buffer = bytearray()
        try:
            ready = self._read(time.monotonic() + STARTUP_SECONDS, 1 << 10)
        except (TimeoutError, OverLimit, ValueError):
            ready = None
        except BaseException:
            self.close()
            raise
        if ready != {"ready": True}:
            self.close()
            raise RuntimeError(f"the template sandbox did not start ({self._how()}): "
                               f"{' '.join(_COMMAND[:2])} {template_sandbox.__file__}")

    def ask(self, line: bytes, seconds: float, late: str, cap: int) -> dict[str, Any]:
        """The child's reply to `line`; TimeoutError(late) past `seconds` (the child is
        killed), and OverLimit if it ended or its reply is over `cap` bytes."""
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self.stdin, view):]
        except OSError:  # BrokenPipeError: it ended while idle
            raise _Gone from None
        try:
            reply = self._read(time.monotonic() + seconds, cap)
        except TimeoutError:
            self.close()
            raise TimeoutError(late) from None
        if reply is None:
            self.close()
            if self.proc.returncode == -signal.SIGXCPU:
                raise TimeoutError(late)
            raise OverLimit(f"the template sandbox ended while rendering ({self._how()})")
        return reply

    def _read(self, deadline: float, cap: int) -> dict[str, Any] | None:
        """The next reply line (None: the child ended); TimeoutError past `deadline`."""
        seen = 0
        while (end := self.buffer.find(b"\n", seen)) < 0:
            seen = len(self.buffer)
            if seen > cap:
                self.close()
                raise OverLimit(f"the rendered reply is over {cap} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not self.selector.select(left):
                continue
            chunk = os.read(self.stdout, 1 << 20)
            if not chunk:
                try:
                    self.proc.wait(5)  # it closed its stdout: it is ending
                except subprocess.TimeoutExpired:
                    self.close()
                return None
            self.buffer += chunk
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        return json.loads(line)

    def _how(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Kill it (it holds nothing worth a graceful end) and release its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.release()

    def release(self) -> None:
        """Close this process's ends of the pipes (a forked copy of the parent does this, so
        that the parent's child still sees its stdin end with the parent)."""
        self.selector.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class _Pool:
    """Up to SANDBOXES children at work and IDLE_SANDBOXES kept between renders. Thread-safe:
    serve renders in its request threads. A forked copy of this process starts its own."""

    def __init__(self) -> None:
        self._fresh()

    def _fresh(self) -> None:
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(SANDBOXES)
        self.idle: list[_Child] = []
        self.live: set[_Child] = set()

    def after_fork(self) -> None:
        """In a forked copy: the parent's children are the parent's (their pipes are closed
        here, not them); the lock may have been held by a thread that is not here."""
        for child in self.live:
            child.release()
        self._fresh()

    def ask(self, request: dict[str, Any], seconds: float, late: str) -> dict[str, Any]:
        """A child's reply to `request`, which it has `seconds` to answer (TimeoutError(late)
        past them)."""
        line = json.dumps(request).encode("ascii") + b"\n"
        cap = 12 * max(MAX_OUTPUT_CHARS, 4 * len(line)) + (1 << 16)  # \\uXXXX pairs, 12 bytes
        slots = self.slots
        if not slots.acquire(timeout=seconds):
            raise TimeoutError(f"{late} (waiting for a free template sandbox)")
        try:
            for _ in range(3):
                child = self._take()
                try:
                    reply = child.ask(line, seconds, late, cap)
                except _Gone:
                    self._drop(child)
                    continue
                except BaseException:
                    self._drop(child)
                    raise
                self._give_back(child, retire=reply.get("error") == "MemoryError")
                return reply
            raise RuntimeError("the template sandbox keeps ending before it is asked")
        finally:
            slots.release()

    def _take(self) -> _Child:
        with self.lock:
            while self.idle:
                child = self.idle.pop()
                if child.alive():
                    return child
                self.live.discard(child)
                child.close()
        child = _Child()
        with self.lock:
            self.live.add(child)
        return child

    def _give_back(self, child: _Child, retire: bool) -> None:
        with self.lock:
            if not retire and len(self.idle) < IDLE_SANDBOXES:
                self.idle.append(child)
                return
            self.live.discard(child)
        child.close()

    def _drop(self, child: _Child) -> None:
        with self.lock:
            self.live.discard(child)
        child.close()

    def close(self) -> None:
        """End every child (at exit; a child also ends when its stdin does)."""
        with self.lock:
            children, self.idle, self.live = list(self.live), [], set()
        for child in children:
            child.close()


_POOL = _Pool()
atexit.register(_POOL.close)
os.register_at_fork(after_in_child=_POOL.after_fork)


def _error(reply: dict[str, Any]) -> Exception:
    """The exception a child's error reply stands for, as the caller would have seen it raised
    in process (an unexpected type keeps its name, as a TemplateRuntimeError)."""
    name, message = reply["error"], reply.get("message", "")
    if name == "MemoryError":
        return OverLimit(f"the render needed more than {MEMORY_BYTES >> 20} MiB of memory")
    if name in ("TemplateSyntaxError", "TemplateAssertionError"):
        cls = TemplateSyntaxError if name == "TemplateSyntaxError" else TemplateAssertionError
        exc = cls(message, reply.get("lineno") or 1)
        exc.translated = True  # str() is the message, as after jinja2's own rewrite
        return exc
    if name in _JINJA_ERRORS:
        return _JINJA_ERRORS[name](message)
    builtin = getattr(builtins, name, None)
    if isinstance(builtin, type) and issubclass(builtin, _BUILTIN_ERRORS):
        try:
            return builtin(*reply.get("args", [message]))
        except Exception:  # its constructor wants other arguments: keep the name only
            pass
    if name not in _NAMED:
        _NAMED[name] = type(name, (TemplateRuntimeError,), {"__module__": __name__})
    return _NAMED[name](message)


def _sandboxed(request: dict[str, Any], seconds: float | None = None) -> dict[str, Any]:
    """A child's successful reply to `request`, or the exception its error reply stands for;
    `seconds` (default RENDER_SECONDS: what the message names) bounds it."""
    doing = "rendering" if request["op"] == "render" else "parsing"
    late = f"{doing} took longer than {RENDER_SECONDS:g}s"
    seconds = RENDER_SECONDS if seconds is None else seconds
    if seconds <= 0:
        raise TimeoutError(late)
    reply = _POOL.ask(request | {"seconds": seconds}, seconds, late)
    if "error" in reply:
        raise _error(reply)
    return reply


def _reach(source: str) -> str | None:
    """The first reach into Python internals in the template, or None; raises what stops the
    parse (TemplateSyntaxError, OverLimit for a template over MAX_TEMPLATE_BYTES, ...)."""
    if (why := oversize(source)) is not None:
        raise OverLimit(why)
    return _sandboxed({"op": "check", "source": source})["reach"]


def unsafe_reach(source: str) -> str | None:
    """Why the template must not render (a reach into Python internals; too large or too slow
    to parse), or None. Raises TemplateSyntaxError on bad syntax."""
    try:
        return _reach(source)
    except TemplateSyntaxError:
        raise
    except RENDER_ERRORS as exc:
        return f"not checked: {' '.join(str(exc).split())[:200]}"


def render(source: str, messages: list[dict[str, Any]], special: dict[str, str],
           **kwargs: Any) -> str:
    """Render a chat template in a sandbox process (the caller has already checked
    unsafe_reach; the sandbox refuses a reach too); parsing and compiling count against the
    RENDER_SECONDS bound as well."""
    return _render(source, messages, special, kwargs)


def _render(source: str, messages: list[dict[str, Any]], special: dict[str, str],
            kwargs: dict[str, Any], seconds: float | None = None) -> str:
    if twice := sorted(set(special) & set(kwargs)):
        raise TypeError(f"render() got multiple values for keyword argument '{twice[0]}'")
    if (why := oversize(source)) is not None:
        raise OverLimit(why)
    request = {"op": "render", "source": source, "messages": messages,
               "context": {**special, **kwargs}}
    return _sandboxed(request, seconds)["text"]


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


def _render_standard(report: TemplateReport, source: str, context: dict[str, Any],
                     deadline: float) -> str:
    try:
        return _render(source, STANDARD_CONVERSATION, context, {}, deadline - time.monotonic())
    except _RaisedByTemplate:
        # Some formats reject a system turn (Gemma: "System role not supported").
        report.dropped_system = True
        return _render(source, STANDARD_CONVERSATION[1:], context, {},
                       deadline - time.monotonic())


def _try_render(report: TemplateReport, source: str, special: dict[str, str], where: str) -> None:
    """Doctor's standard conversation through the template: all its attempts (without the
    system turn, with an extra variable) share one RENDER_SECONDS bound, so a template that
    spins before each refusal still ends the check within it."""
    context: dict[str, Any] = dict(special)
    needed: list[str] = []
    deadline = time.monotonic() + RENDER_SECONDS
    try:
        for _ in range(MAX_EXTRA_VARIABLES + 1):
            try:
                report.rendered = _render_standard(report, source, context, deadline)
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
    if not report.rendered.strip():  # serve would send the model nothing ("empty prompt")
        report.renders = False
        report.findings.append(finding("template.empty", "renders nothing for a standard "
                                       "conversation: every chat prompt would be empty", where))
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
            reach = _reach(body)
        except TemplateSyntaxError as exc:
            report.findings.append(finding("template.invalid", f"line {exc.lineno}: {exc.message}",
                                           where))
            report.renders = False if where == source else report.renders
            continue
        except SecurityError as exc:  # over MAX_TEMPLATE_BYTES, or parsing hit a bound
            report.findings.append(finding("template.unsafe", f"sandbox stopped it: {exc}",
                                           where))
            report.renders = False if where == source else report.renders
            continue
        except RENDER_ERRORS as exc:  # too slow or too deep to parse
            report.findings.append(finding("template.invalid", "cannot be parsed: "
                                           f"{type(exc).__name__}: {str(exc)[:200]}", where))
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

