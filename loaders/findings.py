"""The finding record every check produces; defaults come from schemas/finding_codes.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mtpkit.schemas import finding_codes

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


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


class UserError(Exception):
    """Bad input stated as one line: a stable code, what is wrong, and what to do about it."""

    def __init__(self, code: str, message: str, hint: str) -> None:
        super().__init__(message)
        self.code, self.hint = code, hint
