"""Run a list of tasks into a dataset: resume bookkeeping, cluster, writer, progress, farm.

Shared by the simulation campaign and multi-fidelity relabelling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from convergent.cluster.config import ClusterConfig
from convergent.sim.farm import Farm, n_workers
from convergent.sim.guards import Backstop
from convergent.sim.progress import make_progress
from convergent.sim.quarantine import QUARANTINE_NAME, QuarantineLog
from convergent.sim.resume import open_existing
from convergent.sim.summary import CampaignSummary
from convergent.sim.tasks import Task


def slurm_watch(client, cluster: ClusterConfig, farm: Farm):
    """Start a :class:`~convergent.cluster.slurm.JobWatch` on the client's SLURMCluster that
    shows job counts on the farm's progress line and aborts the farm when no job can start."""
    from convergent.cluster.pinning import PinWorker
    from convergent.cluster.slurm import JobWatch, describe_request, resolved_job_size

    client.register_plugin(PinWorker())  # one core of the job's allocation per worker
    s = cluster.slurm
    request = describe_request(*resolved_job_size(s.cores, s.memory, s.queue), s.queue)
    watch = JobWatch(client.cluster, client, s.start_timeout_s, request,
                     on_error=farm.abort, on_change=lambda _: farm.refresh_status())
    farm.extra_status = lambda: str(watch.counts)
    watch.start()
    return watch


def _resume_plan(tasks: list[Task], dataset: Path, existing: Any, retry_quarantined: bool,
                 summary: CampaignSummary) -> tuple[QuarantineLog, set[str], list[Task]]:
    """(quarantine log, keys to skip, tasks with work left) of a campaign over ``dataset``
    (``existing``: its committed dataset or None); fills the summary's counts."""
    qlog = QuarantineLog(dataset / QUARANTINE_NAME)
    committed = set(existing.keys()) if existing is not None else set()
    skip = committed | (set() if retry_quarantined else qlog.keys())
    all_keys = [k for t in tasks for k in t.keys]
    summary.total_frames = len(all_keys)
    summary.tasks = len(tasks)
    summary.skipped = sum(1 for k in all_keys if k in skip)
    summary.dataset = str(dataset)
    summary.quarantine_file = str(qlog.path)
    return qlog, skip, [t for t in tasks if any(k not in skip for k in t.keys)]


def run_tasks(
    tasks: list[Task],
    dataset: Path,
    cluster: ClusterConfig,
    summary: CampaignSummary,
    *,
    retries: int,
    retry_quarantined: bool,
    max_in_flight: int | None,
    flush_every_s: float,
    tag: str,
    progress: bool,
    client=None,
    console=None,
    on_task: Callable | None = None,
    description: str = "simulate",
    backstop_s: float | None = None,
) -> CampaignSummary:
    """Resume bookkeeping + cluster + writer around :class:`Farm`."""
    from convergent.cluster.pool import dashboard_link, dask_client, describe_dashboard
    from convergent.data.writer import DatasetWriter

    # the dataset is opened once: its keys decide what to skip, the writer appends to it
    existing = open_existing(dataset)
    with contextlib.closing(existing) if existing is not None else contextlib.nullcontext():
        qlog, skip, todo = _resume_plan(tasks, dataset, existing, retry_quarantined, summary)
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        echo = console.print if progress else None

        @contextlib.contextmanager
        def _client():
            if client is not None:
                yield client
            else:
                with dask_client(cluster, echo=echo) as c:
                    yield c

        if not todo:
            if progress:
                console.print(f"{description}: all {summary.total_frames} frames already done "
                              f"({summary.skipped} skipped)")
            return summary
        bar_ctx = make_progress(progress, console)
        with _client() as c, bar_ctx as prog:
            summary.n_workers = n_workers(c)
            summary.dashboard = dashboard_link(c)
            if progress and client is not None:
                console.print(f"dask: {summary.n_workers} workers; dashboard: "
                              f"{describe_dashboard(summary.dashboard)}")
            bar = prog.add_task(description, total=summary.total_frames,
                                completed=summary.skipped, status="")
            with DatasetWriter(dataset, schema="molecular", append=True,
                               existing=existing) as writer:
                farm = Farm(c, writer, qlog, skip, retries, tag, max_in_flight, flush_every_s,
                             summary, prog, bar, on_task)
                watch = None
                if client is None and cluster.kind == "slurm":
                    farm.min_in_flight = 3 * cluster.slurm.adapt_max
                    watch = slurm_watch(c, cluster, farm)
                if backstop_s:
                    farm.backstop = Backstop(c, tag, backstop_s)
                try:
                    farm.run(todo)
                finally:
                    if watch is not None:
                        watch.stop()
                        summary.slurm_jobs_replaced = len(watch.replaced_ids)
                        summary.slurm_job_ids = sorted(watch.seen_ids, key=int)
                        summary.n_workers = max(summary.n_workers, watch.max_workers)
        return summary
