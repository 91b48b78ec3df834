"""Config of metrics sinks (``metrics`` section)."""

from __future__ import annotations

from convergent.core.configbase import Count, Port, Positive, Section


class MetricsConfig(Section):
    """Where per-step metrics go besides metrics.jsonl.

    ``log_every`` controls the console/TensorBoard cadence; metrics.jsonl gets every step
    (written in batches of ``reduce_every`` steps, whose sums are reduced together).
    ``peak_flops`` overrides the measured/table peak (FLOP/s per process) used for MFU.
    """

    tensorboard: bool = True
    prometheus_port: Port | None = None  # serve /metrics on 127.0.0.1:<port> when set
    log_every: Count = 10
    reduce_every: Count = 10  # steps whose cross-rank metric sums share one all-reduce
    peak_flops: Positive | None = None  # FLOP/s per process; None = measure (CPU) / table (GPU)
    mfu: bool = True  # count FLOPs and find the peak for MFU; False: MFU null, no GEMM probe
