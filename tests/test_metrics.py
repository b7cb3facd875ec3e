"""serve's /metrics counters hold exactly what the generations measured (serve/metrics.py)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

import fixtures.numerics  # noqa: F401  (float32 runs in float32 on GPU backends too)
import mtpkit
from mtpkit.decoder.cache.prefix import PrefixCache
from mtpkit.serve.metrics import Metrics

PROMPT = [5, 9, 14, 3, 22, 7, 8, 30, 11, 4] * 3


def _samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(metrics.text().decode()) for s in f.samples}


def test_counters_sum_the_generations_statistics(built) -> None:
    runner = mtpkit.load(built("llama"), dtype="float32")
    cache = PrefixCache(1 << 30)
    waiting = [3]
    metrics = Metrics(lambda: waiting[0], lambda: 1, lambda: cache.nbytes, lambda: len(cache))
    results = [runner.generate(PROMPT, 24, depth=3, draft="lookup", prefix=cache),
               runner.generate(PROMPT + [1, 2], 24, depth=3, draft="lookup", prefix=cache),
               runner.generate(PROMPT, 16, depth=0)]
    for result, cached in zip(results, (True, True, False), strict=True):
        metrics.generation(result, cached)
    seen = _samples(metrics)
    assert seen[("mtpkit_prompt_tokens_total", ())] == 2 * len(PROMPT) + len(PROMPT) + 2
    assert seen[("mtpkit_cached_prompt_tokens_total", ())] == len(PROMPT) == results[1].cached_tokens
    assert seen[("mtpkit_completion_tokens_total", ())] == sum(len(r.tokens) for r in results)
    assert seen[("mtpkit_verify_calls_total", ())] == sum(r.stats.verify_calls for r in results) > 0
    lookup = [r.stats.sources["lookup"] for r in results[:2]]
    for i in range(3):
        position = (("position", str(i + 1)), ("source", "lookup"))
        proposed = sum(s["proposed"][i] for s in lookup)
        if proposed:
            assert seen[("mtpkit_drafts_proposed_total", position)] == proposed
            assert seen[("mtpkit_drafts_accepted_total", position)] == sum(
                s["accepted"][i] for s in lookup)
    assert seen[("mtpkit_prefix_cache_hits_total", ())] == 1
    assert seen[("mtpkit_prefix_cache_misses_total", ())] == 1, "the third went without a cache"
    assert seen[("mtpkit_ttft_seconds_count", ())] == 3
    assert seen[("mtpkit_ttft_seconds_sum", ())] == sum(r.stats.ttft_s for r in results)
    assert seen[("mtpkit_queue_depth", ())] == 3 and seen[("mtpkit_requests_running", ())] == 1
    assert seen[("mtpkit_prefix_cache_bytes", ())] == cache.nbytes > 0
    assert seen[("mtpkit_prefix_cache_entries", ())] == 1
    waiting[0] = 0
    assert _samples(metrics)[("mtpkit_queue_depth", ())] == 0, "gauges are read when scraped"
