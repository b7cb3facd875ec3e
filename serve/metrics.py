"""`GET /metrics`: what the server did, in Prometheus text format (prometheus_client).

Each server has its own registry (several may run in one process, as in the tests). Counters
count tokens, never chunks; acceptance per draft position and source is kept as two counters
(drafts proposed, drafts kept) so any window's rate is their ratio:
`rate(mtpkit_drafts_accepted_total[5m]) / rate(mtpkit_drafts_proposed_total[5m])`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from mtpkit.decoder.runner import Result

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPS_BUCKETS = (1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class Metrics:
    def __init__(self, queue_depth: Callable[[], int], running: Callable[[], int],
                 cache_bytes: Callable[[], int], cache_entries: Callable[[], int],
                 batch_size: Callable[[], int] = lambda: 0) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mtpkit_requests", "Requests answered, by API and outcome "
                                "(ok, error, cancelled, rejected).", ["api", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("mtpkit_prompt_tokens", "Prompt tokens of generations "
                                     "(cached ones included).", registry=r)
        self.cached_tokens = Counter("mtpkit_cached_prompt_tokens", "Prompt tokens restored "
                                     "from the prefix cache (not prefilled).", registry=r)
        self.completion_tokens = Counter("mtpkit_completion_tokens", "Tokens generated.",
                                         registry=r)
        self.ttft = Histogram("mtpkit_ttft_seconds", "Time to first token (the decoder's: "
                              "prefill of the new tokens and the first sample).",
                              buckets=TTFT_BUCKETS, registry=r)
        self.decode_tps = Histogram("mtpkit_decode_tokens_per_second", "Decode tok/s of each "
                                    "generation (first token to last).", buckets=TPS_BUCKETS,
                                    registry=r)
        self.proposed = Counter("mtpkit_drafts_proposed", "Drafts proposed, by draft source "
                                "and position (1 = first draft of a round).",
                                ["source", "position"], registry=r)
        self.accepted = Counter("mtpkit_drafts_accepted", "Drafts kept, by draft source and "
                                "position.", ["source", "position"], registry=r)
        self.verify_calls = Counter("mtpkit_verify_calls", "Verify passes (speculative rounds).",
                                    registry=r)
        self.rows_per_pass = Histogram("mtpkit_rows_per_pass", "Sequences verified together in "
                                       "one pass of the batch (--max-batch).",
                                       buckets=ROWS_BUCKETS, registry=r)
        self.cache_hits = Counter("mtpkit_prefix_cache_hits", "Generations that started from "
                                  "a cached prefix.", registry=r)
        self.cache_misses = Counter("mtpkit_prefix_cache_misses", "Generations that found no "
                                    "cached prefix.", registry=r)
        for name, doc, read in (
                ("mtpkit_queue_depth", "Requests waiting for the decoder.", queue_depth),
                ("mtpkit_requests_running", "Generations running (batched ones included: "
                 "the batch size).", running),
                ("mtpkit_prefix_cache_bytes", "Bytes the prefix cache holds.", cache_bytes),
                ("mtpkit_prefix_cache_entries", "Prompts the prefix cache holds.", cache_entries),
                ("mtpkit_batch_size", "Generations decoding together in the batch now "
                 "(--max-batch above 1).", batch_size)):
            Gauge(name, doc, registry=r).set_function(read)

    def generation(self, result: Result, cache_on: bool) -> None:
        """Count one finished (or cancelled) generation."""
        s = result.stats
        self.prompt_tokens.inc(s.prompt_tokens + result.cached_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        self.completion_tokens.inc(len(result.tokens))
        if result.tokens:
            self.ttft.observe(s.ttft_s)
        if s.decode_tps > 0:
            self.decode_tps.observe(s.decode_tps)
        self.verify_calls.inc(s.verify_calls)
        for source, counts in s.sources.items():
            for i, (p, a) in enumerate(zip(counts["proposed"], counts["accepted"], strict=True)):
                if p:
                    self.proposed.labels(source, str(i + 1)).inc(p)
                    self.accepted.labels(source, str(i + 1)).inc(a)
        if cache_on:
            (self.cache_hits if result.cached_tokens else self.cache_misses).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
