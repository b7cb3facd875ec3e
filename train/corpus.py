"""Text for grafting an MTP head: by default the Python standard library's source — code and
the docstrings people wrote — which is on every machine and needs no network.

Documents are split by a hash of their name, so held-out text (code and prose) is never trained
on, whatever the corpus.
"""

from __future__ import annotations

import ast
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
HELD_OUT_EVERY = 10  # one document in ten is held out


@dataclass(frozen=True)
class Document:
    name: str
    text: str

    @property
    def held_out(self) -> bool:
        return zlib.crc32(self.name.encode()) % HELD_OUT_EVERY == 0


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_documents(paths: list[Path] | None = None) -> list[Document]:
    """Documents from files/folders (text files only, each at most 4 MiB, undecodable skipped);
    None means the standard library's source without its test suites and site-packages."""
    docs = []
    roots = paths or [stdlib_root()]
    for root in roots:
        for path in _files(root):
            rel = path.relative_to(root) if path != root else Path(path.name)
            if paths is None and ({"site-packages", "test", "tests", "idlelib"} & set(rel.parts)):
                continue
            if path.stat().st_size > MAX_DOCUMENT_BYTES:
                continue
            try:
                text = path.read_text("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                docs.append(Document(f"{root.name}/{rel.as_posix()}", text))
    return docs


def split_documents(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents; a corpus too small to hold one out by name still holds
    out its last document."""
    held = [d for d in docs if d.held_out] or docs[-1:]
    return [d for d in docs if d not in held], held


def held_out_documents() -> list[Document]:
    """The standard-library documents the default corpus never trains on."""
    return split_documents(read_documents())[1]


def prose(doc: Document, min_chars: int = 200) -> list[str]:
    """Docstrings of a Python document long enough to be prose a person wrote."""
    try:
        tree = ast.parse(doc.text)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(
        n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))]
    found = (ast.get_docstring(n) for n in nodes)
    return [d for d in found if d and len(d) >= min_chars]


def _starts(total: int, seq_len: int) -> np.ndarray:
    """Where each window of seq_len + 2 tokens starts in a stream of `total` tokens."""
    return np.arange(0, total - (seq_len + 2), seq_len)


def window_count(ids: list[list[int]], seq_len: int) -> int:
    """How many distinct windows `sequences` cycles through."""
    return len(_starts(sum(len(d) for d in ids), seq_len))


def sequences(ids: list[list[int]], seq_len: int, seed: int) -> Iterator[np.ndarray]:
    """Endless shuffled windows of seq_len + 2 tokens (input, next and next-next targets) over
    the concatenated documents; deterministic for a seed."""
    stream = np.concatenate([np.asarray(d, dtype=np.int32) for d in ids if d])
    span = seq_len + 2
    starts = _starts(len(stream), seq_len)
    if len(starts) == 0:
        raise ValueError(f"corpus too small: {len(stream)} tokens for windows of {span}")
    rng = np.random.default_rng(seed)
    while True:
        for start in rng.permutation(starts):
            yield stream[start:start + span]
