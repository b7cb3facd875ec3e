"""The finding record every check produces; defaults come from schemas/finding_codes.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mtpkit.schemas import finding_codes

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
# Which findings cause which: a file no loader may open leaves weights missing, a damaged
# shard leaves modules incomplete, a wrong config contradicts the tensors; an entry that
# refuses a bundle names the earliest cause, not its consequences.
ROOT_ORDER = ("files.not_regular", "index.path_escape", "files.", "index.", "safetensors.",
              "config.", "tokenizer.", "quant.", "mtp.", "drafter.", "template.", "manifest.",
              "weights.")


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    message: str
    location: str
    hint: str
    fixable: bool

    def to_dict(self) -> dict:
        return asdict(self)


def finding(
    code: str,
    message: str,
    location: str = "",
    *,
    severity: str | None = None,
    hint: str | None = None,
    fixable: bool | None = None,
) -> Finding:
    """Build a Finding, taking severity/hint/fixable from the catalog unless overridden.

    An unknown code is a programming error, so it raises rather than inventing a code.
    """
    entry = finding_codes()[code]
    return Finding(
        code=code,
        severity=severity or entry["severity"],
        message=message,
        location=location,
        hint=hint or entry["hint"],
        fixable=entry["fixable"] if fixable is None else fixable,
    )


def root_rank(f: Finding) -> int:
    """Sort key putting root causes first (ROOT_ORDER)."""
    return next((i for i, prefix in enumerate(ROOT_ORDER) if f.code.startswith(prefix)),
                len(ROOT_ORDER))


class UserError(Exception):
    """Bad input stated as one line: a stable code, what is wrong, and what to do about it."""

    def __init__(self, code: str, message: str, hint: str) -> None:
        super().__init__(message)
        self.code, self.hint = code, hint
