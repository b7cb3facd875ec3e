"""Tokenizer files: present, parseable, ids inside the embedding, special tokens in the vocab.

The files are untrusted input to transformers and tokenizers, which meet a wrong type with a
TypeError from deep inside, and to transformers' `auto_map`, which imports Python files shipped
beside them. Everything they would trip on is checked here, so doctor reports it first; and the
one place that loads the tokenizer for running (load_wrapper) never runs bundle code and turns
whatever still goes wrong into one UserError.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpkit.loaders.config import (
    ModelConfig,
    parse_json,
    read_bounded,
    read_json,
    scopes,
    token_ids_ok,
)
from mtpkit.loaders.findings import Finding, UserError, finding
from mtpkit.loaders.paths import bundle_file
from mtpkit.loaders.safetensors_header import TensorInfo
from mtpkit.loaders.templates import CHAT_MARKERS

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
# Every special token transformers reads from tokenizer_config.json: a string, an AddedToken
# object or null, or it raises TypeError.
ALL_SPECIAL_KEYS = (*SPECIAL_KEYS, "sep_token", "cls_token", "mask_token")
# The keyword arguments of tokenizers' AddedToken; transformers calls AddedToken(**entry).
ADDED_TOKEN_KEYS = {"content", "single_word", "lstrip", "rstrip", "normalized", "special"}
# tokenizer_config.json keys mlx-lm imports mlx_lm.<package>.<value> for.
MLX_LM_MODULE_KEYS = {"chat_template_type": "chat_templates", "tool_parser_type": "tool_parsers"}
# Legacy files transformers still reads beside tokenizer_config.json.
LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
MAX_TOKEN_ID = 2**32 - 1  # tokenizers keeps ids as u32
# Findings that stop the tokenizer from loading at all (load_wrapper refuses them up front).
UNLOADABLE = ("tokenizer.invalid", "tokenizer.remote_code")
CONFIG_HINT = ("tokenizer_config.json must be an object in the shape transformers reads; copy it "
               "again from the source model")
LEGACY_HINT = ("transformers reads this legacy file when tokenizer_config.json has no "
               "added_tokens_decoder; delete it or copy it again from the source model")
LOAD_HINT = ("mtpkit doctor BUNDLE names the file at fault; copy the tokenizer files again from "
             "the source model")


@dataclass
class TokenizerReport:
    kind: str | None = None  # tokenizer.json | tokenizer.model | vocab.json
    vocab: dict[str, int] = field(default_factory=dict)
    max_id: int | None = None
    embedding_rows: int | None = None
    config: dict[str, Any] = field(default_factory=dict)  # tokenizer_config.json
    findings: list[Finding] = field(default_factory=list)

    @property
    def chat_markers(self) -> bool:
        return any(m in self.vocab for m in CHAT_MARKERS)

    def special_tokens(self) -> dict[str, str]:
        """Special token strings for template rendering (bos_token=..., eos_token=...)."""
        out = {}
        for key in SPECIAL_KEYS:
            value = self.config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": len(self.vocab) or None, "max_id": self.max_id,
                "embedding_rows": self.embedding_rows, "chat_format": self.chat_markers}


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _vocab_of(data: dict[str, Any]) -> dict[str, int]:
    """Token -> id of a tokenizer.json that passed _tokenizer_json_problem."""
    vocab = data["model"].get("vocab")
    out: dict[str, int] = {}
    if isinstance(vocab, dict):
        out = dict(vocab)
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], id = position
        out = {e[0]: i for i, e in enumerate(vocab)}
    for tok in data.get("added_tokens") or []:
        out[tok["content"]] = tok["id"]
    return out


def _added_token_ok(entry: Any) -> bool:
    """An AddedToken object as transformers builds it: AddedToken(**entry)."""
    return isinstance(entry, dict) and isinstance(entry.get("content"), str) and set(
        entry) <= ADDED_TOKEN_KEYS and all(isinstance(v, bool) for k, v in entry.items()
                                           if k != "content")


def _unigram_ok(vocab: Any) -> bool:
    return isinstance(vocab, list) and all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
        and isinstance(e[1], (int, float)) and not isinstance(e[1], bool) for e in vocab)


def _merges_problem(merges: Any, vocab: dict[str, Any]) -> str | None:
    """BPE merges as tokenizers reads them: 'a b' strings or [a, b] pairs, both in the vocab."""
    if not isinstance(merges, list):
        return f"model.merges is {_short(merges)}; it must be a list"
    for i, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else merge
        if not (isinstance(parts, list) and len(parts) == 2
                and all(isinstance(p, str) for p in parts)):
            return (f"model.merges[{i}] is {_short(merge)}; a merge is \"a b\" or [\"a\", \"b\"]")
        missing = next((p for p in parts if p not in vocab), None)
        if missing is not None:
            return f"model.merges[{i}] names {_short(missing)}, which is not in model.vocab"
    return None


def _tokenizer_json_problem(data: Any) -> tuple[str, str] | None:
    """(message, location) of the first shape transformers or tokenizers cannot take."""
    where = "tokenizer.json"
    if not isinstance(data, dict):
        return "not a JSON object", where
    added = data.get("added_tokens")
    if added is not None and not (isinstance(added, list) and all(
            isinstance(t, dict) and _is_id(t.get("id"))
            and _added_token_ok({k: v for k, v in t.items() if k != "id"}) for t in added)):
        return (f"added_tokens is {_short(added)}; it must be a list of AddedToken objects "
                "(an integer id, a string content, boolean flags)", f"{where}:added_tokens")
    model = data.get("model")
    if not isinstance(model, dict):
        return "model must be an object", f"{where}:model"
    kind, vocab = model.get("type"), model.get("vocab")
    if kind is not None and not isinstance(kind, str):
        return f"model.type is {_short(kind)}; it must be a string", f"{where}:model.type"
    if kind == "Unigram" or (kind is None and isinstance(vocab, list)):
        if not _unigram_ok(vocab):
            return ("model.vocab of a Unigram model must be a list of [piece, score] pairs",
                    f"{where}:model.vocab")
    elif not (isinstance(vocab, dict) and all(_is_id(v) for v in vocab.values())):
        return ("model.vocab must map token strings to integer ids (0 to 2^32-1)",
                f"{where}:model.vocab")
    if "merges" in model and isinstance(vocab, dict):
        problem = _merges_problem(model["merges"], vocab)
        if problem:
            return problem, f"{where}:model.merges"
    return None


def _tokenizers_refuses(text: str) -> str | None:
    """What the tokenizers library says when building the tokenizer from tokenizer.json fails
    (a pre-tokenizer, normalizer or decoder it has no variant for ...), or None."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        Tokenizer.from_str(text)
    except BaseException as exc:  # pyo3 raises a Rust panic as PanicException(BaseException)
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return None


