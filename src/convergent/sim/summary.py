"""The outcome of a campaign: counts, timings and failure reasons."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from convergent.runsdb.accounting import Usage


@dataclass
class CampaignSummary:
    """Outcome of one :func:`run_campaign` / :func:`relabel` call.

    ``done``: records written in this call; ``skipped``: frames already present from an
    earlier run; ``quarantined``: frames quarantined in this call; ``retried``: task
    re-submissions (failed attempts); ``wall_s``: whole call including cluster start-up;
    ``frames_per_s`` = done / wall_s; ``mean_calc_s``: mean seconds of one calculation.
    """

    done: int = 0
    retried: int = 0
    quarantined: int = 0
    wall_s: float = 0.0
    frames_per_s: float = 0.0
    mean_calc_s: float = 0.0
    skipped: int = 0
    tasks: int = 0
    tasks_run: int = 0
    split: int = 0
    input_rejected: int = 0
    n_workers: int = 0
    compute_wall_s: float = 0.0  # first submission to last result
    calc_s: float = 0.0  # summed calculator seconds
    n_calcs: int = 0  # calculator calls (MD: every step)
    task_wall_s: float = 0.0  # summed task seconds on workers
    total_frames: int = 0
    dataset: str = ""
    quarantine_file: str = ""
    dashboard: str | None = None
    reasons: dict[str, int] = field(default_factory=dict)
    slurm_jobs_replaced: int = 0  # worker jobs that ended early and were resubmitted
    slurm_job_ids: list[str] = field(default_factory=list)  # every worker job submitted

    def usage(self, stage: str = "simulate") -> Usage:
        """The campaign's own core-seconds (tasks run on single-threaded workers)."""
        return Usage(stage, "self", core_s=self.task_wall_s, wall_s=self.wall_s,
                     cores=self.n_workers, detail={"job_ids": list(self.slurm_job_ids),
                                                   "tasks_run": self.tasks_run})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """One human line: done / retried / quarantined, wall time, frames/s."""
        return (
            f"done {self.done}  skipped {self.skipped}  retried {self.retried}  "
            f"quarantined {self.quarantined}  wall {self.wall_s:.1f} s  "
            f"{self.frames_per_s:.1f} frames/s  mean calc {self.mean_calc_s * 1e3:.1f} ms"
        )


def finish(summary: CampaignSummary, t0: float) -> CampaignSummary:
    """Fill in wall time (s since ``t0``, a ``perf_counter`` value), frames/s, mean calc s."""
    summary.wall_s = time.perf_counter() - t0
    summary.frames_per_s = summary.done / summary.wall_s if summary.wall_s > 0 else 0.0
    summary.mean_calc_s = summary.calc_s / summary.n_calcs if summary.n_calcs else 0.0
    return summary

