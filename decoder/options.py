"""Decoding options, checked in one place.

Every entry (`mtpkit generate`, `serve` and `verify-run`, both HTTP APIs, `Runner.generate` and
`stream`) builds its options here, so each refuses the same things with the same code and
message; only the option's spelling follows the entry (`--depth`, `mtp_depth`, `depth`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from mtpkit.loaders.findings import UserError

DTYPES = ("auto", "float32", "bfloat16", "float16")  # load's dtype (decoder/tuning/dtypes.py); None too
MAX_BATCH = 64  # the most sequences one batch decodes together (decoder/rounds/scheduler.py)
MAX_DEPTH = 16  # the deepest forced depth (and what the cost curve measures: curve.MAX_ROWS)
SEED_BOUND = 1 << 63
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs (mlx-lm's QuantizedKVCache takes any)
KV_GROUP_SIZES = (32, 64, 128)
KV_START = 5000  # mlx-lm's DEFAULT_QUANTIZED_KV_START (not imported: mlx-lm takes seconds)


@dataclass(frozen=True)
class SamplingParams:
    """mlx-lm's sampler settings, checked in `options` below. Here rather than in
    decoder/sampling.py so the CLI parses its options without importing mlx-lm (seconds)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Source(StrEnum):
    """Where drafts come from, spelled as on the command line, in requests and in reports."""

    HEAD = "head"  # the bundle's MTP head
    LOOKUP = "lookup"  # the context: what followed an earlier match (decoder/drafters/lookup.py)
    BOTH = "both"  # whichever pays, round by round (the head where the bundle has one)
    MODEL = "model"  # a separate draft model with the same tokenizer (decoder/drafters/draft_model.py)
    CHAIN = "chain"  # a round's, never an option: head drafts continued from the context


SOURCES = tuple(s.value for s in Source if s is not Source.CHAIN)  # what users may choose
Depth = int | str | None  # a forced depth, "auto", or None (the head's layer count)


class OptionError(UserError, ValueError):
    """A refused decoding option. `option` is its canonical name; `say(spelling)` words the
    message with the entry's own spelling of it."""

    def __init__(self, code: str, option: str, template: str, hint: str) -> None:
        self.option, self.template = option, template
        super().__init__(code, template.format(name=option), hint)

    def say(self, spelling: str) -> str:
        return self.template.format(name=spelling)


