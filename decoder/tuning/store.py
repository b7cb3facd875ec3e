"""The on-disk store under $MTPKIT_CACHE (cost curves, batch prices, the dtype probe, kernel
choices, warm-up markers): the one place that writes a cached document and the one that reads
one back.

What is read back is untrusted input (another version's file, a crash, a hand edit, a planted
one), and a cached number decides how every later run decodes: a `plain: 0` divided by zero, an
`Infinity` turned into NaN costs, all-NaN verify costs sent `--depth auto` to plain decoding.
So every document is read from a regular file of bounded size (never through a symlink),
parsed strictly (no NaN or Infinity) and validated against its schema
(schemas/cache_<kind>.schema.json: required keys, finite positive timings, bounded sizes)
before anything uses it. A bad one is ignored with one line on stderr naming the file and why,
and its caller measures again. Writes go to a temp file created exclusively in the target's
folder (mkstemp: O_EXCL, so a symlink planted at the temp name is refused, not followed) and
renamed over the target (a rename replaces a symlink at the target name, never writes through
it): concurrent processes never read half a file.

A document is found by what it was measured under (its key: weights, device, `versions`, ...),
hashed into its file name (`key_name`), so a changed key is a new file, never a stale read.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import jsonschema

from mtpkit.schemas import validate

MAX_BYTES = 4 << 20  # the largest cached document (kernel choices of many shapes: ~100 KB)


def root() -> Path:
    """$MTPKIT_CACHE, else $XDG_CACHE_HOME/mtpkit, else ~/.cache/mtpkit."""
    base = os.environ.get("MTPKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mtpkit")
    return Path(base)


def versions() -> dict[str, str | None]:
    """The versions a measurement depends on (part of every key: an upgrade measures again)."""
    out = {}
    for package in ("mlx", "mlx-lm", "mtpkit"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def key_name(key: dict[str, Any]) -> str:
    """A file name for what was measured under `key` (the cost curve, kernel choices, warm-ups)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def cache_dir() -> Path:
    """Where cost curves and batch prices live."""
    return root() / "costs"


def cache_file(key: dict[str, Any], suffix: str = ".json") -> Path:
    """Where what was measured under `key` is kept (the cost curve; `suffix` for others)."""
    return cache_dir() / f"{key_name(key)}{suffix}"


def batch_file(key: dict[str, Any]) -> Path:
    """Where `tune --max-batch`'s batch prices for a curve's `key` live, beside the curve."""
    return cache_file({**key, "kind": "batch"}, ".batch.json")


def say(line: str) -> None:
    """One line on stderr: why something cached was not used."""
    print(f"mtpkit: {line}", file=sys.stderr, flush=True)


def _reject(constant: str) -> Any:
    raise ValueError(f"{constant} is not a number JSON allows")


def read(path: Path, kind: str) -> Any | None:
    """The document at `path`, valid against schemas/cache_`kind`; None when there is none,
    or (saying so on stderr) when it is not a regular file, too large, not strict JSON or not
    valid: the caller measures again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        say(f"ignoring {path}: {exc.strerror or exc} (measuring again)")
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            if info.st_size > MAX_BYTES:
                raise ValueError(f"{info.st_size} bytes, over {MAX_BYTES}")
            doc = json.loads(fh.read(MAX_BYTES + 1).decode("utf-8"), parse_constant=_reject)
        validate(doc, f"cache_{kind}")
    except jsonschema.ValidationError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "the document"
        say(f"ignoring {path}: {where}: {exc.message[:200]} (measuring again)")
        return None
    except (OSError, ValueError, RecursionError) as exc:
        say(f"ignoring {path}: {str(exc)[:200] or type(exc).__name__} (measuring again)")
        return None
    return doc


def write(path: Path, doc: Any, kind: str) -> Path:
    """Write `doc` (valid against schemas/cache_`kind`: nothing is stored that a reader would
    refuse) to `path` atomically, through an exclusively created temp file in its folder."""
    validate(doc, f"cache_{kind}")
    text = json.dumps(doc, indent=1, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
