"""Real-content loads for honest speed checks: text people wrote, present on every machine.

code: Python standard-library source to continue (raw text); memo: a technical memo asked for
from a module's documentation (chat); translation: a known English text to render in French and
polish (chat). Each request gets a fresh nonce so no prefix cache can help.
"""

from __future__ import annotations

import codecs
import contextlib
import inspect
import io
import sys
import uuid
from dataclasses import dataclass

LOADS = ("code", "memo", "translation")


@dataclass(frozen=True)
class Load:
    name: str
    text: str
    chat: bool

    def fresh(self) -> str:
        """The text behind a cache-busting nonce."""
        return f"[request {uuid.uuid4().hex[:12]}]\n{self.text}"


def _zen() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on first import; its text is ROT13 in this.s)
    return codecs.decode(sys.modules["this"].s, "rot13")


def real_loads() -> dict[str, Load]:
    import json.decoder as code_source
    import shelve

    code = inspect.getsource(code_source)[:1800]
    memo = ("Write a short technical memo for engineers that explains what this module does and "
            "when to use it:\n\n" + (inspect.getdoc(shelve) or ""))
    translation = ("Translate this text into French, then polish the French so it reads "
                   "naturally:\n\n" + _zen())
    return {"code": Load("code", code, False), "memo": Load("memo", memo, True),
            "translation": Load("translation", translation, True)}
