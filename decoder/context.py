"""How many prompt tokens one generation may take: the one check every entry makes (generate,
serve's OpenAI and Anthropic routes, the library's Runner.stream) before any model work, so all
of them refuse the same prompt with the same code.

The bound is the model's context as its config.json declares it, or an entry's own
`--max-prompt-tokens`, which replaces it (lower, to keep a server's turns short; higher, where
the operator knows the model reaches further than its config says). A prompt past the context is
not one the model was trained for, and a server that took one whole held its only decoder for
minutes of prefill (issue 31).
"""

from __future__ import annotations

from typing import Any

from mtpkit.loaders.findings import UserError

# The keys families name their context by, in the order they are looked for.
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
ROPE_KEYS = ("rope_scaling", "rope_parameters")


def _positive(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return float(value) if ok else None


def context_of(text: dict[str, Any]) -> int | None:
    """The context of a flat (text) config, or None where it declares none. A RoPE scaling
    that stretches an original context (YaRN and the like: `original_max_position_embeddings`
    times `factor`) counts where it reaches further than the declared length, as Qwen's
    long-context recipe leaves max_position_embeddings at the original."""
    declared = next((int(v) for k in CONTEXT_KEYS if (v := _positive(text.get(k)))), None)
    stretched = None
    for key in ROPE_KEYS:
        rope = text.get(key)
        if isinstance(rope, dict):
            factor = _positive(rope.get("factor"))
            original = _positive(rope.get("original_max_position_embeddings"))
            if factor and original:
                stretched = int(original * factor)
    known = [n for n in (declared, stretched) if n]
    return max(known) if known else None


def check_prompt(tokens: int, context: int | None, max_prompt_tokens: int | None) -> None:
    """Refuse a prompt over the limit: `max_prompt_tokens` where given, else the model's
    context (no bound where neither is known)."""
    if max_prompt_tokens is not None:
        limit, why = max_prompt_tokens, "--max-prompt-tokens"
    elif context is not None:
        limit, why = context, "the model's context, config.json"
    else:
        return
    if tokens > limit:
        raise UserError("prompt.too_long", f"the prompt is {tokens} tokens; the limit is "
                        f"{limit} ({why})", "shorten the prompt (or raise --max-prompt-tokens "
                        "where the model reaches further than its config says)")
