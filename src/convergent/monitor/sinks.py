"""Metric sinks: JSONL (run dir), TensorBoard, Prometheus, MLflow (``tracking.mlflow``).

:class:`MetricSinks` fans one record out to every enabled sink. Records are flat dicts
with a ``kind`` (``train_step``, ``val``) and a ``step``; numeric fields become
TensorBoard scalars ``<kind>/<field>`` and Prometheus gauges ``convergent_<kind>_<field>``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from convergent.core.fsutil import dumps_json


class JsonlSink:
    """Append one JSON line per record (adds ``time``); line-buffered, crash-tolerant."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        self._fh.write(dumps_json(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _numeric(record: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in record.items():
        if isinstance(v, bool) or k in ("step", "time"):
            continue
        if isinstance(v, int | float):
            out[k] = float(v)
    return out


class TensorBoardSink:
    """Scalars ``<kind>/<field>`` at ``step`` in a TensorBoard event directory."""

    def __init__(self, logdir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def write(self, record: dict[str, Any]) -> None:
        kind = record.get("kind", "metrics")
        step = int(record.get("step", 0))
        for k, v in _numeric(record).items():
            self.writer.add_scalar(f"{kind}/{k}", v, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class PrometheusSink:
    """Gauges ``convergent_<kind>_<field>`` served on ``127.0.0.1:<port>/metrics``."""

    def __init__(self, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self._Gauge = Gauge
        self.registry = CollectorRegistry()
        self.gauges: dict[str, Any] = {}
        self.server, self.thread = start_http_server(port, addr=addr, registry=self.registry)

    def write(self, record: dict[str, Any]) -> None:
        kind = re.sub(r"\W", "_", str(record.get("kind", "metrics")))
        fields = _numeric(record)
        if "step" in record:
            fields["step"] = float(record["step"])
        for k, v in fields.items():
            name = "convergent_" + kind + "_" + re.sub(r"\W", "_", k)
            gauge = self.gauges.get(name)
            if gauge is None:
                gauge = self._Gauge(name, f"{kind} {k}", registry=self.registry)
                self.gauges[name] = gauge
            gauge.set(v)

    def close(self) -> None:
        self.server.shutdown()


class MetricSinks:
    """All enabled sinks; ``write`` sends a record to each, ``close`` flushes them."""

    def __init__(
        self,
        jsonl: str | Path | None = None,
        tensorboard_dir: str | Path | None = None,
        prometheus_port: int | None = None,
        mlflow: tuple[Any, Path] | None = None,
    ) -> None:
        """``mlflow``: (the run's ConvergentConfig, run directory) to log to its MLflow run."""
        self.sinks: list[Any] = []
        if jsonl is not None:
            self.sinks.append(JsonlSink(jsonl))
        if tensorboard_dir is not None:
            self.sinks.append(TensorBoardSink(tensorboard_dir))
        if prometheus_port is not None:
            self.sinks.append(PrometheusSink(prometheus_port))
        if mlflow is not None:
            from convergent.tracking.sink import MlflowSink

            self.sinks.append(MlflowSink(*mlflow))

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def commit(self, step: int) -> None:
        """A checkpoint of ``step`` was written: a resume never replays the steps up to
        it, so sinks that keep one value per step (MLflow) may send them now."""
        for sink in self.sinks:
            if hasattr(sink, "commit"):
                sink.commit(step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
