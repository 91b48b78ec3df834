"""Config of metrics sinks (``metrics`` section)."""

from __future__ import annotations

from convergent.configbase import Section


class MetricsConfig(Section):
    """Where per-step metrics go besides metrics.jsonl."""

    tensorboard: bool = True
    prometheus_port: int | None = None  # serve /metrics on 127.0.0.1:<port> when set
    log_every: int = 10
