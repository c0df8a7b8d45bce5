"""Prometheus metrics under vLLM's names (and a few of nanofn's own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from nanofn.engine.outputs import RequestOutput
from nanofn.server.async_engine import AsyncLLM

# Why an API request stops before its end: its client went away, or the server's shutdown
# (--shutdown-timeout) ran out of time for it.
ABORT_REASONS = ("client_disconnected", "shutdown")


class Metrics:
    """Prometheus metrics under vLLM's names, in a registry of this app's own."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("vllm:num_requests_running", "Requests running", registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)",
                              registry=registry)
        self.kv_blocks_used = Gauge("nanofn:kv_blocks_used", "KV blocks owned by requests",
                                    registry=registry)
        self.hit_rate = Gauge("nanofn:prefix_cache_hit_rate",
                              "Prompt tokens found in the prefix cache, since the start",
                              registry=registry)
        registry.register(_CoreCounters(llm))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Generated tokens of finished requests",
                                         registry=registry)
        self.requests = Counter("vllm:request_success", "Finished requests", ["finished_reason"],
                                registry=registry)
        self.aborted_requests = Counter("nanofn:requests_aborted",
                                        "API requests stopped before their end, by why",
                                        ["reason"], registry=registry)
        for reason in ABORT_REASONS:  # shown from the start, at 0
            self.aborted_requests.labels(reason=reason)
        self.requests.labels(finished_reason="abort")
        self.time_to_first_token = Histogram("vllm:time_to_first_token_seconds",
                                             "Time to the first token", registry=registry)
        self.inter_token_latency = Histogram("vllm:inter_token_latency_seconds",
                                             "Time between tokens", registry=registry)
        self.e2e_latency = Histogram("vllm:e2e_request_latency_seconds",
                                     "Time from arrival to the last token", registry=registry)

    def finished(self, output: RequestOutput, seconds: float) -> None:
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
        for c in output.outputs:
            self.requests.labels(finished_reason=c.finish_reason or "abort").inc()
        self.e2e_latency.observe(seconds)

    def aborted(self, reason: str, num_sequences: int) -> None:
        """An API request stopped early (``reason``: one of ``ABORT_REASONS``), with the
        sequences it had not finished (counted as vLLM counts aborted requests)."""
        self.aborted_requests.labels(reason=reason).inc()
        self.requests.labels(finished_reason="abort").inc(num_sequences)

    def render(self) -> bytes:
        figures = self.llm.figures()
        self.running.set(figures.num_running)
        self.waiting.set(figures.num_waiting)
        self.kv_usage.set(figures.kv_cache_usage)
        self.kv_blocks_used.set(figures.kv_blocks_used)
        self.hit_rate.set(figures.prefix_cache_hit_rate)
        return generate_latest(self.registry)


class _CoreCounters:
    """The core's own running totals, read from its latest (immutable) state at each scrape:
    preemptions, and prefix-cache queries and hits in tokens, as vLLM counts them."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm

    def collect(self):
        counters = self.llm.counters()
        for name, documentation, value in (
                ("vllm:num_preemptions", "Preemptions since the start",
                 counters.num_preemptions),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 counters.num_admitted_tokens),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 counters.num_cached_tokens)):
            yield CounterMetricFamily(name, documentation, value=value)