def _number(option: str, value: object, low: float, high: float, low_open: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise OptionError("options.invalid", option, f"{{name}} must be a number in {bounds}",
                          f"give {option} a value in {bounds}")
    return float(value)  # type: ignore[arg-type]


def _integer(option: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OptionError("options.invalid", option,
                          f"{{name}} must be an integer in [{low}, {high}]",
                          f"give {option} a whole number in [{low}, {high}]")
    return value


def depth_option(value: object) -> Depth:
    """A depth as given: "auto", None, or an integer in [0, MAX_DEPTH]."""
    if value is None or value == "auto":
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DEPTH:
        raise OptionError("options.invalid", "depth",
                          f'{{name}} must be "auto" or an integer in [0, {MAX_DEPTH}]',
                          "auto lets measured costs choose; 0 is plain decoding")
    return value


def source_option(value: object) -> Source | None:
    if value is None or isinstance(value, Source):
        return value
    if isinstance(value, str) and value in SOURCES:
        return Source(value)
    raise OptionError("options.invalid", "draft", '{name} must be "head", "lookup" or "both"',
                      "head: the MTP head; lookup: the context; both: whichever pays; "
                      '"model" too, where a draft model is loaded (--draft-model)')


def dtype_option(value: object) -> str | None:
    """A load dtype as given: one of DTYPES, or None (the bundle's own, always)."""
    if value is not None and value not in DTYPES:
        raise OptionError("options.invalid", "dtype", f"{{name}} must be one of {', '.join(DTYPES)}",
                          "auto picks the fastest here; float32 proves greedy identity")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class KVQuant:
    """mlx-lm's KV cache quantization: once a trunk cache holds `start` positions it becomes a
    `QuantizedKVCache` of `bits` bits in groups of `group_size` (decoder/cache/caches.py)."""

    bits: int
    group_size: int = 64
    start: int = KV_START

    def to_dict(self) -> dict[str, int]:
        return {"kv_bits": self.bits, "kv_group_size": self.group_size,
                "quantized_kv_start": self.start}


def kv_option(bits: object = None, group_size: object = 64,
              start: object = KV_START) -> KVQuant | None:
    """--kv-bits, --kv-group-size and --quantized-kv-start as mlx-lm means them (None: no
    quantization), checked even where bits is None so a typo never passes unseen."""
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise OptionError("options.invalid", "quantized_kv_start",
                          "{name} must be a whole number of positions, 0 or more",
                          f"mlx-lm's default is {KV_START}; 0 quantizes from the first position")
    if isinstance(group_size, bool) or group_size not in KV_GROUP_SIZES:
        raise OptionError("options.invalid", "kv_group_size",
                          f"{{name}} must be one of {', '.join(map(str, KV_GROUP_SIZES))}",
                          "64 is mlx-lm's default; the group size must divide the heads' width")
    if bits is None:
        return None
    if isinstance(bits, bool) or bits not in KV_BITS:
        raise OptionError("options.invalid", "kv_bits",
                          f"{{name}} must be one of {', '.join(map(str, KV_BITS))}",
                          "8 keeps greedy text closest to the float cache; 4 halves it again")
    return KVQuant(bits, group_size, start)  # type: ignore[arg-type]


def batch_option(value: object, kv: KVQuant | None = None, unbatchable: str = "") -> int:
    """How many sequences may decode together (serve --max-batch, Runner.stream_batch). A
    quantized KV cache decodes one at a time: mlx-lm has no batched QuantizedKVCache (its own
    server quietly turns batching off under --kv-bits); here a batch asked for is refused. So is
    one of a model whose rows cannot decode in one batch exactly (`unbatchable`: why, from
    Runner.unbatchable)."""
    most = _integer("max_batch", value, 1, MAX_BATCH)
    if unbatchable and most > 1:
        raise OptionError("options.invalid", "max_batch",
                          "{name} above 1 cannot run with this model: " + unbatchable,
                          "use max_batch 1 (one at a time)")
    if kv is not None and most > 1:
        raise OptionError("options.invalid", "max_batch",
                          "{name} above 1 cannot run with a quantized KV cache (--kv-bits): "
                          "mlx-lm has no batched quantized cache",
                          "use max_batch 1 (one request at a time), or drop kv_bits")
    return most


@dataclass(frozen=True)
class DecodeOptions:
    """What one generation is asked to do, already checked: build with `DecodeOptions.of`."""

    depth: Depth = "auto"
    draft: Source | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None

    @classmethod
    def of(cls, depth: object = "auto", draft: object = None, temperature: object = 0.0,
           top_p: object = 1.0, top_k: object = 0, min_p: object = 0.0,
           seed: object = None) -> DecodeOptions:
        """Check every option (OptionError, code options.invalid, for the first bad one)."""
        sampling = SamplingParams(_number("temperature", temperature, 0.0, math.inf),
                                  _number("top_p", top_p, 0.0, 1.0, low_open=True),
                                  _integer("top_k", top_k, 0, 1 << 31),
                                  _number("min_p", min_p, 0.0, 1.0))
        if seed is not None:
            seed = _integer("seed", seed, -SEED_BOUND, SEED_BOUND - 1)
        return cls(depth_option(depth), source_option(draft), sampling, seed)  # type: ignore[arg-type]

    def source(self, has_head: bool, unsupported: str | None = None,
               has_model: bool = False) -> Source:
        """The draft source this generation uses: as asked, else the draft model where one is
        loaded (`has_model`), both under auto, the head at a forced depth, the context for a
        bundle without a head. The head asked of a bundle without one is refused
        (options.no_head; mtp.unsupported, saying why, where the bundle has a head the decoder
        cannot run); "both" there is the context alone; "model" without a draft model loaded
        is options.invalid."""
        if self.draft is Source.MODEL and not has_model:
            raise OptionError("options.invalid", "draft",
                              '{name} "model" drafts with a draft model; none is loaded',
                              "load one with the bundle: --draft-model PATH "
                              "(Python: mtpkit.load(path, draft_model=PATH))")
        if self.draft is Source.HEAD and not has_head and unsupported is not None:
            raise OptionError("mtp.unsupported", "draft", f'{{name}} "head": {unsupported}',
                              'use "lookup" or "both" (context drafts), or depth 0 (plain)')
        if self.draft is Source.HEAD and not has_head:
            raise OptionError("options.no_head", "draft",
                              '{name} "head" drafts with an MTP head; this model has none',
                              'use "lookup" or "both" (context drafts), or depth 0 (plain)')
        if self.draft is not None:
            return self.draft
        if has_model:
            return Source.MODEL
        if not has_head:
            return Source.LOOKUP
        return Source.BOTH if self.depth == "auto" else Source.HEAD
