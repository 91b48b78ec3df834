"""Slurm-side care of a dask-jobqueue cluster: job size, refusal, lost jobs, job counts.

dask-jobqueue submits worker jobs and forgets them: a job that sbatch refuses is retried
forever, a job that never starts leaves the campaign waiting, and a job that ends early
(``scancel``, node failure, walltime) stays in the cluster's plan, so adaptive scaling never
submits a replacement. This module closes those gaps with Slurm's own commands:

* :func:`job_size` fills ``cluster.slurm.cores``/``memory`` from ``sinfo`` when unset (the
  largest node of the partition, 90 % of its memory in whole GiB);
* :func:`preflight` runs the cluster's job script through ``sbatch --test-only`` and turns a
  refusal into one :class:`~convergent.core.errors.ConfigError` naming the field to change and
  quoting sbatch;
* :class:`JobAdaptive` scales in whole jobs: dask-jobqueue's adaptive loop counts
  workers, and with several workers per job it retires one worker of a job that is still
  starting, which cancels the whole job, resubmits it, and so on forever;
  :class:`KindAdaptive` is the same for one job kind of a pool with several kinds under
  one scheduler (CPU jobs and GPU jobs): it counts only the tasks and workers of its kind;
* :class:`JobWatch` (a thread) polls ``squeue`` for the cluster's jobs: it counts pending
  and running jobs for the progress line, removes ended jobs from the cluster's plan (the
  adaptive loop then submits a replacement), and reports an error when no worker has been
  connected for ``cluster.slurm.start_timeout_s`` while work waits (or at once when Slurm
  says a pending job can never start), with each pending job's reason. One watch per job
  kind: it counts the workers of its own cluster's jobs.
"""

from __future__ import annotations

import itertools
import logging
import math
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dask
from dask.utils import parse_timedelta
from distributed.deploy.adaptive import Adaptive

from convergent.core.errors import ConfigError, ConvergentError

log = logging.getLogger(__name__)

#: Pending reasons that no amount of waiting resolves.
HOPELESS = ("PartitionConfig", "BadConstraints", "PartitionNodeLimit", "PartitionTimeLimit",
            "AccountNotAllowed", "QOSNotAllowed", "InvalidAccount", "InvalidQOS")
