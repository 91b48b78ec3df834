"""Prometheus metrics of one serving instance (``GET /metrics`` of its API server).

Names are a contract (a scrape test and a Grafana dashboard use them):

* ``convergent_serve_queue_length`` — gauge: requests waiting for admission;
* ``convergent_serve_kv_used_fraction`` — gauge 0..1: KV blocks in use / all blocks;
* ``convergent_serve_time_to_first_token_seconds`` — histogram: request arrival at the API
  to its first output token;
* ``convergent_serve_inter_token_latency_seconds`` — histogram: between consecutive output
  tokens of one request;
* ``convergent_serve_output_tokens_total`` — counter (tokens/s = ``rate(...)``);
* ``convergent_serve_requests_total{status}`` — counter of finished requests; ``status`` is
  ``ok``, ``error`` (a stage failed / shutdown / timeout), ``aborted`` (client gone) or
  ``rejected`` (400, or 503 while unhealthy).

Each instance has its own registry, so several apps in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ServeMetrics", "STATUSES"]

STATUSES = ("ok", "error", "aborted", "rejected")
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServeMetrics:
    """The metrics of one instance; gauges read the engine when scraped."""

    def __init__(self, queue_length: Callable[[], float], kv_used: Callable[[], float]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge(
            "convergent_serve_queue_length", "Requests waiting for admission", registry=r
        )
        self.queue_length.set_function(queue_length)
        self.kv_used_fraction = Gauge(
            "convergent_serve_kv_used_fraction", "KV cache blocks in use (0..1)", registry=r
        )
        self.kv_used_fraction.set_function(kv_used)
        self.ttft = Histogram(
            "convergent_serve_time_to_first_token_seconds",
            "Request arrival to first output token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "convergent_serve_inter_token_latency_seconds",
            "Time between consecutive output tokens of a request",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter(
            "convergent_serve_output_tokens", "Output tokens generated", registry=r
        )
        self.requests = Counter(
            "convergent_serve_requests", "Finished requests", ["status"], registry=r
        )
        for s in STATUSES:  # export every series from the start (rate() needs a zero)
            self.requests.labels(status=s)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