def _config_problems(tc: dict[str, Any]) -> list[Finding]:
    """tokenizer_config.json fields transformers or mlx-lm would fail on while loading."""
    out: list[Finding] = []

    def bad(key: str, message: str) -> None:
        out.append(finding("tokenizer.invalid", message, f"tokenizer_config.json:{key}",
                           hint=CONFIG_HINT))

    for key in ALL_SPECIAL_KEYS:
        value = tc.get(key)
        if not (value is None or isinstance(value, str) or (
                isinstance(value, dict) and isinstance(value.get("content"), str))):
            bad(key, f"{key} is {_short(value)}; a special token is a string, an AddedToken "
                "object or null")
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = tc.get(key)
        if not (value is None or (isinstance(value, dict) and key == "extra_special_tokens") or (
                isinstance(value, list) and all(isinstance(t, str) or (isinstance(
                    t, dict) and isinstance(t.get("content"), str)) for t in value))):
            bad(key, f"{key} is {_short(value)}; it must be a list of special tokens")
    for key in ("padding_side", "truncation_side"):
        if tc.get(key) not in (None, "left", "right"):
            bad(key, f"{key} is {_short(tc[key])}; it must be \"left\" or \"right\"")
    names = tc.get("model_input_names")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str)
                                                                   for n in names)):
        bad("model_input_names", "model_input_names must be a list of names")
    cls = tc.get("tokenizer_class")
    if cls is not None and not isinstance(cls, str):
        bad("tokenizer_class", f"tokenizer_class is {_short(cls)}; it must be a class name")
    decoder = tc.get("added_tokens_decoder")
    if decoder is not None and not (isinstance(decoder, dict) and all(
            k.isdigit() and _added_token_ok(v) for k, v in decoder.items())):
        bad("added_tokens_decoder", "added_tokens_decoder must map token ids to AddedToken "
            "objects (content, single_word, lstrip, rstrip, normalized, special)")
    for key, package in MLX_LM_MODULE_KEYS.items():
        value = tc.get(key)
        if value is not None and not _mlx_lm_module(package, value):
            bad(key, f"{key} is {_short(value)}, which names no module of mlx_lm.{package}")
    auto_map = tc.get("auto_map")
    if auto_map is not None and not _auto_map_ok(auto_map):
        bad("auto_map", "auto_map must be an object whose AutoTokenizer entry is [slow, fast] "
            "class names")
    return out