#: Job states after which a job holds no worker any more.
ENDED = {"CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}


def _run(cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def job_size(queue: str | None) -> tuple[int, str]:
    """(cores, memory) of the largest node of ``queue`` (default partition if None)."""
    if shutil.which("sinfo") is None:
        raise ConfigError("cluster.slurm.cores/memory are not set and sinfo is not on PATH",
                          hint="set cluster.slurm.cores and cluster.slurm.memory")
    cmd = ["sinfo", "-h", "-o", "%c %m"] + (["-p", queue] if queue else [])
    out = _run(cmd)
    sizes = []
    for line in out.stdout.splitlines():
        parts = line.replace("+", "").split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            sizes.append((int(parts[0]), int(parts[1])))
    if out.returncode != 0 or not sizes:
        what = (f"cluster.slurm.queue={queue!r}: sinfo lists no nodes in that partition"
                if queue else "sinfo lists no nodes in the default partition")
        detail = (out.stderr or "").strip()
        raise ConfigError(f"{what}{': ' + detail if detail else ''}",
                          hint="sinfo -s lists the partitions; or set cluster.slurm.cores "
                          "and cluster.slurm.memory")
    cpus = max(c for c, _ in sizes)
    mem_mb = min(m for c, m in sizes if c == cpus)
    gib = int(mem_mb * 0.9) // 1024
    return cpus, (f"{gib}GiB" if gib >= 1 else f"{max(1, int(mem_mb * 0.9))}MiB")


def resolved_job_size(cores: int | None, memory: str | None, queue: str | None) -> tuple[int, str]:
    """``cores`` and ``memory`` as configured, the unset ones from :func:`job_size`."""
    if cores is not None and memory is not None:
        return cores, memory
    node_cores, node_memory = job_size(queue)
    return (cores if cores is not None else node_cores), (memory or node_memory)


def _fields_for(message: str, section: str = "cluster.slurm") -> str:
    m = message.lower()
    if "partition" in m:
        return f"{section}.queue"
    if "gres" in m or "generic resource" in m:
        return f"{section}.gres"
    if "memory" in m:
        return f"{section}.memory"
    if "time limit" in m:
        return f"{section}.walltime"
    if "account" in m or "association" in m:
        return f"{section}.account"
    if "qos" in m:
        return f"{section}.job_extra_directives"
    return f"{section}.cores / {section}.memory"


def describe_request(cores: int, memory: str, queue: str | None, section: str = "cluster.slurm",
                     gres: str | None = None) -> str:
    where = f"partition {queue!r}" if queue else "the default partition"
    extra = f", {section}.gres={gres}" if gres else ""
    return f"{section}.cores={cores}, {section}.memory={memory}{extra} on {where}"


def preflight(job_script: str, request: str, section: str = "cluster.slurm") -> None:
    """``sbatch --test-only`` the worker job; ConfigError naming the field if refused."""
    if shutil.which("sbatch") is None:
        raise ConfigError("cluster.kind=slurm needs sbatch on PATH",
                          hint="run on a Slurm login node, or use cluster.kind=local")
    with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as fh:
        fh.write(job_script)
    try:
        out = _run(["sbatch", "--test-only", fh.name])
    finally:
        Path(fh.name).unlink(missing_ok=True)
    if out.returncode == 0:
        return
    lines = [ln.strip() for ln in (out.stderr or out.stdout).splitlines() if ln.strip()]
    msg = lines[-1] if lines else f"exit code {out.returncode}"
    raise ConfigError(
        f"Slurm refuses the Dask worker job ({request}): {msg}; change {_fields_for(msg, section)}",
        hint="sinfo -o '%P %c %m %l' lists partitions with their node CPUs, memory and "
        "time limit",
    )


@dataclass
class JobCounts:
    """What the progress line shows: Slurm jobs by state and connected Dask workers."""

    pending: int = 0
    running: int = 0
    workers: int = 0
    replaced: int = 0

    def __str__(self) -> str:
        extra = f", {self.replaced} replaced" if self.replaced else ""
        return (f"jobs {self.pending} pending {self.running} running{extra}, "
                f"workers {self.workers}")


def squeue_states(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, reason)} for ``job_ids`` still known to slurmctld."""
    if not job_ids:
        return {}
    out = _run(["squeue", "-h", "-t", "all", "-o", "%i|%T|%r", "-j", ",".join(job_ids)])
    states = {}
    for line in out.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3:
            states[parts[0]] = (parts[1], parts[2])
    return states


class JobWatch(threading.Thread):
    """Poll squeue for a SLURMCluster's jobs (see module doc); ``error`` once hopeless."""

    def __init__(self, cluster, client, start_timeout_s: float, request: str,
                 on_error: Callable[[ConvergentError], None] | None = None,
                 on_change: Callable[[JobCounts], None] | None = None,
                 interval_s: float = 2.0, section: str = "cluster.slurm") -> None:
        super().__init__(name="convergent-slurm-jobs", daemon=True)
        self.cluster, self.client = cluster, client
        self.start_timeout_s, self.request = start_timeout_s, request
        self.section = section  # the config section of this job kind, for messages
        self.on_error, self.on_change = on_error, on_change
        self.interval_s = interval_s
        self.counts = JobCounts()
        self.error: ConvergentError | None = None
        self.replaced_ids: list[str] = []
        self.seen_ids: set[str] = set()
        self.max_workers = 0
        self._no_workers_since: float | None = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the watch must outlive a failed squeue
                log.warning("slurm job watch: %s", exc)
            if self.error is not None:
                return

    def stop(self) -> None:
        """Stop polling; ``seen_ids`` then also holds jobs submitted since the last poll
        (a replacement submitted just before the campaign ended)."""
        self._halt.set()
        try:
            self.seen_ids.update(self._jobs().values())
        except Exception as exc:  # noqa: BLE001 - a summary detail, never fatal
            log.warning("slurm job watch: %s", exc)

    def _jobs(self) -> dict[str, str]:
        """{job name in the cluster's plan: Slurm job id} for submitted jobs."""
        jobs = {}
        for name, job in list(self.cluster.workers.items()):
            job_id = getattr(job, "job_id", None)
            if job_id and name in self.cluster.worker_spec:
                jobs[name] = str(job_id)
        return jobs

    def check(self, now: float | None = None) -> JobCounts:
        now = time.monotonic() if now is None else now
        jobs = self._jobs()
        self.seen_ids.update(jobs.values())
        states = squeue_states(list(jobs.values()))
        # this cluster's workers only: another job kind may share the scheduler
        workers = sum(1 for w in self.client.scheduler_info().get("workers", {}).values()
                      if job_name(str(w.get("name"))) in jobs)
        self.max_workers = max(self.max_workers, workers)
        counts = JobCounts(workers=workers, replaced=self.counts.replaced)
        ended = []
        hopeless = []
        for name, job_id in jobs.items():
            state, reason = states.get(job_id, ("GONE", ""))
            if state == "GONE" or state in ENDED:
                ended.append((name, job_id, state))
            elif state == "PENDING":
                counts.pending += 1
                if reason in HOPELESS:
                    hopeless.append((job_id, reason))
            else:
                counts.running += 1
        if ended:
            self._replace(ended)
            counts.replaced += len(ended)
        self.counts = counts
        if self.on_change is not None:
            self.on_change(counts)
        if workers or not self.cluster.worker_spec:  # connected, or no job wanted
            self._no_workers_since = None
        elif self._no_workers_since is None:
            self._no_workers_since = now
        waited = 0.0 if self._no_workers_since is None else now - self._no_workers_since
        if hopeless or (workers == 0 and waited > self.start_timeout_s):
            self._fail(states, jobs, hopeless, waited)
        return counts

    def _replace(self, ended: list[tuple[str, str, str]]) -> None:
        """Drop ended jobs from the plan; the adaptive loop submits replacements."""
        names = [n for n, _, _ in ended]
        for _, job_id, state in ended:
            log.warning("slurm job %s ended (%s); submitting a replacement", job_id, state)
            self.replaced_ids.append(job_id)

        def drop() -> None:
            for n in names:
                self.cluster.worker_spec.pop(n, None)
            self.cluster._correct_state()

        self.cluster.loop.add_callback(drop)

    def _fail(self, states, jobs, hopeless, waited: float) -> None:
        if hopeless:
            why = "; ".join(f"job {j} pending with reason {r}" for j, r in hopeless)
            msg = f"Slurm will never start the Dask worker jobs ({self.request}): {why}"
        else:
            pending = [f"job {j} {states.get(j, ('GONE', ''))[0]} ({states.get(j, ('', ''))[1]})"
                       for j in jobs.values()]
            msg = (f"no Dask worker job started within cluster.slurm.start_timeout_s="
                   f"{self.start_timeout_s:g} s ({self.request}): "
                   f"{'; '.join(pending) or 'no job in the queue'}")
        self.error = ConfigError(
            msg, hint=f"change {self.section}.cores/memory/queue/walltime (squeue -j ID "
            "shows why a job waits) or raise cluster.slurm.start_timeout_s")
        if self.on_error is not None:
            self.on_error(self.error)


def job_of_worker(ws) -> str:
    """The job a worker belongs to (``worker_key`` of :class:`JobAdaptive`)."""
    return job_name(str(ws.name))


def job_name(worker: str) -> str:
    """``SLURMCluster-3-1`` (process 1 of job 3) -> ``SLURMCluster-3``; job names as is."""
    head, _, tail = worker.rpartition("-")
    return head if head.count("-") >= 1 and tail.isdigit() else worker


class JobAdaptive(Adaptive):
    """Adaptive scaling in whole jobs that never cancels a job whose workers are starting."""

    def _per_job(self) -> int:
        return max(1, int(getattr(getattr(self.cluster, "_dummy_job", None),
                                  "worker_processes", 1)))

    async def recommendations(self, target: int) -> dict:
        p = self._per_job()
        target = min(int(self.maximum), math.ceil(target / p) * p)
        rec = await super().recommendations(target)
        if rec.get("status") != "down":
            return rec
        arrived = self.observed
        chosen = {w for w in rec["workers"] if w in arrived}
        jobs: dict[str, set[str]] = {}
        for w in self.plan:
            jobs.setdefault(job_name(str(w)) if p > 1 else str(w), set()).add(w)
        # close a job only when every one of its workers is connected and chosen
        close = [w for job, ws in jobs.items() if ws <= chosen for w in sorted(ws)]
        return {"status": "down", "workers": close} if close else {"status": "same"}


class KindAdaptive(JobAdaptive):
    """:class:`JobAdaptive` for one job kind of a pool whose kinds share one scheduler.

    The kinds are told apart by Dask resources: this kind's workers carry ``resources``
    (e.g. ``{"GPU": 1}``), and its tasks are those whose resource restrictions these
    workers satisfy, plus, with ``unrestricted``, the tasks that ask for none. The target
    is :meth:`distributed.Scheduler.adaptive_target`'s rule over those tasks and this
    kind's workers only (expected run time over ``target_duration``, at most a worker per
    task, one while tasks wait and none is there), and only this kind's idle workers are
    closed; the stock target counts every task and worker of the scheduler, so one kind's
    backlog would grow the other. ``cluster.scheduler`` must be the scheduler object
    itself (in this process), as for the clusters of :mod:`convergent.cluster.pool`.
    """

    def __init__(self, cluster=None, *, resources: Mapping[str, float],
                 unrestricted: bool = False, **kwargs: Any) -> None:
        self.resources, self.unrestricted = dict(resources), unrestricted
        super().__init__(cluster, **kwargs)

    def runs(self, ts) -> bool:
        """Whether a task (a scheduler TaskState) runs on this kind's workers."""
        need = ts.resource_restrictions
        if not need:
            return self.unrestricted
        return all(self.resources.get(r, 0) >= q for r, q in need.items())

    def _mine(self) -> list:
        plan = {str(w) for w in self.plan}
        return [ws for ws in self.cluster.scheduler.workers.values() if str(ws.name) in plan]

    async def target(self) -> int:
        sched = self.cluster.scheduler
        unknown = parse_timedelta(dask.config.get("distributed.scheduler.unknown-task-duration"))
        waiting = [ts for ts in itertools.chain(sched.queued, sched.unrunnable) if self.runs(ts)]
        workers = self._mine()
        occupancy = sum(ws.occupancy for ws in workers) + sum(
            ts.prefix.duration_average if ts.prefix.duration_average >= 0 else unknown
            for ts in waiting)
        tasks = len(waiting) + sum(len(ws.processing) for ws in workers)
        n = min(tasks, math.ceil(occupancy / self.target_duration))
        return max(1, n) if waiting and not workers else n

    async def workers_to_close(self, target: int) -> list[str]:
        workers = self._mine()
        idle = sorted((ws for ws in workers if not ws.processing), key=lambda ws: ws.nbytes)
        return [str(ws.name) for ws in idle[:max(0, len(workers) - target)]]
