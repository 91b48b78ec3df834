"""Config of metrics sinks (``metrics`` section)."""

from __future__ import annotations

from convergent.configbase import Section


class MetricsConfig(Section):
    """Where per-step metrics go besides metrics.jsonl.

    ``log_every`` controls the console/TensorBoard cadence; metrics.jsonl gets every step
    (written in batches of ``reduce_every`` steps, whose sums are reduced together).
    ``peak_flops`` overrides the measured/table peak (FLOP/s per process) used for MFU.
    """

    tensorboard: bool = True
    prometheus_port: int | None = None  # serve /metrics on 127.0.0.1:<port> when set
    log_every: int = 10
    reduce_every: int = 10  # steps whose cross-rank metric sums share one all-reduce
    peak_flops: float | None = None  # FLOP/s per process; None = measure (CPU) / table (GPU)
