"""The error every writer under convert/ raises for input it cannot convert (its own module,
so the GGUF importer and the converter that calls it do not import each other)."""

from __future__ import annotations

from mtpkit.loaders.findings import UserError


class ConvertError(UserError):
    """A source that cannot be converted as asked."""
