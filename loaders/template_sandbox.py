"""The chat-template sandbox: what parses, checks and renders an untrusted template, run in a
child process (loaders/templates.py starts and reuses them) under limits that hold whatever the
template does.

A time bound inside the rendering process cannot stop one long C call that holds the GIL (an
integer product, `center`, `format`, `replace`, `~` doubling): the render and its host freeze
together. Here the child is bounded by its address space (RLIMIT_AS), its CPU time (RLIMIT_CPU,
whose SIGXCPU kills it) and its parent's wall clock (a kill); the parent only waits on a pipe.

This file imports nothing from mtpkit (importing mtpkit sets up BLAS and MLX), so that a child
runs it as a script: requests and replies are JSON lines on stdin and stdout.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import sys
from datetime import datetime
from typing import Any, BinaryIO

import jinja2.nodes as nodes
from jinja2 import Template
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_REPEAT = 1 << 20  # items or characters one `*` may build
MAX_POWER_BITS = 1 << 16  # bits one integer `**` may produce
# Published chat templates are under 20 KB; the worst template of this size compiles in under 3 s
# on a slow, busy core, well within the render bound (a 10.5 MB one took 31 s).
MAX_TEMPLATE_BYTES = 128 << 10
MAX_OUTPUT_CHARS = 4 << 20  # rendered characters (or 4x the request, if more) a reply may carry
MEMORY_BYTES = 512 << 20  # a child's address space: a render needs a few MB
CACHED_TEMPLATES = 8  # compiled templates a child keeps (serve renders one, doctor a few)


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


class OverLimit(SecurityError):
    """The template is too large, or its render reached the sandbox's memory or output bound."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox with `*` and `**` checked before they run: `9 ** (9 ** 9)` or `'a' * 10 ** 12`
    is refused at once rather than left to the child's bounds (and jinja2 would otherwise fold
    it while compiling)."""

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


def environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders with: its sandbox, extensions and helpers."""
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


def oversize(source: str) -> str | None:
    """Why the template is too large to parse, or None (its UTF-8 size, counted without a copy
    of a huge one)."""
    size = len(source) if source.isascii() else sum(
        len(source[i:i + (1 << 20)].encode("utf-8", "surrogatepass"))
        for i in range(0, len(source), 1 << 20))
    if size <= MAX_TEMPLATE_BYTES:
        return None
    return (f"the template holds more than the {MAX_TEMPLATE_BYTES} bytes a chat template may "
            "(files are read no further); not parsed")


def first_reach(tree: nodes.Template) -> str | None:
    """The first reach into Python internals in a parsed template, or None."""
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


class Worker:
    """Answers requests, keeping the last few templates parsed, checked and compiled (a serve
    request pays only for its render)."""

    def __init__(self) -> None:
        self.env = environment()
        self.checked: dict[str, str | None] = {}  # source -> first reach
        self.compiled: dict[str, Template] = {}

    def check(self, source: str) -> str | None:
        if source not in self.checked:
            if (why := oversize(source)) is not None:
                raise OverLimit(why)
            tree = self.env.parse(source)
            _remember(self.checked, source, first_reach(tree))
            if self.checked[source] is None:
                _remember(self.compiled, source, self.env.from_string(tree))
        return self.checked[source]

    def render(self, source: str, messages: Any, context: dict[str, Any], limit: int) -> str:
        reach = self.check(source)
        if reach is not None:
            raise SecurityError(f"the template reaches into Python internals ({reach})")
        template = self.compiled.get(source) or self.env.from_string(source)
        _remember(self.compiled, source, template)
        text = template.render(messages=messages, add_generation_prompt=True, **context)
        if len(text) > limit:
            raise OverLimit(f"the rendered prompt is over {limit} characters")
        return text

    def answer(self, request: dict[str, Any], size: int) -> dict[str, Any]:
        """The reply to one request (`size`: its length, which scales the output bound)."""
        if request["op"] == "check":
            return {"reach": self.check(request["source"])}
        text = self.render(request["source"], request["messages"], request["context"],
                           max(MAX_OUTPUT_CHARS, 4 * size))
        return {"text": text}


def _remember(cache: dict[str, Any], key: str, value: Any) -> None:
    cache.pop(key, None)
    cache[key] = value
    while len(cache) > CACHED_TEMPLATES:
        del cache[next(iter(cache))]


def failure(exc: BaseException) -> dict[str, Any]:
    """An exception as a reply: its type's name, message, plain arguments and line (what of
    them can be told: the template chose them, a huge integer among them)."""
    reply: dict[str, Any] = {"error": type(exc).__name__, "message": ""}
    try:
        message = exc.message if isinstance(exc, TemplateSyntaxError) else str(exc)
        reply["message"] = (message or "")[:2000]
        if all(isinstance(a, str) or _is_int(a) and abs(a) < 1 << 53 for a in exc.args):
            reply["args"] = [a[:2000] if isinstance(a, str) else a for a in exc.args]
        if _is_int(lineno := getattr(exc, "lineno", None)):
            reply["lineno"] = lineno
    except Exception:  # noqa: BLE001 (its message cannot be told; its type can)
        pass
    return reply


def _set_limit(which: int, soft: int) -> bool:
    try:
        _, hard = resource.getrlimit(which)
        resource.setrlimit(which, (soft if hard == resource.RLIM_INFINITY else min(soft, hard),
                                   hard))
        return True
    except (ValueError, OSError):
        return False


def limit_memory() -> None:
    """Bound the address space and the data segment. Linux enforces both; macOS accepts them but
    may not hold memory to either, and there the parent's wall clock (and the output
    bound) is what ends a render that allocates."""
    _set_limit(resource.RLIMIT_AS, MEMORY_BYTES)
    _set_limit(resource.RLIMIT_DATA, MEMORY_BYTES)


def limit_cpu(seconds: float) -> None:
    """SIGXCPU (whose default action ends the process) once this request has used `seconds`
    of CPU time, give or take a second: it ends the render even where the parent is gone."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _set_limit(resource.RLIMIT_CPU, int(usage.ru_utime + usage.ru_stime) + math.ceil(seconds) + 1)


def _send(out: BinaryIO, reply: dict[str, Any]) -> None:
    try:
        line = json.dumps(reply).encode("ascii") + b"\n"
    except MemoryError:
        line = b'{"error": "MemoryError", "message": ""}\n'
    out.write(line)
    out.flush()


def main() -> None:
    """Serve requests until stdin ends (the parent closed it, or exited)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _set_limit(resource.RLIMIT_CORE, 0)  # SIGXCPU would dump core
    limit_memory()
    out = os.fdopen(os.dup(1), "wb")
    worker = Worker()
    # Started (a failure so far shows on the parent's stderr): from here on, nothing else written
    # can garble the replies, and no pipe of the parent's (its stderr) is held past the parent.
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    _send(out, {"ready": True})
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            limit_cpu(float(request["seconds"]))
            reply = worker.answer(request, len(line))
        except MemoryError:
            reply = {"error": "MemoryError", "message": ""}
        except Exception as exc:  # the template's failure is the answer
            reply = failure(exc)
        _send(out, reply)


if __name__ == "__main__":
    main()
