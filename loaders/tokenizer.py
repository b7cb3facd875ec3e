"""Tokenizer files: present, parseable, ids inside the embedding, special tokens in the vocab."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpkit.loaders.config import ModelConfig, read_json
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.paths import bundle_file
from mtpkit.loaders.safetensors_header import TensorInfo
from mtpkit.loaders.templates import CHAT_MARKERS

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


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


def _vocab_of(data: Any) -> dict[str, int]:
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    out: dict[str, int] = {}
    if isinstance(vocab, dict):
        out = {k: v for k, v in vocab.items() if isinstance(v, int)}
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], id = position
        out = {e[0]: i for i, e in enumerate(vocab) if isinstance(e, list) and e}
    for tok in data.get("added_tokens") or []:
        if isinstance(tok, dict) and isinstance(tok.get("content"), str) and isinstance(
                tok.get("id"), int):
            out[tok["content"]] = tok["id"]
    return out


def embedding_rows(trunk: dict[str, TensorInfo]) -> int | None:
    for name, info in trunk.items():
        if name.endswith("embed_tokens.weight") and "mtp" not in name and info.shape:
            return info.shape[0]
    return None


def check_tokenizer(root: Path, cfg: ModelConfig, trunk: dict[str, TensorInfo]) -> TokenizerReport:
    rep = TokenizerReport(embedding_rows=embedding_rows(trunk))
    add = rep.findings.append
    tc_path = bundle_file(root, "tokenizer_config.json", rep.findings)
    if tc_path is not None:
        try:
            tc = read_json(tc_path)
            rep.config = tc if isinstance(tc, dict) else {}
        except (ValueError, OSError, UnicodeDecodeError) as exc:
            add(finding("tokenizer.invalid", f"unreadable: {exc}", "tokenizer_config.json"))
    files = {n: bundle_file(root, n, rep.findings)
             for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")}
    if files["tokenizer.json"]:
        rep.kind = "tokenizer.json"
        try:
            rep.vocab = _vocab_of(read_json(files["tokenizer.json"]))
        except (ValueError, OSError, UnicodeDecodeError, AttributeError) as exc:
            add(finding("tokenizer.invalid", f"unreadable: {exc}", "tokenizer.json"))
            return rep
        if not rep.vocab:
            add(finding("tokenizer.invalid", "no vocabulary in model.vocab", "tokenizer.json"))
            return rep
    elif files["tokenizer.model"]:
        rep.kind = "tokenizer.model"
    elif files["vocab.json"] and files["merges.txt"]:
        rep.kind = "vocab.json"
        try:
            vocab = read_json(files["vocab.json"])
            rep.vocab = {k: v for k, v in vocab.items() if isinstance(v, int)}
        except (ValueError, OSError, UnicodeDecodeError, AttributeError) as exc:
            add(finding("tokenizer.invalid", f"unreadable: {exc}", "vocab.json"))
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
                        f"{over[:3]})", "tokenizer.json"))
    limit = rows or declared
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = cfg.text.get(key)
        ids = value if isinstance(value, list) else [value]
        for tid in ids:
            if isinstance(tid, int) and limit is not None and not 0 <= tid < limit:
                add(finding("tokenizer.vocab_mismatch", f"{key} {tid} is outside the embedding "
                            f"({limit} rows)", f"config.json:{key}"))
    if rep.vocab:
        for key, token in rep.special_tokens().items():
            if token not in rep.vocab:
                add(finding("tokenizer.special_missing", f"{key} {token!r} is not in the "
                            "vocabulary", f"tokenizer_config.json:{key}"))
