"""sha256 of a file, streamed in 16 MiB blocks (bounded memory)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path


def sha256_file(path: Path, advance: Callable[[int], None] = lambda n: None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(16 << 20):
            digest.update(block)
            advance(len(block))
    return digest.hexdigest()
