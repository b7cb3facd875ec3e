"""Real-content loads for honest speed checks: text people wrote, present on every machine.

code: Python standard-library source to continue (raw text); memo: a technical memo asked for
from a module's documentation (chat); translation: a known English text to render in French and
polish (chat). Each request gets a fresh nonce so no prefix cache can help.

held_code / held_memo: the same kinds of load from standard-library documents that `mtpkit
graft`'s default corpus holds out, so a grafted head is timed on text it never trained on.

edit: a whole held-out module (the one nearest 2000 characters) followed by its first lines
again, to be continued (raw text): what an agent rewriting a file sends, where most of the
output repeats text already in the prompt.
"""

from __future__ import annotations

import codecs
import contextlib
import inspect
import io
import random
import sys
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtpkit.train.corpus import Document

DEFAULT_LOADS = ("code", "memo", "translation")
LOADS = (*DEFAULT_LOADS, "held_code", "held_memo", "edit")
MEMO_REQUEST = ("Write a short technical memo for engineers that explains what this module does "
                "and when to use it:\n\n")


@dataclass(frozen=True)
class Load:
    name: str
    text: str
    chat: bool

    def fresh(self, rng: random.Random | None = None) -> str:
        """The text behind a cache-busting nonce; from a seeded `rng`, the same nonces in the
        same order on every machine (two bundles compared on the same texts)."""
        nonce = uuid.uuid4().hex[:12] if rng is None else f"{rng.getrandbits(48):012x}"
        return f"[request {nonce}]\n{self.text}"


def _zen() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on first import; its text is ROT13 in this.s)
    return codecs.decode(sys.modules["this"].s, "rot13")


def real_loads(names: Iterable[str] = DEFAULT_LOADS) -> dict[str, Load]:
    """The named loads (reading the held-out ones scans the standard library: only on demand)."""
    names = tuple(names)
    loads = _default_loads()
    if set(names) - set(DEFAULT_LOADS):
        loads |= _held_out_loads()
    return {n: loads[n] for n in names if n in loads}


def _default_loads() -> dict[str, Load]:
    import json.decoder as code_source
    import shelve

    code = inspect.getsource(code_source)[:1800]
    memo = MEMO_REQUEST + (inspect.getdoc(shelve) or "")
    translation = ("Translate this text into French, then polish the French so it reads "
                   "naturally:\n\n" + _zen())
    return {"code": Load("code", code, False), "memo": Load("memo", memo, True),
            "translation": Load("translation", translation, True)}


def _held_out_loads() -> dict[str, Load]:
    """Code from the longest held-out module (1800 characters from its first top-level def or
    class, past any licence header) and a memo on the longest held-out docstring."""
    from mtpkit.train.corpus import held_out_documents, prose

    held = held_out_documents()
    source = max(held, key=lambda d: len(d.text)).text
    start = min((i for i in (source.find("\ndef "), source.find("\nclass ")) if i >= 0),
                default=-1) + 1
    doc = max((p for d in held for p in prose(d)), key=len)
    return {"held_code": Load("held_code", source[start:start + 1800], False),
            "held_memo": Load("held_memo", MEMO_REQUEST + doc[:1500], True),
            "edit": _edit_load(held)}


def _lines_upto(text: str, chars: int) -> str:
    """The whole lines of `text` that begin within its first `chars` characters."""
    end = text.find("\n", chars)
    return text if end < 0 else text[:end + 1]


def _edit_load(held: list[Document]) -> Load:
    """The held-out Python module nearest 2000 characters (whole lines, at most 2500), then its
    first lines (at least 300 characters) under a second header, for the model to go on."""
    doc = min((d for d in held if d.name.endswith(".py")),
              key=lambda d: (abs(len(d.text) - 2000), d.name))
    source = doc.text if len(doc.text) <= 2500 else doc.text[:doc.text.rfind("\n", 0, 2500) + 1]
    name = doc.name.split("/", 1)[-1]
    return Load("edit", f"# {name} (before)\n{source.rstrip()}\n\n# {name} (after)\n"
                        f"{_lines_upto(source, 300)}", False)
