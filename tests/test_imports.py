"""No import cycle anywhere in the package.

A cycle makes import order matter (a name read before its module finished loading) and hides
layering: it is how the on-disk store came to live in the cost measurer and close an 8-module
loop. Python forgives a cycle made of TYPE_CHECKING imports or imports inside functions, so the
graph here counts every import statement, wherever it stands, read from the source's AST (nothing
is imported: mlx stays unloaded).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package `mtpkit`
PACKAGE = "mtpkit"
OUTSIDE = {"tests", "bench"}  # in the repository, not in the wheel


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name: the root's files and every folder with an
    `__init__.py` below it (a package's `__init__` under the package's own name)."""
    found: dict[str, Path] = {}

    def walk(folder: Path, name: str) -> None:
        for path in sorted(folder.glob("*.py")):
            found[name if path.stem == "__init__" else f"{name}.{path.stem}"] = path
        for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").is_file()):
            if folder != ROOT or sub.name not in OUTSIDE:
                walk(sub, f"{name}.{sub.name}")

    walk(ROOT, PACKAGE)
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports anywhere in its source. `from P import n` names the
    module P.n where there is one, else P; a parent package's `__init__` that Python runs first
    is not an edge unless named."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    out: set[str] = set()

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [owner(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else owner(base)
                       for a in node.names]
        else:
            continue
        out.update(t for t in targets if t is not None and t != name)
    return out


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: each is one or more cycles
    (Tarjan's algorithm, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return groups


def loop(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first inside it), in
    import order, ending where it began."""
    first = min(group)
    came: dict[str, str] = {}
    frontier = [first]
    while frontier:
        ahead = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(came[path[-1]])
                    return [*reversed(path), first]
                if nxt not in came:
                    came[nxt] = node
                    ahead.append(nxt)
        frontier = ahead
    raise AssertionError(f"no cycle in component {sorted(group)}")


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def test_the_scan_sees_every_kind_of_import() -> None:
    """The scan is only as good as what it reads: the TYPE_CHECKING and function-level edges
    that made the decoder's cycle, and the package's modules, are all in it."""
    edges = graph()
    assert {"mtpkit.cli", "mtpkit.decoder.runner", "mtpkit.serve.worker"} <= set(edges)
    assert "mtpkit.decoder.runner" in edges["mtpkit"]  # imported inside __getattr__
    assert not any(name.startswith(("mtpkit.tests", "mtpkit.bench")) for name in edges)


def test_cycles_are_found_and_named() -> None:
    edges = {"a": {"b", "d"}, "b": {"c"}, "c": {"a", "b"}, "d": set(), "e": {"e"}}
    assert components(edges) == [{"a", "b", "c"}]
    assert loop(edges, {"a", "b", "c"}) == ["a", "b", "c", "a"]


def test_no_import_cycle() -> None:
    edges = graph()
    found = [f"{' -> '.join(loop(edges, group))} (of {len(group)} modules: "
             f"{', '.join(sorted(group))})" for group in components(edges)]
    assert not found, "import cycles:\n" + "\n".join(found)
