"""``convergent simulate`` below the CLI: the campaign into a dataset or a run directory.

Without an output directory the dataset goes to ``<run dir>/data/sim``: the run is
opened (its inputs checked first, so a bad source leaves nothing), each task's metrics
go to the run's metrics.jsonl, and the stage is marked done with its usage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from convergent.config import ConvergentConfig
from convergent.runsdb.accounting import append_usage
from convergent.runsdb.rundir import RunDir, open_run
from convergent.runsdb.usage import held
from convergent.sim.campaign import CampaignSummary, run_campaign
from convergent.sim.sources import check_source


def simulate_command(
    cfg: ConvergentConfig, out: Path | None = None, run_dir: Path | None = None,
    resume: bool = False, progress: bool = True, console: Any = None,
) -> CampaignSummary:
    """Run the ``simulate`` campaign of ``cfg`` into ``out`` (None: the run directory)."""
    run: RunDir | None = None
    if out is None:
        run = open_run(cfg, run_dir, resume=resume, command="simulate",
                       check=lambda: check_source(cfg.simulate.source, cfg.simulate.on_bad_input))
        out = run.data / "sim"
    on_task = None
    if run is not None:
        def on_task(task, result, summ) -> None:  # noqa: ANN001 - per-task metrics for the report
            run.log_metrics({
                "kind": "simulate.task", "task": task.task_id,
                "frames": len(result.records), "quarantined": len(result.quarantined),
                "calc_s": result.calc_s, "task_s": result.wall_s, "host": result.host,
                "pid": result.pid, "cpus": result.cpus,
                "slurm_job_id": result.slurm_job_id, "done_total": summ.done,
            })
    summary = run_campaign(cfg.simulate, cfg.cluster, out, progress=progress,
                           console=console, on_task=on_task)
    if run is not None:
        run.log_metrics({"kind": "simulate", **summary.to_dict()})
        run.mark_done("simulate", {**summary.to_dict(), **held(cfg, "simulate")})
        append_usage(run.path, [summary.usage()])
    return summary