def _mlx_lm_module(package: str, name: Any) -> bool:
    """Whether mlx-lm's importlib.import_module(f"mlx_lm.{package}.{name}") finds a module."""
    if not isinstance(name, str) or not name.isidentifier():
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return True  # cannot tell without mlx-lm; loading will say
    return (Path(spec.submodule_search_locations[0]) / package / f"{name}.py").is_file()


def _auto_map_ok(auto_map: Any) -> bool:
    """The shapes transformers indexes without a TypeError: a legacy [slow, fast] list, or an
    object whose AutoTokenizer is one."""
    entry = auto_map if isinstance(auto_map, list) else (
        auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else 0)
    return entry is None or (isinstance(entry, list) and len(entry) == 2 and all(
        e is None or isinstance(e, str) for e in entry) and any(entry))


def _class_refs(value: Any) -> list[str]:
    """The "module.Class" strings of an auto_map (any nesting of lists and objects)."""
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [ref for item in items for ref in _class_refs(item)]


def _modules(auto_map: Any) -> str:
    """The Python files an auto_map would import: 'evil.py', or 'mod.py of org/repo'."""
    names = []
    for ref in _class_refs(auto_map):
        repo, _, ref = ref.rpartition("--")
        module = ref.rpartition(".")[0] or ref
        names.append(f"{module}.py" + (f" of {repo}" if repo else ""))
    names = list(dict.fromkeys(names))
    shown = ", ".join(_short(n) for n in names[:3]) or "its code"
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _builtin_tokenizer(cfg: ModelConfig, tc: dict[str, Any]) -> bool:
    """Whether transformers' AutoTokenizer, refused remote code, still has a class of its own:
    one tokenizer_config.json names, or one registered for config.json's model_type (the
    checks of its has_local_code). Imports transformers, so only asked when auto_map is set."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
            TOKENIZER_MAPPING_NAMES,
            tokenizer_class_from_name,
        )
    except ImportError:
        return True  # cannot tell; the loader's own refusal is reported when it happens
    name = tc.get("tokenizer_class")
    if isinstance(name, str) and name:
        base = name.removesuffix("Fast")
        if tokenizer_class_from_name(base) or tokenizer_class_from_name(base + "Fast"):
            return True
    model_type = cfg.raw.get("model_type")
    return isinstance(model_type, str) and (
        model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        or (model_type in CONFIG_MAPPING_NAMES and model_type in TOKENIZER_MAPPING_NAMES))


def _remote_code(cfg: ModelConfig, tc: dict[str, Any]) -> list[Finding]:
    """auto_map in tokenizer_config.json or config.json: code the bundle wants run. mtpkit loads
    with trust_remote_code=False, so it never runs; an error where the tokenizer then has no
    class to load with, a warning where transformers' own class takes over."""
    out = []
    if tc.get("auto_map") is not None and _auto_map_ok(tc["auto_map"]):
        entry = tc["auto_map"] if isinstance(tc["auto_map"], list) else \
            tc["auto_map"].get("AutoTokenizer")
        loads = entry is None or _builtin_tokenizer(cfg, tc)
        out.append(finding(
            "tokenizer.remote_code", f"auto_map asks to run {_modules(tc['auto_map'])} from "
            "the bundle to build the tokenizer; mtpkit never runs it, " + (
                "and transformers' own class loads the tokenizer instead" if loads else
                "and transformers has no class of its own for this tokenizer, so it cannot "
                "load"), "tokenizer_config.json:auto_map", severity=None if loads else "error"))
    if cfg.raw.get("auto_map") is not None:
        out.append(finding(
            "tokenizer.remote_code", f"auto_map asks to run {_modules(cfg.raw['auto_map'])} "
            "from the bundle for the config and model classes; mtpkit never runs it (mlx-lm "
            "builds the model from model_type)", "config.json:auto_map"))
    return out


