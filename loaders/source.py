"""Turn what the user typed (a folder, or a repo id in the local Hugging Face cache) into a
directory. Offline only: nothing is ever downloaded here."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class NotABundle(Exception):
    """The input is not a model folder at all (exit code 2 territory)."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


def resolve(source: str | Path) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise NotABundle(f"{source} is a file, not a model folder",
                         "pass the folder that holds config.json and the safetensors files")
    text = str(source)
    if REPO_ID.match(text):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return Path(snapshot_download(text, local_files_only=True))
        except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
            raise NotABundle(f"{text} is neither a folder nor a repo in the local Hugging Face "
                             f"cache ({type(exc).__name__})",
                             "download it first (hf download REPO) or pass a folder") from None
    raise NotABundle(f"{source}: no such folder", "pass a bundle folder or a cached repo id")


def looks_like_model(root: Path) -> bool:
    """A config.json or a .safetensors entry of any type: a FIFO or a link leading outside is
    still a model folder, for doctor to report (it is never opened here)."""
    return os.path.lexists(root / "config.json") or any(root.glob("*.safetensors"))
