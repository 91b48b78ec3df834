"""Typed records of a run: metric lines of ``metrics.jsonl`` and cost/accounting lines.

A :class:`MetricRecord` is one line of ``metrics.jsonl``: a header (``kind``, ``step``,
``attempt``, ``time``) and the numeric/string ``values``. ``attempt`` counts launches of
the same run (0 first, +1 on every resume or elastic restart); a resumed job replays the
steps after its last checkpoint, so a step can appear once per attempt.
:func:`last_attempts` keeps, for each (kind, step), the record of the latest attempt —
what every reader (report, runs compare, MLflow) shows.

A :class:`CostRecord` is one stage's resource use: wall seconds and the cores/GPUs it
held (``core_s = wall_s * cores``), from the run's own timings (``source="self"``) or a
scheduler's accounting (``source="slurm"``, with ``job_id``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from convergent.core.fsutil import read_jsonl
from convergent.runsdb.trainrecords import last_per_step

HEADER = ("kind", "step", "attempt", "time")


@dataclass
class MetricRecord:
    """One metrics.jsonl line: header fields plus ``values`` (everything else)."""

    kind: str
    step: int | None = None
    attempt: int = 0
    time: float | None = None
    values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> MetricRecord:
        step = row.get("step")
        return cls(
            kind=str(row.get("kind", "metrics")),
            step=int(step) if isinstance(step, int | float) else None,
            attempt=int(row.get("attempt") or 0),
            time=row.get("time"),
            values={k: v for k, v in row.items() if k not in HEADER},
        )

    def to_dict(self) -> dict[str, Any]:
        """The flat JSON line (header first; ``step`` omitted when None)."""
        out: dict[str, Any] = {"time": self.time if self.time is not None else time.time(),
                               "kind": self.kind}
        if self.step is not None:
            out["step"] = self.step
        out["attempt"] = self.attempt
        return {**out, **self.values}

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def number(self, key: str) -> float | None:
        """``values[key]`` as a float, or None when missing or not a number."""
        v = self.values.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def read_records(path: str | Path, kind: str | None = None) -> list[MetricRecord]:
    """Every record of a metrics.jsonl (a torn or foreign line is skipped)."""
    return [MetricRecord.from_dict(row) for row in read_jsonl(path)
            if kind is None or row.get("kind") == kind]


def last_attempts(records: list[MetricRecord]) -> list[MetricRecord]:
    """For each (kind, step) the record of the highest attempt (the later line on ties);
    records without a step are kept as they are. Stepped records come out sorted by step."""
    plain = [r for r in records if r.step is None]
    kinds = sorted({r.kind for r in records if r.step is not None})
    return plain + [r for kind in kinds for r in last_per_step(
        x for x in records if x.kind == kind and x.step is not None)]


def latest(path: str | Path, kind: str) -> list[MetricRecord]:
    """The ``kind`` records of a metrics.jsonl, last attempt per step, sorted by step."""
    return last_attempts(read_records(path, kind))


def next_attempt(path: str | Path) -> int:
    """The attempt number for a new launch: 1 + the highest recorded, 0 for a fresh run."""
    attempts = [r.attempt for r in read_records(path) if r.step is not None]
    return max(attempts) + 1 if attempts else 0


Source = Literal["self", "slurm"]


@dataclass(frozen=True)
class CostRecord:
    """One stage's resource use. ``core_s``/``gpu_s`` are allocation-seconds (what a
    scheduler bills: held x wall), ``cpu_s`` the measured CPU time where known."""

    stage: str
    wall_s: float
    core_s: float
    gpu_s: float = 0.0
    cores: float | None = None
    gpus: float | None = None
    cpu_s: float | None = None
    source: Source = "self"
    job_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> CostRecord:
        known = {k: row[k] for k in cls.__dataclass_fields__ if k in row}
        return cls(**known)
