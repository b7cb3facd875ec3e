"""A separate draft model (mlx-lm's `--draft-model`): a small model with the target's tokenizer
drafts K tokens autoregressively, the target verifies them in one pass.

Exact at any temperature: each draft is drawn from the draft model's processed law at the
request's sampling parameters (decoder/sampling.py `candidates(..., drafter=True)`, as the head's
drafts are), from the session's round noise, and that law is the round's q; the Leviathan/Chen
rule then keeps the target's law whatever q is. Its logits are fitted to the target's vocabulary
width (extra columns dropped, missing ones -inf): q is still the law the drafts are drawn from.

Its own KV cache (mlx-lm's `make_prompt_cache`) holds the committed text and, after a proposal,
the drafts it fed; `settle` trims it (mlx-lm's `trim_prompt_cache`) back to the drafts the round
kept, so it always equals a fresh draft model's cache on the committed text plus what is still
pending. Only plain KV caches roll back that way: a draft model with recurrent or sliding-window
caches is refused (`check_caches`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from mtpkit.decoder.drafters.drafts import Draft
from mtpkit.decoder.drafters.proposers import Drafting, SessionBound
from mtpkit.decoder.options import OptionError, Source
from mtpkit.decoder.sampling import Candidates, candidates, greedy
from mtpkit.loaders.findings import UserError

FIXED_DEPTH = 3  # drafts per round where no depth is given: mlx-lm's --num-draft-tokens default
PREFILL_STEP = 2048  # committed tokens fed per draft-model pass (a long prompt in pieces)
STEP_TEXT, STEP_REPS = 64, 5  # step_cost: a step after 64 tokens, the median of 5


class DraftModel:
    """An mlx-lm model that drafts for a target whose vocabulary is `vocab` tokens wide."""

    def __init__(self, model: nn.Module, vocab: int, label: str = "draft model") -> None:
        self.model, self.vocab, self.label = model, vocab, label
        probe = self.make_cache()
        check_caches(probe, label)
        # its logits' width, from a lazy pass's shape (nothing is computed)
        self.width = model(mx.array([[0]]), cache=probe).shape[-1]
        self._step: float | None = None  # step_cost, once timed

    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def logits(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """(1, vocab) next-token logits after feeding `tokens` (1, n), fitted to the target's
        width. Token ids past the draft model's embedding (a target's padding ids) are fed as
        its last row: that changes only q, which any law may be."""
        width = self.width
        out = self.feed(tokens, cache)[:, -1]
        if width > self.vocab:
            return out[:, :self.vocab]
        if width < self.vocab:
            pad = mx.full((1, self.vocab - width), -mx.inf, out.dtype)
            return mx.concatenate([out, pad], axis=1)
        return out

    def feed(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """The model's logits (1, n, width) over `tokens` (1, n), into `cache`."""
        return self.model(mx.minimum(tokens, self.width - 1), cache=cache)

    def step_cost(self) -> float:
        """Seconds of one draft step (one token after a short text), timed once: the depth
        policy's prior for a draft model's rounds (what rounds pay then corrects it,
        decoder/tuning/policy.py's CostTable)."""
        if self._step is None:
            cache = self.make_cache()
            mx.eval(self.logits(mx.zeros((1, STEP_TEXT), mx.int32), cache))
            times = []
            for _ in range(STEP_REPS):
                start = time.perf_counter()
                mx.eval(self.logits(mx.zeros((1, 1), mx.int32), cache))
                times.append(time.perf_counter() - start)
                trim_prompt_cache(cache, 1)
            self._step = statistics.median(times)
        return self._step

    def proposer(self, session: Drafting) -> ModelProposer:
        return ModelProposer(self, session)


