"""Training windows for a grafted head: the frozen trunk's own greedy continuations.

At temperature 0 a draft counts only when it matches the trunk's greedy token, and a small
model's greedy text is not the text people write: it repeats itself, loops and has its own
idioms. A head distilled on human text alone learns none of that (SmolLM2-135M, head trained on
stdlib text: 2 of 44 drafts accepted while the trunk repeated one phrase verbatim). So the trunk
continues corpus openings greedily, in batches, as raw text and framed as chat requests through
the bundle's own template; each window starts with the human-written prompt and goes on with
exactly what the head will later be asked to draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mtpkit.decoder.model.trunk import Trunk
from mtpkit.loaders.templates import RENDER_ERRORS, render
from mtpkit.train.corpus import sequences, window_count

# Requests that frame a corpus snippet as a chat turn (one per batch, in turn).
INSTRUCTIONS = (
    "Explain what this does, step by step:\n\n",
    "Summarize this for a new team member:\n\n",
    "Write documentation for this:\n\n",
    "Review this and suggest improvements:\n\n",
)
_MARK = "\u2063mtpkit-content\u2063"
MIN_SNIPPET = 8  # fewer corpus tokens than this in a chat prompt: raw prompts only


@dataclass
class Rollouts:
    """Windows of seq_len + 2 tokens, the trunk's post-norm hiddens over all but the last one,
    the trunk's greedy token at t+2 for each head position t (the generated token itself past
    the prompt), and which head positions train (those before the generated end of text)."""

    hidden: mx.array  # (windows, seq_len + 1, hidden)
    tokens: mx.array  # (windows, seq_len + 2)
    targets: mx.array  # (windows, seq_len)
    mask: mx.array  # (windows, seq_len), 1.0 where the position trains


def chat_frame(template: str | None, special: dict[str, str],
               tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """Token ids before and after one user message's content in the rendered chat prompt."""
    if template is None:
        return None
    try:
        parts = render(template, [{"role": "user", "content": _MARK}], special).split(_MARK)
    except RENDER_ERRORS:  # renders a full conversation but not a lone user turn: raw only
        return None
    if len(parts) != 2:
        return None
    before, after = (list(tokenizer.encode(p, add_special_tokens=False)) for p in parts)
    return before, after


class Prompts:
    """Same-length prompt batches from the corpus: raw openings, alternating (where the template
    leaves room) with the same kind of text inside a chat request."""

    def __init__(self, encoded: list[list[int]], seq_len: int,
                 frame: tuple[list[int], list[int]] | None,
                 tokenizer: Any, seed: int) -> None:
        total = seq_len + 2
        self.raw_len = max(2, total // 4)
        self.chat: list[tuple[list[int], int]] = []  # (prefix ids, snippet length) per request
        if frame is not None:
            before, after = frame
            for text in INSTRUCTIONS:
                prefix = before + list(tokenizer.encode(text, add_special_tokens=False))
                snippet = total // 2 - len(prefix) - len(after)
                if snippet >= MIN_SNIPPET:
                    self.chat.append((prefix, snippet))
        self.after = frame[1] if frame is not None else []
        self.span = max([self.raw_len, *(n for _, n in self.chat)])
        self.windows = window_count(encoded, self.span - 2)
        self._stream = sequences(encoded, self.span - 2, seed)  # lazy: raises on first use
        self._count = 0

    def next(self, rows: int) -> tuple[np.ndarray, str]:
        """A (rows, prompt length) batch and its kind ("raw" or "chat")."""
        snippets = [next(self._stream) for _ in range(rows)]
        turn, self._count = self._count, self._count + 1
        if not self.chat or turn % 2 == 0:
            return np.stack([s[:self.raw_len] for s in snippets]), "raw"
        prefix, length = self.chat[(turn // 2) % len(self.chat)]
        return np.stack([[*prefix, *s[:length], *self.after] for s in snippets]), "chat"


def rollout(trunk: Trunk, prompts: np.ndarray, total: int,
            eos: set[int]) -> tuple[mx.array, np.ndarray, np.ndarray, np.ndarray]:
    """Continue a prompt batch greedily to `total` tokens. Returns the post-norm hiddens over
    the first total - 1 tokens, the tokens, the head's targets and its training mask."""
    cache = trunk.make_cache()
    hidden, _ = trunk(mx.array(prompts), cache, logits_for=0)
    # one row's full-vocabulary logits at a time: a batch's would be rows x prompt x vocab floats
    prompt_greedy = mx.concatenate([mx.argmax(trunk.logits(hidden[i:i + 1]), axis=-1)
                                    for i in range(len(prompts))])
    hiddens, generated = [hidden], []
    token = prompt_greedy[:, -1]
    for _ in range(total - prompts.shape[1] - 1):
        generated.append(token)
        hidden, logits = trunk(token[:, None], cache, logits_for=1)
        hiddens.append(hidden)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.async_eval(token, hidden)
    generated.append(token)
    hidden = mx.concatenate(hiddens, axis=1)
    mx.eval(hidden, prompt_greedy)
    ids = np.concatenate([prompts, np.stack([np.array(t) for t in generated], axis=1)], axis=1)
    # the trunk's greedy token after each position: in the prompt from its logits, past it the
    # token it generated; head position t drafts the one after position t + 1
    greedy = np.concatenate([np.array(prompt_greedy)[:, :-1], ids[:, prompts.shape[1]:]], axis=1)
    return hidden, ids, greedy[:, 1:], training_mask(ids, prompts.shape[1], eos)


def training_mask(ids: np.ndarray, prompt_len: int, eos: set[int]) -> np.ndarray:
    """Head position t (token t+1 in, token t+2 drafted) trains while token t+1 comes before the
    first end-of-text the trunk generated; past it the batch only kept decoding for shape."""
    ended = np.isin(ids[:, prompt_len:], sorted(eos))
    first = np.where(ended.any(axis=1), prompt_len + ended.argmax(axis=1), ids.shape[1])
    positions = np.arange(ids.shape[1] - 2)
    return (positions[None, :] + 1 < first[:, None]).astype(np.float32)