def _special_ok(key: str, value: Any) -> bool:
    """A special_tokens_map.json entry: a string, AddedToken object or null, or a list of
    them (extra_special_tokens may also be an object of model-specific names)."""
    if value is None or isinstance(value, str):
        return True
    if isinstance(value, dict):
        return key == "extra_special_tokens" or _added_token_ok(value)
    return isinstance(value, list) and all(isinstance(t, str) or _added_token_ok(t) for t in value)


def _legacy_files(root: Path, tc: dict[str, Any], findings: list[Finding]) -> None:
    """special_tokens_map.json and added_tokens.json, which transformers json.loads as objects
    when tokenizer_config.json has no added_tokens_decoder."""
    if "added_tokens_decoder" in tc:
        return
    for name in LEGACY_FILES:
        path = bundle_file(root, name, findings)
        if path is None:
            continue
        try:
            data = read_json(path)
        except (ValueError, OSError) as exc:
            findings.append(finding("tokenizer.invalid", f"unreadable: {exc}", name,
                                    hint=LEGACY_HINT))
            continue
        if not isinstance(data, dict):
            findings.append(finding("tokenizer.invalid", f"{name} is not a JSON object", name,
                                    hint=LEGACY_HINT))
        elif name == "added_tokens.json" and not all(_is_id(v) for v in data.values()):
            findings.append(finding("tokenizer.invalid", f"{name} must map token strings to "
                                    "ids", name, hint=LEGACY_HINT))
        elif name == "special_tokens_map.json" and not all(
                _special_ok(k, v) for k, v in data.items()):
            findings.append(finding("tokenizer.invalid", f"{name}: special tokens must be "
                                    "strings or AddedToken objects", name, hint=LEGACY_HINT))


def embedding_rows(trunk: dict[str, TensorInfo]) -> int | None:
    for name, info in trunk.items():
        if name.endswith("embed_tokens.weight") and "mtp" not in name and info.shape:
            return info.shape[0]
    return None


def _read_tokenizer_json(path: Path, rep: TokenizerReport) -> bool:
    """Fill rep.vocab from tokenizer.json; False (with a finding) when it cannot be used."""
    add = rep.findings.append
    try:
        raw = read_bounded(path)
        data = parse_json(raw)
    except (ValueError, OSError) as exc:
        add(finding("tokenizer.invalid", f"unreadable: {exc}", "tokenizer.json"))
        return False
    problem = _tokenizer_json_problem(data)
    if problem is None:
        refused = _tokenizers_refuses(raw.decode("utf-8"))
        problem = refused and (f"the tokenizers library cannot build it: {refused}",
                               "tokenizer.json")
    if problem:
        add(finding("tokenizer.invalid", *problem))
        return False
    rep.vocab = _vocab_of(data)
    if not rep.vocab:
        add(finding("tokenizer.invalid", "no vocabulary in model.vocab", "tokenizer.json"))
        return False
    return True


