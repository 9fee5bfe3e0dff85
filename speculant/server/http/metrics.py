"""Prometheus metrics for the server, named like vLLM's so existing dashboards and alerts read them.

Each ServerMetrics owns its registry: two servers in one process (tests, A/B runs) never share
or collide on counters. Only the engine thread writes them; prometheus-client is thread-safe, so
the HTTP side can render them at any time.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from speculant.prefix_cache import PrefixCache
from speculant.sequence import SpecStats

FINISH_REASONS = ("stop", "length", "abort")
AUDIT_RESULTS = ("match", "mismatch", "skipped")
AUDIT_SKIPS = ("unseeded", "lossy", "preempted", "backlog", "failed")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# As vLLM does: the *_created series double every scrape and no dashboard reads them (process-wide).
disable_created_metrics()


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, num_speculative_tokens: int = 0):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        label = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"speculant:{name}", doc, label, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"speculant:{name}", doc, label, registry=r).labels(model_name)

        self.num_drafts = counter("spec_decode_num_drafts", "Verify steps that checked drafts.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = Counter("speculant:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft (0-based).",
                                        label + ["position"], registry=r)
        self.request_success = Counter("speculant:request_success", "Finished sequences, by finish reason.",
                                       label + ["finished_reason"], registry=r)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted sequences.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting for a batch slot.")
        self.ttft = Histogram("speculant:time_to_first_token_seconds", "Request arrival to first token.",
                              label, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("speculant:inter_token_latency_seconds", "Time per token after the first.",
                             label, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("speculant:e2e_request_latency_seconds", "Request arrival to last token.",
                             label, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens found / looked up, so far.")
        self.prefix_cached = gauge("prefix_cache_cached_tokens", "Tokens the prefix cache holds.")
        self.prefix_bytes = gauge("prefix_cache_bytes", "Bytes of keys and values it holds.")
        self._prefix_seen = (0, 0)
        self.batch_size = Histogram("speculant:iteration_batch_size", "Sequences decoded in one step.",
                                    label, buckets=BATCH_BUCKETS, registry=r).labels(model_name)
        # Zero-valued series exist from the start, so rate() works on the first scrape.
        for pos in range(num_speculative_tokens):
            self.accepted_per_pos.labels(model_name, str(pos))
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self._seen = SpecStats()

    def enable_audit(self) -> None:
        """The lossless audit's series (server/bridge/auditor.py), zero-valued from the start."""
        label = ["model_name"]
        self.audit = Counter("speculant:audit_requests", "Sequences decoded again without speculation, by result: "
                             "match, mismatch, skipped (not compared).", label + ["result"], registry=self.registry)
        self.audit_skipped = Counter("speculant:audit_skipped", "Sampled sequences the audit did not compare, by "
                                     "reason: unseeded, lossy, preempted, backlog, failed.", label + ["reason"],
                                     registry=self.registry)
        for result in AUDIT_RESULTS:
            self.audit.labels(self.model_name, result)
        for reason in AUDIT_SKIPS:
            self.audit_skipped.labels(self.model_name, reason)

    def observe_audit(self, result: str, reason: str | None = None) -> None:
        self.audit.labels(self.model_name, result).inc()
        if reason is not None:
            self.audit_skipped.labels(self.model_name, reason).inc()

    def observe_spec(self, stats: SpecStats) -> None:
        """Advance the speculation counters to the engine's running totals."""
        seen = self._seen
        self.num_drafts.inc(stats.num_drafts - seen.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        for pos, accepted in enumerate(stats.accepted_per_pos):
            before = seen.accepted_per_pos[pos] if pos < len(seen.accepted_per_pos) else 0
            if accepted > before:
                self.accepted_per_pos.labels(self.model_name, str(pos)).inc(accepted - before)
        self._seen = SpecStats(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                               list(stats.accepted_per_pos))

    def observe_prefix_cache(self, cache: PrefixCache | None) -> None:
        """Advance the prefix cache's series to its running totals."""
        if cache is None:
            return
        s = cache.stats
        queries, hits = self._prefix_seen
        self.prefix_queries.inc(s.queries - queries)
        self.prefix_hits.inc(s.hits - hits)
        self._prefix_seen = (s.queries, s.hits)
        self.prefix_hit_rate.set(s.hit_rate or 0.0)
        self.prefix_cached.set(cache.cached_tokens)
        self.prefix_bytes.set(cache.nbytes)

    def observe_tokens(self, n_tokens: int, since_last_s: float) -> None:
        """A step gave a sequence n tokens `since_last_s` after its previous ones. Speculation
        delivers several tokens per step: each counts as since_last_s / n, so the histogram's mean is
        the real time per token and shows the speed-up."""
        self.generation_tokens.inc(n_tokens)
        for _ in range(n_tokens):
            self.itl.observe(since_last_s / n_tokens)

    def observe_first_tokens(self, n_tokens: int, ttft_s: float) -> None:
        self.generation_tokens.inc(n_tokens)
        self.ttft.observe(ttft_s)

    def observe_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def observe_finished(self, reason: str, e2e_s: float | None) -> None:
        """A sequence left; an aborted one has no meaningful latency (e2e_s None)."""
        self.request_success.labels(self.model_name, reason).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def observe_load(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
