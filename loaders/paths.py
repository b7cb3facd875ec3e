"""Paths inside an untrusted bundle: nothing the bundle names or links may lead outside it, and
nothing a loader opens may be anything but a regular file (a FIFO blocks the opener forever, a
link to /dev/zero never ends). Every check here is a stat; nothing is opened."""

from __future__ import annotations

import os
import stat
from fnmatch import fnmatchcase
from pathlib import Path

from mtpkit.loaders.findings import Finding, finding

# Names a loader opens without being told to: mlx-lm's trunk glob and MTP runtimes' sidecar
# names, config/generation config, the tokenizer's files (transformers picks them by the
# tokenizer class: vocab.txt, merges.txt, *.model, *.tiktoken, ...) and chat templates. A
# pattern, not a list of names, so a tokenizer class's own file name is covered too.
LOADED_PATTERNS = ("*.safetensors", "*.json", "*.jsonl", "*.jinja", "*.txt", "*.model",
                   "*.tiktoken", "*.py")
# Folders whose files loaders open: the MTPLX sidecar folder and extra chat templates.
LOADED_FOLDERS = ("mtp", "additional_chat_templates")

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a folder"))


def trusted_base(root: Path) -> Path:
    """Where a bundle's links may point: the folder itself, or for a Hugging Face cache
    snapshot (`models--org--name/snapshots/<rev>`) the cached repo, whose blobs/ it links to."""
    resolved = root.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent
    return resolved


def plain(relative: str) -> bool:
    """A relative path that names a place below root by its own text (no `/x`, `..`, NUL)."""
    return bool(relative) and not relative.startswith("/") and "\\" not in relative and (
        "\x00" not in relative) and ".." not in relative.split("/")


def utf8(name: str) -> bool:
    """Whether a name (from os.listdir, or a bundle's JSON) is valid UTF-8: bytes that are not
    come back from the OS as lone surrogates, which MLX's C++ and str.encode() refuse."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown(name: str) -> str:
    """A name printable whatever it holds (a byte that is not UTF-8 shown as \\udcNN)."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def inside(root: Path, relative: str) -> Path | None:
    """`root/relative` if it names a place inside root (no absolute paths, no `..`) and, links
    resolved, still lands inside the bundle's trusted base; else None."""
    if not plain(relative):
        return None
    try:
        candidate = (root / relative).resolve()
        candidate.relative_to(trusted_base(root))
    except (ValueError, OSError, RuntimeError):  # outside, or a link loop
        return None
    return root / relative


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def vet(root: Path, relative: str) -> tuple[Path | None, Finding | None]:
    """Whether a loader may open `root/relative`, decided by stat alone (a FIFO is never
    opened): (path, None) for a regular file inside the bundle; (None, None) when nothing is
    there; (None, finding) for a link leading outside (index.path_escape) or anything else
    that is not a regular file (files.not_regular), or a name that is not UTF-8
    (files.bad_name)."""
    path = root / relative
    if not plain(relative):
        return None, finding("index.path_escape", f"{relative!r} is not a path inside the "
                             "bundle; not read", relative)
    if not os.path.lexists(path):
        return None, None
    if not utf8(relative):
        return None, finding("files.bad_name", "not a UTF-8 file name; "
                             "MLX cannot open it (a loader given it aborts); not read",
                             shown(relative))
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a link loop (Python < 3.13)
        return None, finding("files.not_regular", f"{relative} is a link loop; not read",
                             relative)
    try:
        resolved.relative_to(trusted_base(root))
    except ValueError:
        return None, finding("index.path_escape", f"{relative} links outside the bundle (to "
                             f"{resolved}); not read", relative)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None, finding("files.not_regular", f"{relative} is a link to nothing "
                             f"({resolved}); not read", relative)
    except OSError as exc:
        return None, finding("files.not_regular", f"{relative} cannot be examined "
                             f"({exc.strerror}); not read", relative)
    if not stat.S_ISREG(mode):
        return None, finding("files.not_regular", f"{relative} is {_kind(mode)}, not a regular "
                             "file; a loader opening it would block or never finish. Not read",
                             relative)
    return path, None


def bundle_file(root: Path, name: str, findings: list[Finding]) -> Path | None:
    """The bundle's own file `name` if present and safe to read; a link leading outside the
    bundle (index.path_escape) or anything not a regular file (files.not_regular) is reported
    and not opened."""
    path, problem = vet(root, name)
    if problem is not None:
        findings.append(problem)
    return path


def loaded_names(root: Path) -> list[str]:
    """Every entry a loader may open by name, as relative paths: the top level's entries that
    match LOADED_PATTERNS, and the entries of LOADED_FOLDERS (when they are folders inside the
    bundle). Listed, never opened, whatever their type."""
    names = _matching(root, "")
    for folder in LOADED_FOLDERS:
        where = inside(root, folder)
        if where is not None and where.is_dir():
            names += _matching(where, folder + "/")
    return names


def _matching(folder: Path, prefix: str) -> list[str]:
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return []
    return [prefix + name for name in entries
            if any(fnmatchcase(name, p) for p in LOADED_PATTERNS)]


def audit(root: Path) -> list[Finding]:
    """A finding for every file a loader may open that is not a regular file inside the
    bundle, so doctor sees the same set of files the loaders will open, not a narrower one."""
    return [problem for name in loaded_names(root) if (problem := vet(root, name)[1])]
