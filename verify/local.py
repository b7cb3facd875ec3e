"""A local bundle as verify-run sees it: the same service `mtpkit serve` runs, called in
process, so every check sees exactly what a client of `serve` would, plus the token ids."""

from __future__ import annotations

import time
from typing import Any

from mtpkit.decoder.runner import load
from mtpkit.decoder.tuning.costs import Progress, cache_key, cached
from mtpkit.loaders.bundle import BundleView, open_bundle
from mtpkit.serve.protocol import Request
from mtpkit.serve.service import Service, usage
from mtpkit.verify.answer import Answer, Chunk
from mtpkit.verify.checks import FAIL, PASS, Check
from mtpkit.verify.run import Facts
from mtpkit.verify.tune import report


class Local:
    def __init__(self, service: Service) -> None:
        self.service = service

    def ask(self, messages: list[dict] | None = None, prompt: str | None = None, *,
            max_tokens: int, stream: bool, depth: int | str | None = None,
            thinking: bool | None = None, draft: str | None = None) -> Answer:
        req = Request(chat=messages is not None, messages=messages or [], prompt=prompt or "",
                      max_tokens=max_tokens, stream=stream, enable_thinking=thinking, depth=depth,
                      draft=draft)
        start = time.perf_counter()
        chunks: list[Chunk] = []
        result: Any = None
        used = None
        for delta in self.service.deltas(req):
            chunks.append(Chunk(time.perf_counter() - start, delta.content, delta.reasoning,
                                delta.tokens))
            result, used = delta.result or result, delta.draft or used
        assert result is not None
        s = result.stats
        mtp = usage(result, used)["mtp"]  # what serve's client reads in usage.mtp
        mtp["rounds"] = s.rounds()  # and, in process, the per-round timeline for --report
        return Answer("".join(c.content for c in chunks), "".join(c.reasoning for c in chunks),
                      len(result.tokens), s.prompt_tokens, result.finish_reason,
                      chunks if stream else [], mtp, s.peak_memory_bytes, list(result.tokens))

    def costs(self, depth: int | str, progress: Progress | None = None) -> dict[str, Any] | None:
        """The cost curve document `mtpkit tune --json` prints, where depth auto measures it
        or the cache holds it (a forced depth never measures it only for a report). verify-run
        asks before its first request, so no timed run pays for the measurement (the first
        MTP run's TTFT did); progress: told how a measurement goes."""
        runner = self.service.runner
        if runner.root is None:
            return None
        if depth != "auto" and cached(cache_key(runner.root, runner.load_options)) is None:
            return None
        return report(runner, str(runner.root), progress=progress)


def cpu_backend() -> bool:
    """Does MLX run on the CPU here? verify-run then measures fewer, shorter runs by default:
    a decode step there costs ten times a GPU's, and the full default took half an hour."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def open_local(bundle: str, dtype: str | None = "auto", shard: str | None = None,
               kv: dict[str, Any] | None = None) -> tuple[Local, Facts, BundleView]:
    """The bundle loaded behind serve's service, what verify-run knows of it (the template
    verdict, its thinking switch), and its view. shard: this rank's part (load's shard); kv:
    load's kv_bits, kv_group_size and quantized_kv_start (a quantized KV cache), and draft_model."""
    view = open_bundle(bundle)
    runner = load(bundle, dtype=dtype, shard=shard, **(kv or {}))
    t = view.template
    if runner.template is None:
        template = Check("template", FAIL, "no usable chat template" + (
            f" ({t.source} does not render safely)" if t.source else ""), {"source": t.source})
    else:
        template = Check("template", PASS, f"{t.source}: renders", {
            "source": t.source, "thinking_switch": t.thinking,
            "generation_prompt_opens_reasoning": t.opens_reasoning})
    service = Service(runner, view.root.name, 0, 1 << 16)
    count = (lambda text: len(runner.encode(text))) if runner.tokenizer is not None else None
    return (Local(service), Facts("bundle", str(view.root), template, t.thinking, True, count),
            view)
