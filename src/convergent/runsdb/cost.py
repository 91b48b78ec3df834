"""``runs cost``: core-seconds and GPU-seconds per stage and per run.

Costs come from *sources*, each a function ``RunDir -> list[CostRecord]``:

* :func:`self_costs` — the run's own ``stages.json`` (``wall_s`` x the ``cores``/``gpus``
  the stage held, recorded by :func:`convergent.runsdb.usage.timed_stage`), so the sums
  equal the stage timings there;
* :func:`accounting_costs` — the scheduler's lines of ``<run>/accounting.jsonl`` (typed
  JSONL with :class:`CostRecord`'s fields ``stage``, ``wall_s``, ``core_s``, ``gpu_s``,
  ``source``, ``job_id``; other keys ignored): what Slurm (``sacct``/jobcomp) billed a
  stage. Its ``source: "self"`` lines are skipped — a stage's own use comes from
  ``stages.json``, once.

A new source is one more function appended to :data:`SOURCES`. In the totals a stage
counts once: its scheduler records when it has any, else its own timing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from convergent.runsdb.records import CostRecord
from convergent.runsdb.rundir import RunDir

ACCOUNTING_FILE = "accounting.jsonl"


def self_costs(run: RunDir) -> list[CostRecord]:
    """One record per finished stage of ``stages.json`` that has a ``wall_s``."""
    out = []
    for stage, s in run.stages().items():
        wall = s.get("wall_s")
        if not isinstance(wall, int | float):
            continue
        cores = float(s.get("cores") or 1.0)  # before cores were recorded: one process
        gpus = float(s.get("gpus") or 0.0)
        out.append(CostRecord(stage=stage, wall_s=float(wall), core_s=wall * cores,
                              gpu_s=wall * gpus, cores=cores, gpus=gpus,
                              cpu_s=s.get("cpu_s"), source="self"))
    return out


def accounting_costs(run: RunDir) -> list[CostRecord]:
    """The non-``self`` records of ``<run>/accounting.jsonl`` (torn/foreign lines skipped)."""
    path = run.path / ACCOUNTING_FILE
    out: list[CostRecord] = []
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = CostRecord.from_dict(json.loads(line))
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError):
            continue
        if rec.source != "self":
            out.append(rec)
    return out


SOURCES: list[Callable[[RunDir], list[CostRecord]]] = [self_costs, accounting_costs]


@dataclass
class RunCost:
    """Every record of a run, and per-stage/run totals (scheduler records win a stage)."""

    name: str
    records: list[CostRecord] = field(default_factory=list)

    def by_stage(self) -> dict[str, CostRecord]:
        """One record per stage: the sum of its scheduler records, else its own timing."""
        out: dict[str, CostRecord] = {}
        stages = list(dict.fromkeys(r.stage for r in self.records))
        for stage in stages:
            billed = [r for r in self.records if r.stage == stage and r.source != "self"]
            own = [r for r in self.records if r.stage == stage and r.source == "self"]
            chosen = billed or own
            out[stage] = CostRecord(
                stage=stage,
                wall_s=sum(r.wall_s for r in chosen),
                core_s=sum(r.core_s for r in chosen),
                gpu_s=sum(r.gpu_s for r in chosen),
                cores=chosen[0].cores if len(chosen) == 1 else None,
                gpus=chosen[0].gpus if len(chosen) == 1 else None,
                cpu_s=sum(r.cpu_s for r in chosen) if all(r.cpu_s is not None for r in chosen) else None,
                source=chosen[0].source,
                job_id=",".join(sorted({r.job_id for r in chosen if r.job_id})) or None,
            )
        return out

    def total(self) -> dict[str, float]:
        stages = self.by_stage().values()
        return {"wall_s": sum(r.wall_s for r in stages), "core_s": sum(r.core_s for r in stages),
                "gpu_s": sum(r.gpu_s for r in stages)}

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.name, "stages": [r.to_dict() for r in self.by_stage().values()],
                "total": self.total(), "records": [r.to_dict() for r in self.records]}


def run_cost(run: RunDir) -> RunCost:
    """Collect the records of every source for ``run``."""
    records: list[CostRecord] = []
    for source in SOURCES:
        records += source(run)
    return RunCost(run.path.name, records)
