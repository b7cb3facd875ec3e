"""JSON Schemas for every document mtpkit prints or writes, and the finding-code catalog.

The catalog (finding_codes.json) is the single source of code names, default severities,
hints and fixability; the doctor report schema checks the shape of each finding.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import jsonschema


@cache
def load_schema(name: str) -> dict[str, Any]:
    """Load schemas/<name>.schema.json (cached; the files ship inside the package)."""
    text = resources.files(__name__).joinpath(f"{name}.schema.json").read_text("utf-8")
    return json.loads(text)


@cache
def finding_codes() -> dict[str, dict[str, Any]]:
    """The finding-code catalog: code -> {severity, fixable, hint}."""
    return json.loads(resources.files(__name__).joinpath("finding_codes.json").read_text("utf-8"))


def validate(document: Any, name: str) -> None:
    """Raise jsonschema.ValidationError when `document` does not match schema `name`."""
    jsonschema.validate(document, load_schema(name), cls=jsonschema.Draft202012Validator)
