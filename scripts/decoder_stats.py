"""decoder/'s structure against issue 50's targets: lines, long functions, numeric constants, anecdotes.

Usage: python scripts/decoder_stats.py [DIR]   (DIR defaults to this repository's decoder/)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

LONG = 60
# a machine, or a figure measured on one (tok/s and ms with a number: not the units named alone)
ANECDOTE = re.compile(
    r"H100|H200|\bM[1-5] (?:Max|Pro|Ultra)\b|\bGB10\b|\d\s?tok/s|\d(?:\.\d+)?\s?ms\b|SmolLM2.s .*took"
)


def _numeric(node: ast.expr) -> bool:
    """A numeric literal, or an expression or tuple built only of them (no names, no calls)."""
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    if isinstance(node, ast.Tuple | ast.List):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    return False


def _constants(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            pairs = [(t, value)]
            if isinstance(t, ast.Tuple) and isinstance(value, ast.Tuple) and len(t.elts) == len(value.elts):
                pairs = list(zip(t.elts, value.elts, strict=True))  # A, B = 1, 2: two constants
            names += [n.id for n, v in pairs
                      if isinstance(n, ast.Name) and n.id.lstrip("_").isupper() and _numeric(v)]
    return names


def _long_functions(tree: ast.Module) -> list[tuple[str, int]]:
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                length = child.end_lineno - child.lineno + 1
                if child.decorator_list:
                    length += child.lineno - child.decorator_list[0].lineno
                if length > LONG:
                    found.append((prefix + child.name, length))
                walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")

    walk(tree, "")
    return found


def stats(root: Path) -> dict:
    lines, long_functions, constants, anecdotes = 0, [], [], []
    for path in sorted(root.glob("**/*.py")):
        text = path.read_text()
        rel = path.relative_to(root.parent).as_posix()
        lines += len(text.splitlines())
        tree = ast.parse(text)
        long_functions += [(f"{rel}:{name}", n) for name, n in _long_functions(tree)]
        constants += [f"{rel}:{name}" for name in _constants(tree)]
        anecdotes += [
            f"{rel}:{i}: {line.strip()}"
            for i, line in enumerate(text.splitlines(), 1)
            if ANECDOTE.search(line)
        ]
    return {"lines": lines, "long_functions": long_functions, "constants": constants, "anecdotes": anecdotes}


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "decoder"
    s = stats(root)
    print(f"lines: {s['lines']}")
    print(f"functions over {LONG} lines: {len(s['long_functions'])}")
    for name, n in s["long_functions"]:
        print(f"  {n:4d} {name}")
    print(f"numeric module-level constants: {len(s['constants'])}")
    for name in s["constants"]:
        print(f"  {name}")
    print(f"machine anecdotes: {len(s['anecdotes'])}")
    for line in s["anecdotes"]:
        print(f"  {line}")


if __name__ == "__main__":
    main()
