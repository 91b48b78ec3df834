"""Pin each Dask worker process of a Slurm job to one core of the job's allocation.

A dask-jobqueue job runs ``processes`` single-threaded workers; all of them inherit the
job's affinity mask (the cores Slurm allocated, bound by task/affinity), so the kernel
may stack two workers on one core while another idles. :class:`PinWorker` is a Dask
worker plugin: at start-up each worker takes core ``index % len(mask)`` of the mask it
inherited (``index`` = the process suffix dask-jobqueue puts on worker names,
``<job>-<i>``) and applies it to every thread of the process. Workers of two jobs that
share a node stay inside their own job's cores: no oversubscription.
"""

from __future__ import annotations

import os
import re

from distributed.diagnostics.plugin import WorkerPlugin


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def pin_process(cpu: int) -> None:
    """Set the affinity of every thread of this process to ``{cpu}``."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {cpu})
        except OSError:
            continue  # a thread that ended meanwhile


def worker_index(name: object) -> int:
    """Process index of a dask-jobqueue worker name (``SLURMCluster-3-1`` -> 1), else 0."""
    m = re.search(r"-(\d+)-(\d+)$", str(name))
    return int(m.group(2)) if m else 0


class PinWorker(WorkerPlugin):
    """Dask worker plugin (``client.register_plugin(PinWorker())``): see module doc."""

    name = "convergent-pin-worker"

    def setup(self, worker) -> None:
        cpus = allowed_cpus()
        if len(cpus) > 1:
            pin_process(cpus[worker_index(worker.name) % len(cpus)])
