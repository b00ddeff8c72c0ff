"""Prometheus metrics of one server, in its own registry (no process-wide state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .vllm_metrics import VllmMetrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """sparsegen's series, and vLLM's (`vllm_metrics.py`) as `self.vllm`."""

    def __init__(self, model_name: str = "sparsegen"):
        self.registry = r = CollectorRegistry()
        self.vllm = VllmMetrics(r, model_name)
        self.requests = Counter(
            "sparsegen_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sparsegen_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "sparsegen_generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.latency = Histogram(
            "sparsegen_request_latency_seconds", "Submit to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "sparsegen_time_to_first_token_seconds",
            "Submit to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "sparsegen_queue_depth", "Requests waiting for a seat in the batch", registry=r
        )
        self.running = Gauge("sparsegen_requests_running", "Sequences in the running batch", registry=r)
        self.kv_pages_used = Gauge("sparsegen_kv_pages_used", "KV-cache pages held by sequences", registry=r)
        self.kv_pages_total = Gauge("sparsegen_kv_pages_total", "Usable KV-cache pages", registry=r)

    def bind(self, engine) -> None:
        """Gauges read the live engine at scrape time."""
        stats = engine.llm.stats
        self.vllm.bind(engine)
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.running.set_function(lambda: engine.running)
        self.kv_pages_used.set_function(lambda: stats().kv_pages_used)
        self.kv_pages_total.set_function(lambda: stats().kv_pages_total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
