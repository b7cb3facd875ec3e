"""Chat formats recognisable from a tokenizer's special tokens alone, with a plain template
for each. Used to restore a missing template only when exactly one format matches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    name: str
    tokens: tuple[str, ...]  # all must be in the vocabulary
    template: str


CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
GEMMA = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{%- if role == 'system' %}{{- '<start_of_turn>user\\n' + message['content'] + '\\n\\n' }}"
    "{%- else %}{{- '<start_of_turn>' + role + '\\n' + message['content'] + '<end_of_turn>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
FORMATS = (
    ChatFormat("chatml", ("<|im_start|>", "<|im_end|>"), CHATML),
    ChatFormat("llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), LLAMA3),
    ChatFormat("gemma", ("<start_of_turn>", "<end_of_turn>"), GEMMA),
)


def identify(vocab: dict[str, int]) -> ChatFormat | None:
    """The one format whose special tokens are all present; None when none or several match."""
    matches = [f for f in FORMATS if all(t in vocab for t in f.tokens)]
    return matches[0] if len(matches) == 1 else None
