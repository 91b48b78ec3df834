"""Per-step metrics to MLflow: the trainer's rank 0 sends each record here.

Numeric fields become MLflow metrics ``<kind>/<field>`` at the record's ``step`` (with
its time). They are held until a checkpoint is written (``commit``) or training ends
(``close``): a resumed run replays the steps after its last checkpoint, and MLflow keeps
every value it is sent, so sending only checkpointed steps keeps one value per step —
the last attempt's, as every other reader shows. ``tracking.max_pending`` caps what is
held (beyond it values are sent at once, and a replayed step may then appear twice).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from convergent.tracking.store import open_tracking

SKIP = {"step", "time", "attempt", "start_time"}


class MlflowSink:
    """A metric sink (``write``/``close``) logging to the run directory's MLflow run."""

    def __init__(self, cfg: Any, run_path: str | Path) -> None:
        from mlflow.entities import Metric

        self._Metric = Metric
        self.tracked = open_tracking(cfg, run_path)
        self.max_pending = cfg.tracking.max_pending
        self.pending: list[Any] = []

    def write(self, record: dict[str, Any]) -> None:
        kind = str(record.get("kind", "metrics"))
        step = int(record.get("step", 0) or 0)
        ms = int(float(record.get("time") or time.time()) * 1000)
        for k, v in record.items():
            if k in SKIP or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            self.pending.append(self._Metric(f"{kind}/{k}", float(v), ms, step))
        if len(self.pending) >= self.max_pending:
            self.flush()

    def commit(self, step: int) -> None:
        """Steps up to ``step`` are checkpointed: send what is held."""
        self.flush()

    def flush(self) -> None:
        while self.pending:
            chunk, self.pending = self.pending[:1000], self.pending[1000:]
            self.tracked.client.log_batch(self.tracked.run_id, metrics=chunk)

    def close(self) -> None:
        self.flush()
