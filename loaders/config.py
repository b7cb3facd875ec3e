"""config.json: flat or nested (`text_config`), the MTP layer count, declared quantization.

Also the one reader every bundle JSON file goes through (read_json / parse_json): bundles are
untrusted, and json.load alone turns a 200,000-deep array into a RecursionError and a
5,000-digit integer into a ValueError deep inside whichever loader met it first."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpkit.loaders.families import family_for
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.paths import bundle_file

# Size bounds per file kind: the largest published tokenizer.json files are ~35 MB; configs,
# indexes, manifests and tokenizer configs are kilobytes to a few megabytes.
MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_SMALL_JSON_BYTES = 16 * 1024 * 1024
JSON_LIMITS = {"tokenizer.json": MAX_JSON_BYTES, "vocab.json": MAX_JSON_BYTES}
# Published bundle JSON nests under 10 levels; 100 stays below the Rust tokenizers parser's
# own limit (128), so whatever passes here parses there too.
MAX_JSON_DEPTH = 100
# Keys that carry the number of MTP layers, in the order readers look for them.
# The MTP layer count, by the names checkpoints give it (MiniMax-M3: num_mtp_modules).
MTP_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "num_mtp_modules")
# Special token ids transformers validates strictly (int, list of int or null) while loading
# the tokenizer; anything else is a StrictDataclassFieldValidationError there.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION_CONFIG = "generation_config.json"
_GENERATION_HINT = ("generation_config.json must be a JSON object whose eos_token_id is an "
                    "integer or a list of integers; fix or delete it")


class BundleJSONError(ValueError):
    """A bundle JSON file that is too large, nested too deep, holds an integer too long to
    convert, is not UTF-8 or is not JSON: one message, never a RecursionError."""


def _too_deep(value: Any, limit: int) -> bool:
    """Whether `value` nests deeper than `limit` containers (walked without recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def parse_json(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads for untrusted text; every failure is a BundleJSONError with a short message."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise BundleJSONError(f"not UTF-8 text (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise BundleJSONError(f"nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise BundleJSONError(f"not JSON: {exc}") from None
    except ValueError:  # int() of a literal past sys.get_int_max_str_digits()
        raise BundleJSONError(f"holds an integer of more than {sys.get_int_max_str_digits()} "
                              "digits") from None
    if _too_deep(value, max_depth):
        raise BundleJSONError(f"nested deeper than {max_depth} levels")
    return value


def read_bounded(path: Path, limit: int | None = None) -> bytes:
    """The bytes of `path`, refusing more than `limit` (by default its kind's bound) without
    reading past it: the size is what was read, not what stat claimed."""
    limit = limit or JSON_LIMITS.get(path.name, MAX_SMALL_JSON_BYTES)
    with open(path, "rb") as fh:
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        raise BundleJSONError(f"larger than {limit} bytes")
    return raw


def read_json(path: Path, limit: int | None = None) -> Any:
    """A bundle JSON file, bounded in size and depth; raises BundleJSONError (a ValueError) or
    OSError."""
    return parse_json(read_bounded(path, limit))


@dataclass
class ModelConfig:
    """The parts of config.json the checks need; `text` is the flat view text models read."""

    raw: dict[str, Any] = field(default_factory=dict)
    text: dict[str, Any] = field(default_factory=dict)
    model_type: str | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def num_mtp_layers(self) -> int:
        for key in MTP_COUNT_KEYS:
            value = self.text.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return 0

    @property
    def quantization(self) -> dict[str, Any] | None:
        """Declared trunk quantization: `quantization`, else `quantization_config` (mlx-lm's order)."""
        for key in ("quantization", "quantization_config"):
            for _, scope in scopes(self.raw):
                value = scope.get(key)
                if isinstance(value, dict) and "bits" in value:
                    return value
        return None

    @property
    def mtp_quantization(self) -> dict[str, Any] | None:
        value = self.raw.get("mtplx_mtp_quantization")
        return value if isinstance(value, dict) else None

    def dim(self, key: str) -> int | None:
        value = self.text.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    text = dict(raw)
    nested = raw.get("text_config")
    if isinstance(nested, dict):
        text.update(nested)
        text["model_type"] = raw.get("model_type")  # mlx-lm picks the class by the top level
    return text


def scopes(raw: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(key prefix, mapping) of the top level and of `text_config` where that is an object."""
    nested = raw.get("text_config")
    return [("", raw)] + ([("text_config.", nested)] if isinstance(nested, dict) else [])


# A module of mlx_lm.models is a model only where it defines or imports both names that
# mlx-lm's loader takes from it (base.py, cache.py, rope_utils.py ... are helpers).
_DEFINES = {name: re.compile(rf"^(?:class {name}\b|{name} = |from \S+ import "
                             rf"(?:\([^)]*|[^\n]*)\b{name}\b)", re.M)
            for name in ("Model", "ModelArgs")}


def _is_model_module(path: Path) -> bool:
    try:
        source = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return all(pattern.search(source) for pattern in _DEFINES.values())


def mlx_lm_supports(model_type: str) -> bool:
    """True when stock mlx-lm has a model class for `model_type` (directly or via its remapping).

    The module file is looked up and read without importing mlx-lm (only an unmatched name pays
    for importing mlx_lm.utils to consult its MODEL_REMAPPING table). A name that is not a
    Python identifier ("../utils") or names a helper module ("base") has no model class.
    """
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    models = Path(spec.submodule_search_locations[0]) / "models"
    if model_type.isidentifier() and (models / f"{model_type}.py").is_file():
        return _is_model_module(models / f"{model_type}.py")
    from mlx_lm.utils import MODEL_REMAPPING

    target = MODEL_REMAPPING.get(model_type)
    return isinstance(target, str) and target.isidentifier() and _is_model_module(
        models / f"{target}.py")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids_ok(value: Any) -> bool:
    """A special token id as transformers accepts it: an integer, a flat list of them, or null
    (range is checked against the embedding by the tokenizer checks)."""
    return value is None or _is_int(value) or (
        isinstance(value, list) and all(_is_int(v) for v in value))


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_fields(cfg: ModelConfig) -> None:
    """Fields the loaders take from config.json with a type they cannot take: each would be a
    traceback in transformers or mlx-lm (or code run from the bundle) instead of a finding."""
    add = cfg.findings.append
    raw = cfg.raw
    nested = raw.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        add(finding("config.invalid", "text_config must be an object", "config.json:text_config"))
    for prefix, scope in scopes(raw):
        for key in TOKEN_ID_KEYS:
            if not token_ids_ok(scope.get(key)):
                add(finding("config.invalid", f"{key} is {_short(scope[key])}; it must be a "
                            "token id (an integer), a list of them, or null",
                            f"config.json:{prefix}{key}"))
    arch = raw.get("architectures")
    if arch is not None and not isinstance(arch, str) and not (
            isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        add(finding("config.invalid", "architectures must be a list of class names",
                    "config.json:architectures"))
    model_file = raw.get("model_file")
    if model_file is not None:
        add(finding("config.invalid", f"model_file {_short(model_file)} asks the loader to "
                    "import and run Python code shipped in the bundle; mtpkit never does",
                    "config.json:model_file",
                    hint="use a bundle whose model_type mlx-lm implements itself"))


def _check_generation_config(root: Path, cfg: ModelConfig) -> None:
    """generation_config.json: mlx-lm reads it with every model load and takes its
    eos_token_id, so an unreadable one stops the load as surely as a bad config.json."""
    path = bundle_file(root, GENERATION_CONFIG, cfg.findings)
    if path is None:
        return
    add = cfg.findings.append
    try:
        data = read_json(path)
    except (ValueError, OSError) as exc:
        add(finding("config.invalid", f"{GENERATION_CONFIG} is unreadable: {exc}",
                    GENERATION_CONFIG, hint=_GENERATION_HINT))
        return
    if not isinstance(data, dict):
        add(finding("config.invalid", f"{GENERATION_CONFIG} is not a JSON object",
                    GENERATION_CONFIG, hint=_GENERATION_HINT))
    elif not token_ids_ok(data.get("eos_token_id")):
        add(finding("config.invalid", f"{GENERATION_CONFIG}'s eos_token_id is "
                    f"{_short(data['eos_token_id'])}; it must be a token id, a list of them, or "
                    "null", f"{GENERATION_CONFIG}:eos_token_id", hint=_GENERATION_HINT))


def read_config(root: Path) -> ModelConfig:
    cfg = ModelConfig()
    path = bundle_file(root, "config.json", cfg.findings)
    if path is None:
        cfg.findings.append(finding("files.missing_config", "no config.json", "config.json"))
        return cfg
    try:
        raw = read_json(path)
    except (ValueError, OSError) as exc:
        cfg.findings.append(finding("config.invalid", f"unreadable: {exc}", "config.json"))
        return cfg
    if not isinstance(raw, dict):
        cfg.findings.append(finding("config.invalid", "not a JSON object", "config.json"))
        return cfg
    cfg.raw, cfg.text = raw, _flatten(raw)
    _check_generation_config(root, cfg)
    model_type = cfg.text.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        cfg.findings.append(finding("config.invalid", "model_type is missing", "config.json"))
        return cfg
    cfg.model_type = model_type
    for key in ("hidden_size", family_for(model_type).layers_key, "vocab_size"):
        if cfg.dim(key) is None or cfg.dim(key) <= 0:
            cfg.findings.append(finding("config.invalid", f"{key} must be a positive integer",
                                        f"config.json:{key}"))
    _check_fields(cfg)
    if not mlx_lm_supports(model_type):
        cfg.findings.append(finding("config.unknown_model_type",
                                    f"model_type {_short(model_type)} has no mlx-lm model class",
                                    "config.json:model_type"))
    return cfg