def check_caches(cache: list[Any], label: str) -> None:
    """Refuse (options.invalid) a draft model whose caches cannot be trimmed back to any
    length: recurrent state (GatedDeltaNet, SSM) and sliding windows (a wrapped
    RotatingKVCache) have no trim, so a rejected draft could not leave them."""
    kinds = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if kinds:
        raise OptionError("options.invalid", "draft_model",
                          f"{{name}} {label} keeps {', '.join(kinds)} caches, which cannot be "
                          "rolled back after a rejected draft",
                          "use a draft model with attention KV caches only (a plain "
                          "transformer), or draft from the MTP head or the context")


def check_vocab(target: dict[str, int], draft: dict[str, int], label: str) -> None:
    """Refuse (draft.vocab_mismatch) a draft model whose tokenizer maps any token to another
    id than the target's: its drafts would be other text."""
    if target == draft:
        return
    differ = sorted(t for t in set(target) | set(draft) if target.get(t) != draft.get(t))
    example = differ[0] if differ else ""
    raise UserError("draft.vocab_mismatch",
                    f"{label}'s tokenizer differs from the target's: {len(differ)} token(s) "
                    f"differ ({len(draft)} vs {len(target)} tokens; e.g. {example!r}: "
                    f"{draft.get(example)} vs {target.get(example)})",
                    "use a draft model of the same family, with the target's tokenizer")


class ModelProposer(SessionBound[Drafting]):
    """One sequence's draft model: its cache, the committed tokens not fed yet (`pending`, which
    always ends with the last committed token once the prompt is in), and the drafts its last
    proposal fed (`ahead`)."""

    source = Source.MODEL

    def __init__(self, drafter: DraftModel, session: Drafting) -> None:
        super().__init__(session)
        self.drafter = drafter
        self.cache = drafter.make_cache()
        self.pending: list[int] = []
        self.ahead: mx.array | None = None  # (1, n): drafts in the cache past the text

    def propose(self, depth: int) -> Draft | None:
        """`depth` drafts after the last committed token, each drawn from the draft model's
        processed law (greedy: its argmax), chained lazily: one host read per round."""
        if depth <= 0:
            return None
        session = self.session
        draws, rule = session.round_noise(depth)
        logits = self._feed()
        chain, laws = [mx.array([[session.last]])], []
        for k in range(depth):
            if draws is None:
                token = greedy(logits, keepdims=True)
            else:
                laws.append(candidates(logits, session.params, drafter=True))
                token = laws[-1].draw(draws[k:k + 1])[:, None]
            chain.append(token.astype(mx.int32))
            if k + 1 < depth:
                logits = self.drafter.logits(chain[-1], self.cache)
        tokens = mx.concatenate(chain, axis=1)
        self.ahead = tokens[:, 1:depth]
        return Draft(tokens, Candidates.concat(laws) if laws else None, Source.MODEL, depth,
                     rule=rule)

    def _feed(self) -> mx.array:
        """Feed the pending committed tokens (a long prompt in pieces, each evaluated); the
        logits after the last."""
        pending, self.pending = self.pending, []
        assert pending, "a proposal follows the first committed token"
        for at in range(0, len(pending) - PREFILL_STEP, PREFILL_STEP):
            self.drafter.feed(mx.array([pending[at:at + PREFILL_STEP]]), self.cache)
            mx.eval([c.state for c in self.cache])
        tail = pending[(len(pending) - 1) // PREFILL_STEP * PREFILL_STEP:]
        return self.drafter.logits(mx.array([tail]), self.cache)

    def settle(self, tokens: list[int]) -> None:
        """Committed `tokens` (a round's, a plain step's, the prompt's): the drafts fed ahead
        stay in the cache as far as they equal them (a cache entry depends only on the text
        before it), the rest are trimmed; what is not in the cache is pending. The last
        committed token always is: the next proposal starts from its logits."""
        keep = 0
        if self.ahead is not None:
            ahead = self.ahead.tolist()[0]  # (evaluated by the round's read)
            while keep < min(len(ahead), len(tokens) - 1) and ahead[keep] == tokens[keep]:
                keep += 1
            trim_prompt_cache(self.cache, len(ahead) - keep)
            self.ahead = None
        self.pending += tokens[keep:]
