"""Where a missing or broken chat template can be restored from, in order: what the user
names (--template-from), the original model in the local Hugging Face cache, GGUF metadata,
and last a plain template for a chat format the special tokens identify unambiguously (for
ChatML with `<think>` tokens, one with Qwen3's thinking switch). A plain template lacks what the
model's own had (tools, often the thinking switch): fallback_gaps() says what, as a warning."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtpkit.loaders.bundle import BundleView
from mtpkit.loaders.chat_formats import FORMATS, identify
from mtpkit.loaders.config import read_json
from mtpkit.loaders.findings import Finding, finding
from mtpkit.loaders.gguf_header import check_gguf
from mtpkit.loaders.source import REPO_ID
from mtpkit.loaders.templates import locate

# ChatML with Qwen3's thinking switch: enable_thinking=false closes an empty think block in the
# generation prompt; otherwise the model opens <think> itself.
CHATML_THINKING = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
THINK_TOKENS = ("<think>", "</think>")
# Special tokens that show a model was trained to call tools (Qwen/Hermes, Llama 3.1, Mistral,
# Phi, Gemma 3n / FunctionGemma).
TOOL_TOKENS = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>",
               "<start_function_call>")
# Every template mtpkit restores without a source: the copy's doctor recognises them by text.
FALLBACKS = {CHATML_THINKING: "plain chatml template with a thinking switch",
             **{f.template: f"plain {f.name} template" for f in FORMATS}}


@dataclass(frozen=True)
class FoundTemplate:
    text: str
    provenance: str


class TemplateSourceError(Exception):
    pass


def from_gguf(path: Path) -> str | None:
    """The chat template in a GGUF's metadata; GGUFInvalid (UserError) for a corrupt file,
    which gguf-py is never handed (its reader trusts the counts: loaders/gguf_header.py)."""
    from gguf import GGUFReader

    check_gguf(path)
    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    value = field.contents() if field is not None else None
    return value if isinstance(value, str) else None


def from_path(path: Path) -> str | None:
    """A checkpoint folder, a tokenizer_config.json, a .jinja file or a .gguf file."""
    try:
        return _from_path(path)
    except ValueError as exc:  # an unreadable JSON file (BundleJSONError): one line, not a traceback
        raise TemplateSourceError(f"{path}: {exc}") from None


def _from_path(path: Path) -> str | None:
    if path.is_dir():
        tc = path / "tokenizer_config.json"
        config = read_json(tc) if tc.is_file() else {}
        return locate(path, config if isinstance(config, dict) else {})[1]
    if path.suffix == ".gguf":
        return from_gguf(path)
    if path.name.endswith(".json"):
        data = read_json(path)
        value = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(value, list):
            value = next((t.get("template") for t in value if isinstance(t, dict)
                          and t.get("name") == "default"), None)
        return value if isinstance(value, str) else None
    return path.read_text("utf-8")


def _named_base_models(view: BundleView) -> list[str]:
    """Repo ids the bundle says it came from: its card's base_model, config _name_or_path."""
    from huggingface_hub.repocard import metadata_load

    names: list[str] = []
    card = view.root / "README.md"
    if card.is_file():
        try:
            base = (metadata_load(card) or {}).get("base_model")
        except (ValueError, OSError):  # malformed front matter: not a source
            base = None
        names += base if isinstance(base, list) else [base]
    names.append(view.config.raw.get("_name_or_path"))
    return list(dict.fromkeys(n for n in names if isinstance(n, str) and REPO_ID.match(n)))


def _from_cache(repo_id: str) -> str | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return from_path(folder)


def find_template(view: BundleView, template_from: Path | None = None) -> FoundTemplate | None:
    if template_from is not None:
        text = from_path(template_from)
        if text is None:
            raise TemplateSourceError(f"no chat template in {template_from}")
        return FoundTemplate(text, f"--template-from {template_from}")
    for repo_id in _named_base_models(view):
        text = _from_cache(repo_id)
        if text:
            return FoundTemplate(text, f"original model {repo_id} (local Hugging Face cache)")
    for gguf in sorted(view.root.glob("*.gguf")):
        text = from_gguf(gguf)
        if text:
            return FoundTemplate(text, f"GGUF metadata of {gguf.name}")
    fmt = identify(view.tokenizer.vocab)
    if fmt is None:
        return None
    text = fmt.template
    if fmt.name == "chatml" and all(t in view.tokenizer.vocab for t in THINK_TOKENS):
        text = CHATML_THINKING  # the model reasons in <think>: keep its switch
    return FoundTemplate(text, f"{FALLBACKS[text]} (identified from the tokenizer's special "
                         "tokens)")


def fallback_gaps(view: BundleView) -> list[Finding]:
    """A warning where the bundle's template is one of mtpkit's plain fallbacks and lacks what
    the tokenizer shows the model uses: a thinking switch (`<think>` tokens), tool calls (tool
    tokens). A restored template that renders is otherwise reported OK while chat requests
    silently lose thinking control and tools."""
    name = FALLBACKS.get(view.template.text or "")
    if name is None:
        return []
    vocab = view.tokenizer.vocab
    lacks = []
    if all(t in vocab for t in THINK_TOKENS) and not view.template.thinking:
        lacks.append("no thinking switch (enable_thinking), though the tokenizer has "
                     "<think>/</think>")
    tools = [t for t in TOOL_TOKENS if t in vocab]
    if tools and "tools" not in (view.template.text or ""):
        lacks.append(f"no tool calls, though the tokenizer has {', '.join(tools)}")
    if not lacks:
        return []
    where = view.template.source or "chat_template.jinja"
    return [finding("template.fallback", f"{where} is mtpkit's {name}: it has "
                    + " and ".join(lacks), where,
                    fixable=not tools and "chatml" in name)]