def check_tokenizer(root: Path, cfg: ModelConfig, trunk: dict[str, TensorInfo]) -> TokenizerReport:
    rep = TokenizerReport(embedding_rows=embedding_rows(trunk))
    add = rep.findings.append
    tc_path = bundle_file(root, "tokenizer_config.json", rep.findings)
    if tc_path is not None:
        try:
            tc = read_json(tc_path)
        except (ValueError, OSError) as exc:
            add(finding("tokenizer.invalid", f"unreadable: {exc}", "tokenizer_config.json",
                        hint=CONFIG_HINT))
        else:
            if isinstance(tc, dict):
                rep.config = tc
                rep.findings += _config_problems(tc)
            else:
                add(finding("tokenizer.invalid", "tokenizer_config.json is not a JSON object",
                            "tokenizer_config.json", hint=CONFIG_HINT))
    rep.findings += _remote_code(cfg, rep.config)
    _legacy_files(root, rep.config, rep.findings)
    files = {n: bundle_file(root, n, rep.findings)
             for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")}
    if files["tokenizer.json"]:
        rep.kind = "tokenizer.json"
        if not _read_tokenizer_json(files["tokenizer.json"], rep):
            return rep
    elif files["tokenizer.model"]:
        rep.kind = "tokenizer.model"
    elif files["vocab.json"] and files["merges.txt"]:
        rep.kind = "vocab.json"
        try:
            vocab = read_json(files["vocab.json"])
        except (ValueError, OSError) as exc:
            add(finding("tokenizer.invalid", f"unreadable: {exc}", "vocab.json"))
            return rep
        if not (isinstance(vocab, dict) and all(_is_id(v) for v in vocab.values())):
            add(finding("tokenizer.invalid", "must map token strings to integer ids",
                        "vocab.json"))
            return rep
        rep.vocab = vocab
    else:
        add(finding("tokenizer.missing", "no tokenizer.json, tokenizer.model or vocab.json + "
                    "merges.txt", "tokenizer.json"))
        return rep
    _check_ids(rep, cfg)
    return rep


def _check_ids(rep: TokenizerReport, cfg: ModelConfig) -> None:
    add = rep.findings.append
    rows = rep.embedding_rows
    declared = cfg.dim("vocab_size")
    if rows is not None and declared is not None and rows != declared:
        add(finding("config.invalid", f"vocab_size is {declared} but the embedding has {rows} rows",
                    "config.json:vocab_size"))
    if rep.vocab:
        rep.max_id = max(rep.vocab.values())
        limit = rows or declared
        if limit is not None and rep.max_id >= limit:
            over = sorted(t for t, i in rep.vocab.items() if i >= limit)
            add(finding("tokenizer.vocab_mismatch", f"token ids reach {rep.max_id} but the "
                        f"embedding has {limit} rows ({len(over)} tokens out of range, e.g. "
                        f"{[_short(t) for t in over[:3]]})", "tokenizer.json"))
    limit = rows or declared
    for prefix, scope in scopes(cfg.raw):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = scope.get(key)
            if not token_ids_ok(value):
                continue  # the config checks report the type
            for tid in value if isinstance(value, list) else [value]:
                if tid is not None and limit is not None and not 0 <= tid < limit:
                    add(finding("tokenizer.vocab_mismatch", f"{key} {tid} is outside the "
                                f"embedding ({limit} rows)", f"config.json:{prefix}{key}"))
    if rep.vocab:
        for key, token in rep.special_tokens().items():
            if token not in rep.vocab:
                add(finding("tokenizer.special_missing", f"{key} {_short(token)} is not in the "
                            "vocabulary", f"tokenizer_config.json:{key}"))


def load_wrapper(root: Path, report: TokenizerReport, label: str) -> Any:
    """mlx-lm's TokenizerWrapper for the bundle at `root` (`report`: its checks), loaded as
    mlx-lm loads it but never running code the bundle ships: trust_remote_code=False, so
    transformers neither asks on a terminal nor imports an auto_map module. A tokenizer the
    checks found unloadable is refused with that finding; anything transformers or tokenizers
    still raise on the files becomes one UserError, never a traceback."""
    if report.kind is None:
        raise UserError("tokenizer.missing", f"{label}: no tokenizer files",
                        finding("tokenizer.missing", "").hint)
    for f in report.findings:
        if f.severity == "error" and f.code in UNLOADABLE:
            raise UserError(f.code, f"{label}: {f.message} [{f.location}]", f.hint)
    from mlx_lm.tokenizer_utils import load

    try:
        return load(root, {"trust_remote_code": False})
    except BaseException as exc:  # pyo3 raises a Rust panic as PanicException(BaseException)
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        if "trust_remote_code" in str(exc):  # transformers refused the bundle's auto_map
            raise UserError("tokenizer.remote_code", f"{label}: the tokenizer can only be built "
                            "by code shipped in the bundle (auto_map), which mtpkit never runs",
                            finding("tokenizer.remote_code", "").hint) from None
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise UserError("tokenizer.invalid", f"{label}: the tokenizer does not load "
                        f"({type(exc).__name__}: {lines[-1].strip()[:300] if lines else ''})",
                        LOAD_HINT) from None
