"""Typed training metric records: the ``train_step`` and ``val`` lines of metrics.jsonl.

The trainer writes them (:meth:`TrainStep.to_dict`), and every reader — the run report
and its diagnosis, ``runs compare``, the demo, the CLI progress lines, the tests and the
benches — reads them back with :meth:`TrainStep.from_dict` / :meth:`ValRecord.from_dict`
(or ``from_metric`` on a :class:`convergent.runsdb.records.MetricRecord`) instead of
re-spelling the keys. The on-disk lines are flat JSON objects with the field names below
(throughput as ``atoms_per_s`` or ``tokens_per_s`` after the task's unit); a key a
reader does not know is kept in ``extra`` and written back, a missing one reads as None,
so lines of older runs still read.

:func:`read_train_records` reads a whole metrics.jsonl into typed step and val records
(other kinds of lines are left to their own readers). Standard library and
:mod:`convergent.core.fsutil` only: it sits below every layer that writes or reads training
metrics.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol, TypeVar

from convergent.core.fsutil import read_jsonl

# parts of a training step's wall time (seconds); they add up to ``step_s``
TIME_PARTS = ("data_wait_s", "compute_s", "comm_s", "optimizer_s")
UNITS = ("atoms", "tokens")  # the molecular task counts atoms, the language model tokens


def as_number(v: Any) -> float | None:
    """``v`` as a float, or None when it is missing or not a number (a bool is not)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


@dataclass
class TaskMetrics:
    """The task's loss and errors, from global sums (train step or validation).

    Molecular: ``energy_mae`` (eV per molecule), ``energy_mae_per_atom`` (eV/atom),
    ``force_mae`` (eV/Å per component), and in validation ``baseline_energy_mae``. Language model: ``perplexity``. A metric the
    task does not have is None and is left out of the line.
    """

    loss: float | None = None
    energy_mae: float | None = None
    energy_mae_per_atom: float | None = None
    force_mae: float | None = None
    perplexity: float | None = None
    # validation only: the per-element baseline (the model's element reference energies,
    # fitted on the training data) on the same structures, eV per molecule
    baseline_energy_mae: float | None = None


