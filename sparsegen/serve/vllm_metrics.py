"""vLLM's metric names and meanings beside sparsegen's own, so vLLM dashboards carry over.

Every series is labelled `model_name` (the served name). Both sets stay: `sparsegen_*` are the
server's existing names, `vllm:*` follow vLLM's V1 surface:

    vllm:time_to_first_token_seconds   histogram  submit to first token
    vllm:inter_token_latency_seconds   histogram  between successive token updates of one request
        (with n > 1 the choices' updates interleave, so it is per request, not per choice)
    vllm:e2e_request_latency_seconds   histogram  submit to last token
    vllm:prompt_tokens / vllm:generation_tokens  counters (exposed with `_total`)
    vllm:request_success               counter by `finished_reason` (stop, length, abort)
    vllm:num_requests_running / vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1)
    vllm:prefix_cache_queries / vllm:prefix_cache_hits  counters, in tokens; read from the
        engine's stats when it reports them (`prefix_cache_queries`, `prefix_cache_hits`), else 0:
        this engine has no prefix cache yet.

    vllm:request_queue_time_seconds    histogram  submit to the completion's first admission to the
        running batch (per completion: with n > 1 each choice is a sequence of its own; a
        completion cancelled before its first token is not counted)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class _PrefixCache:
    """A custom collector: the engine's cumulative prefix-cache counters at scrape time."""

    def __init__(self, stats, model: str):
        self.stats, self.model = stats, model

    def collect(self):
        s = self.stats()
        for name, about in (
            ("queries", "Prefix-cache queries, in tokens"),
            ("hits", "Prefix-cache hits, in tokens"),
        ):
            family = CounterMetricFamily(f"vllm:prefix_cache_{name}", about, labels=["model_name"])
            family.add_metric([self.model], float(getattr(s, f"prefix_cache_{name}", 0)))
            yield family


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model: str):
        self.registry, self.model = registry, model
        lab = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Submit to first token", lab,
                              buckets=LATENCY_BUCKETS, registry=registry).labels(model)  # fmt: skip
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between successive tokens", lab,
                             buckets=ITL_BUCKETS, registry=registry).labels(model)  # fmt: skip
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Submit to first scheduled", lab,
                                    buckets=LATENCY_BUCKETS, registry=registry).labels(model)  # fmt: skip
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Submit to last token", lab,
                             buckets=LATENCY_BUCKETS, registry=registry).labels(model)  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", lab, registry=registry).labels(
            model
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", lab, registry=registry
        ).labels(model)
        self.success = Counter(
            "vllm:request_success", "Finished completions by finish reason", ["model_name", "finished_reason"],
            registry=registry,
        )  # fmt: skip
        self.running = Gauge("vllm:num_requests_running", "Sequences running", lab, registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Sequences waiting", lab, registry=registry)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV pages in use (0..1)", lab, registry=registry
        )

    def bind(self, engine) -> None:
        stats = engine.llm.stats
        self.running.labels(self.model).set_function(lambda: engine.running)
        self.waiting.labels(self.model).set_function(lambda: engine.queue_depth)

        def usage() -> float:
            s = stats()
            return s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0

        self.kv_usage.labels(self.model).set_function(usage)
        self.registry.register(_PrefixCache(stats, self.model))

    def finished(self, reason: str | None) -> None:
        self.success.labels(self.model, reason or "abort").inc()
