"""Prometheus metrics under vLLM's names (and a few of nanofn's own)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import (CollectorRegistry, Counter, Histogram, generate_latest,
                               multiprocess)
from prometheus_client.metrics_core import Metric

from nanofn.engine.outputs import RequestOutput
from nanofn.server.async_engine import AsyncLLM, ReplicaView
from nanofn.server.data_parallel import sum_counters, sum_figures

METRICS_FOLDER_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode
# Why an API request stops before its end: its client went away, or the server's shutdown
# (--shutdown-timeout) ran out of time for it.
ABORT_REASONS = ("client_disconnected", "shutdown")


class Metrics:
    """Prometheus metrics under vLLM's names, in a registry of this app's own."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm
        self.registry = registry = CollectorRegistry()
        registry.register(_EngineMetrics(llm))
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
        """This app's metrics; with several HTTP processes (``PROMETHEUS_MULTIPROC_DIR`` set,
        ``api_servers``), their counters and histograms added up from the files they write,
        and the engines' figures as this process reads them."""
        if METRICS_FOLDER_VARIABLE not in os.environ:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(_EngineMetrics(self.llm))
        return generate_latest(registry)


class _EngineMetrics:
    """The engines' figures (gauges) and the core's running totals (counters: preemptions,
    prefix-cache queries and hits in tokens, as vLLM counts them; finished sequences), read
    from each engine's latest (immutable) state at each scrape.

    A data-parallel server shows each replica's under a ``replica`` label and, without the
    label, their sum (the hit rate and KV usage of the summed counts), so that a dashboard
    made for one engine reads the whole server; ``nanofn:replica_up`` says which replicas
    serve. One engine shows its own, unlabelled, as before."""

    def __init__(self, llm: AsyncLLM):
        self.llm = llm

    def collect(self) -> Iterator[Metric]:
        views = self.llm.views()
        labelled = [({"replica": str(i)}, view) for i, view in enumerate(views)]
        rows = [({}, _total(views))] + (labelled if len(views) > 1 else [])
        for name, kind, documentation, value in ENGINE_METRICS:
            family = Metric(name, documentation, kind)
            for labels, view in rows:
                family.add_sample(name + ("_total" if kind == "counter" else ""), labels,
                                  value(view))
            yield family
        if len(views) > 1:
            up = Metric("nanofn:replica_up", "1 while a data-parallel replica serves, 0 once "
                                              "its engine stopped", "gauge")
            for labels, view in labelled:
                up.add_sample("nanofn:replica_up", labels, float(view.failure is None))
            yield up


def _total(views: list[ReplicaView]) -> ReplicaView:
    if len(views) == 1:
        return views[0]
    counters = sum_counters([v.counters for v in views])
    return ReplicaView(sum_figures([v.figures for v in views], counters), counters, None)


# (name, type, documentation, value of a ReplicaView)
ENGINE_METRICS: tuple[tuple[str, str, str, Callable[[ReplicaView], float]], ...] = (
    ("vllm:num_requests_running", "gauge", "Requests running", lambda v: v.figures.num_running),
    ("vllm:num_requests_waiting", "gauge", "Requests waiting", lambda v: v.figures.num_waiting),
    ("vllm:kv_cache_usage_perc", "gauge", "KV cache usage (1 = full)",
     lambda v: v.figures.kv_cache_usage),
    ("nanofn:kv_blocks_used", "gauge", "KV blocks owned by requests",
     lambda v: v.figures.kv_blocks_used),
    ("nanofn:prefix_cache_hit_rate", "gauge",
     "Prompt tokens found in the prefix cache, since the start",
     lambda v: v.figures.prefix_cache_hit_rate),
    ("vllm:num_preemptions", "counter", "Preemptions since the start",
     lambda v: v.counters.num_preemptions),
    ("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache",
     lambda v: v.counters.num_admitted_tokens),
    ("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache",
     lambda v: v.counters.num_cached_tokens),
    ("nanofn:sequences_finished", "counter", "Sequences the engine finished (aborted ones too)",
     lambda v: v.counters.num_finished),
)