@dataclass
class _Record(TaskMetrics):
    KIND: ClassVar[str] = ""
    # fields written only when set (the rest are written as null when None)
    OPTIONAL: ClassVar[frozenset[str]] = frozenset(
        {"loss", "energy_mae", "energy_mae_per_atom", "force_mae", "perplexity", "time",
         "baseline_energy_mae"}
    )

    step: int = 0
    attempt: int = 0
    time: float | None = None  # unix s the line was written (added by the JSONL sink)
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know

    @classmethod
    def _known(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Any:
        """A record from one metrics.jsonl line (missing keys read as None)."""
        known = set(cls._known())
        kw: dict[str, Any] = {k: row[k] for k in known if k in row}
        kw["step"] = int(row.get("step") or 0)
        kw["attempt"] = int(row.get("attempt") or 0)
        extra = {k: v for k, v in row.items() if k not in known and k != "kind"}
        extra = cls._take_extra(kw, extra)  # may move keys into ``kw``
        return cls(**kw, extra=extra)

    @classmethod
    def _take_extra(cls, kw: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        return extra

    @classmethod
    def from_metric(cls, rec: Any) -> Any:
        """From a :class:`~convergent.runsdb.records.MetricRecord` (header + values)."""
        return cls.from_dict({**rec.values, "step": rec.step, "attempt": rec.attempt,
                              "time": rec.time})

    def to_dict(self) -> dict[str, Any]:
        """The flat JSON line: ``kind``, then the fields (``time`` is the sink's)."""
        out: dict[str, Any] = {"kind": self.KIND}
        for name in self._known():
            v = getattr(self, name)
            if v is None and name in self.OPTIONAL:
                continue
            out[name] = v
        return {**out, **self.extra}

    def set_metrics(self, metrics: dict[str, float]) -> None:
        """Set the task metrics (a name this version does not know goes to ``extra``)."""
        names = {f.name for f in fields(TaskMetrics)}
        for k, v in metrics.items():
            if k in names:
                setattr(self, k, v)
            else:
                self.extra[k] = v

    def metrics(self) -> dict[str, float]:
        """The task metrics that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(TaskMetrics)
                if getattr(self, f.name) is not None}


@dataclass
class ValRecord(_Record):
    """One validation pass over the held-out set (``kind: val``)."""

    KIND: ClassVar[str] = "val"


@dataclass
class TrainStep(_Record):
    """One optimizer step (``kind: train_step``), written by rank 0.

    Times in seconds (``TIME_PARTS`` add up to ``step_s``); throughput is global (all
    ranks): ``samples_per_s`` molecules or sequences, ``units_per_s`` atoms or tokens
    (the line's key is ``atoms_per_s`` / ``tokens_per_s`` after ``unit``); ``mfu`` is
    None when the FLOPs could not be counted.
    """

    KIND: ClassVar[str] = "train_step"
    OPTIONAL: ClassVar[frozenset[str]] = _Record.OPTIONAL | {"loss_scale"}

    lr: float | None = None
    grad_norm: float | None = None
    start_time: float | None = None  # unix s at step start
    peak_mem_bytes: int | None = None
    comm_bytes: int | None = None  # gradient payload counted by the DDP comm hook
    strategy: str | None = None
    world: int | None = None
    loss_scale: float | None = None  # fp16 only
    data_wait_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    optimizer_s: float | None = None
    step_s: float | None = None
    samples_per_s: float | None = None
    unit: str = "atoms"
    units_per_s: float | None = None
    mfu: float | None = None
    peak_flops: float | None = None  # per-process peak FLOP/s used for the MFU
    peak_source: str | None = None

    @classmethod
    def _known(cls) -> list[str]:
        return [n for n in super()._known() if n not in ("unit", "units_per_s")]

    @classmethod
    def _take_extra(cls, kw: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        for unit in UNITS:
            if f"{unit}_per_s" in extra:
                kw["unit"], kw["units_per_s"] = unit, extra.pop(f"{unit}_per_s")
        return extra

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        rest = {k: out.pop(k) for k in ("mfu", "peak_flops", "peak_source", *self.extra)}
        return {**out, f"{self.unit}_per_s": self.units_per_s, **rest}

    def times(self) -> dict[str, float] | None:
        """The step's time parts (``TIME_PARTS``), or None when a part is missing."""
        vals = {k: as_number(getattr(self, k)) for k in TIME_PARTS}
        return None if any(v is None for v in vals.values()) else vals  # type: ignore[return-value]


class _Stepped(Protocol):
    step: Any
    attempt: int


R = TypeVar("R", bound=_Stepped)


def last_per_step(records: Iterable[R]) -> list[R]:
    """The record of the highest attempt of each step (the later one on ties), by step:
    a restarted job logs the steps after its last checkpoint again. The one rule for every
    stepped record (``runsdb.records.last_attempts`` applies it per kind)."""
    best: dict[int, R] = {}
    for r in records:
        if r.step not in best or r.attempt >= best[r.step].attempt:
            best[r.step] = r
    return [best[s] for s in sorted(best)]


def parse_train_records(
    rows: Iterable[dict[str, Any]], *, last_attempt: bool = False
) -> tuple[list[TrainStep], list[ValRecord]]:
    """The ``train_step`` and ``val`` lines among ``rows`` as typed records, in order (or,
    with ``last_attempt``, the last attempt of each step, by step); other kinds are skipped."""
    rows = list(rows)
    steps = [TrainStep.from_dict(r) for r in rows if r.get("kind") == TrainStep.KIND]
    vals = [ValRecord.from_dict(r) for r in rows if r.get("kind") == ValRecord.KIND]
    if last_attempt:
        return last_per_step(steps), last_per_step(vals)
    return steps, vals


def read_train_records(
    path: str | os.PathLike[str], *, last_attempt: bool = False
) -> tuple[list[TrainStep], list[ValRecord]]:
    """The typed train steps and val records of a metrics.jsonl (a missing file: none)."""
    return parse_train_records(read_jsonl(path), last_attempt=last_attempt)
