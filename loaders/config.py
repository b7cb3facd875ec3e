"""config.json: flat or nested (`text_config`), the MTP layer count, declared quantization."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.paths import bundle_file

MAX_JSON_BYTES = 64 * 1024 * 1024
# Keys that carry the number of MTP layers, in the order readers look for them.
MTP_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
QUANT_PARAM_KEYS = {"group_size", "bits", "mode", "global_scale"}


def read_json(path: Path) -> Any:
    """json.load with a size bound; raises ValueError on oversize or bad JSON."""
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_JSON_BYTES} bytes")
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


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
            for scope in (self.raw, self.raw.get("text_config") or {}):
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


def mlx_lm_supports(model_type: str) -> bool:
    """True when stock mlx-lm has a model class for `model_type` (directly or via its remapping).

    The module file is looked up without importing mlx-lm; only an unmatched name pays for
    importing mlx_lm.utils to consult its MODEL_REMAPPING table.
    """
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    models = Path(spec.submodule_search_locations[0]) / "models"
    if (models / f"{model_type}.py").is_file():
        return True
    from mlx_lm.utils import MODEL_REMAPPING

    target = MODEL_REMAPPING.get(model_type)
    return target is not None and (models / f"{target}.py").is_file()


def read_config(root: Path) -> ModelConfig:
    cfg = ModelConfig()
    path = bundle_file(root, "config.json", cfg.findings)
    if path is None:
        cfg.findings.append(finding("files.missing_config", "no config.json", "config.json"))
        return cfg
    try:
        raw = read_json(path)
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        cfg.findings.append(finding("config.invalid", f"unreadable: {exc}", "config.json"))
        return cfg
    if not isinstance(raw, dict):
        cfg.findings.append(finding("config.invalid", "not a JSON object", "config.json"))
        return cfg
    cfg.raw, cfg.text = raw, _flatten(raw)
    model_type = cfg.text.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        cfg.findings.append(finding("config.invalid", "model_type is missing", "config.json"))
        return cfg
    cfg.model_type = model_type
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if cfg.dim(key) is None or cfg.dim(key) <= 0:
            cfg.findings.append(finding("config.invalid", f"{key} must be a positive integer",
                                        f"config.json:{key}"))
    if not mlx_lm_supports(model_type):
        cfg.findings.append(finding("config.unknown_model_type",
                                    f"model_type {model_type!r} has no mlx-lm model class",
                                    "config.json:model_type"))
    return cfg
