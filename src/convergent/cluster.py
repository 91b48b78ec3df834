"""Dask cluster factory: ``local`` (default) | ``slurm`` (dask-jobqueue) | ``address``.

>>> from convergent.cluster import dask_client
>>> with dask_client(ClusterConfig()) as client:   # LocalCluster, 1 thread per worker
...     client.submit(...)

``local`` starts one single-threaded worker *process* per usable core (affinity mask or
SLURM_CPUS_ON_NODE, see :func:`convergent.resources.usable_cpus`), with BLAS/OpenMP/torch
pinned to one thread in each worker. ``slurm`` builds a ``dask_jobqueue.SLURMCluster``
from the job options in config (one single-threaded worker per core of each job) and
calls ``adapt(minimum, maximum)``. ``address`` connects to a running scheduler.
For clusters created here the scheduler does not silently re-run a task whose worker
died (``allowed_failures``, default 0): the caller sees ``KilledWorker`` and applies its
own retry policy.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator
from typing import Any

from convergent.clusterconfig import ClusterConfig
from convergent.errors import ConfigError, NotAvailableError
from convergent.resources import usable_cpus

#: Environment of every local worker process: one BLAS/OpenMP/torch thread.
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
    "PYSCF_MAX_MEMORY": "2000",
}


#: glibc malloc in worker processes. Dask's 64 KiB trim threshold (memory freed at the top of
#: the heap goes back to the OS) also turns off glibc's adaptive mmap threshold, leaving it
#: at 128 KiB: every larger transient buffer of a task (a shard's index, a column, a numpy
#: temporary) was then a fresh mapping with a page fault per 4 KiB, each time — split: 3x
#: the page faults of one process doing the same work; dedup's match stage: 18x, +0.5 s of
#: kernel time per 250k records. With the mmap threshold at 32 MiB (the adaptive one's
#: ceiling, what one process reaches on its own) and a 4 MiB pad kept at the heap top,
#: such buffers are reused from the heap (dedup, 250k records: 26k faults vs 55k for one
#: process with glibc's defaults, same peak RSS); memory freed past the pad still goes back.
WORKER_MALLOC = {"MALLOC_TRIM_THRESHOLD_": "65536", "MALLOC_TOP_PAD_": str(4 * 2**20),
                 "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)}


def dashboard_available() -> bool:
    """True if the Dask dashboard can be served (it needs bokeh)."""
    return importlib.util.find_spec("bokeh") is not None


def _dask_settings(cfg: ClusterConfig) -> dict[str, Any]:
    return {
        "distributed.scheduler.allowed-failures": int(cfg.allowed_failures),
        "distributed.nanny.pre-spawn-environ": dict(WORKER_ENV, **WORKER_MALLOC),
        "distributed.worker.daemon": True,
        # the statistical profiler samples every worker thread every 10 ms: not free
        "distributed.worker.profile.enabled": False,
        # fewer idle wake-ups on small machines (event-loop tick, system monitor)
        "distributed.admin.tick.interval": "500ms",
        "distributed.admin.system-monitor.interval": "2s",
    }


def local_workers(cfg: ClusterConfig) -> int:
    """Number of local workers: ``n_workers`` or usable cores / threads per worker."""
    if cfg.n_workers is not None:
        if cfg.n_workers < 1:
            raise ConfigError("cluster.n_workers must be >= 1")
        return cfg.n_workers
    return max(1, usable_cpus() // max(1, cfg.threads_per_worker))


def make_local_cluster(cfg: ClusterConfig):
    """A LocalCluster of single-threaded worker processes (see module docstring)."""
    import dask
    from distributed import LocalCluster

    dash = cfg.dashboard_address
    with dask.config.set(_dask_settings(cfg)):
        return LocalCluster(
            n_workers=local_workers(cfg),
            threads_per_worker=cfg.threads_per_worker,
            processes=True,
            dashboard_address=dash,
            memory_limit=cfg.memory_limit,
            silence_logs=logging.ERROR,
            env=dict(WORKER_ENV),
        )


def make_slurm_cluster(cfg: ClusterConfig, start_adapt: bool = True, check: bool = True):
    """A dask-jobqueue SLURMCluster from ``cfg.slurm``; adaptive between min and max workers.

    Unset ``cores``/``memory`` come from ``sinfo`` (the partition's largest node); with
    ``check`` the job script goes through ``sbatch --test-only`` first, so a job Slurm
    refuses is one ConfigError naming the field (see :mod:`convergent.slurmjobs`).
    """
    if importlib.util.find_spec("dask_jobqueue") is None:
        raise NotAvailableError(
            "cluster.kind=slurm needs dask-jobqueue", hint="pip install 'convergent[slurm]'"
        )
    import dask
    from dask_jobqueue import SLURMCluster

    from convergent.slurmjobs import (
        JobAdaptive,
        describe_request,
        job_of_worker,
        preflight,
        resolved_job_size,
    )

    s = cfg.slurm
    if s.adapt_max < max(1, s.adapt_min):
        raise ConfigError("cluster.slurm.adapt_max must be >= max(1, adapt_min)")
    cores, memory = resolved_job_size(s.cores, s.memory, s.queue)
    prologue = [f"export {k}={v}" for k, v in WORKER_ENV.items()] + list(s.job_script_prologue)
    kwargs: dict[str, Any] = dict(
        cores=cores,
        processes=max(1, cores // max(1, cfg.threads_per_worker)),
        memory=memory,
        walltime=s.walltime,
        queue=s.queue,
        account=s.account,
        job_extra_directives=list(s.job_extra_directives),
        job_script_prologue=prologue,
        interface=s.interface,
        local_directory=s.local_directory,
        log_directory=s.log_directory,
        python=s.python,
        scheduler_options={"dashboard_address": cfg.dashboard_address}
        if dashboard_available() and cfg.dashboard_address
        else {"dashboard_address": None},
    )
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    with dask.config.set(_dask_settings(cfg)):
        cluster = SLURMCluster(**kwargs)
    if check:
        try:
            preflight(cluster.job_script(), describe_request(cores, memory, s.queue))
        except BaseException:
            cluster.close()
            raise
    if start_adapt:  # whole jobs: see convergent.slurmjobs.JobAdaptive
        per_job = kwargs["processes"]
        cluster.adapt(minimum=s.adapt_min, maximum=max(per_job, s.adapt_max // per_job * per_job),
                      Adaptive=JobAdaptive, worker_key=job_of_worker)
    return cluster


def make_cluster(cfg: ClusterConfig):
    """The Dask cluster object for ``cfg`` (None for ``kind=address``)."""
    if cfg.kind == "local":
        return make_local_cluster(cfg)
    if cfg.kind == "slurm":
        return make_slurm_cluster(cfg)
    if not cfg.address:
        raise ConfigError(
            "cluster.kind=address needs cluster.address", hint="e.g. --set cluster.address=tcp://host:8786"
        )
    return None


def dashboard_link(client) -> str | None:
    """The dashboard URL of the client's scheduler, or None if it serves none.

    Without bokeh the scheduler still serves ``/metrics`` (Prometheus) and ``/health`` at
    that address, but the dashboard pages only say that bokeh is missing.
    """
    try:
        services = client.scheduler_info().get("services", {})
    except Exception:
        return None
    if "dashboard" not in services:
        return None
    return client.dashboard_link


def describe_dashboard(link: str | None) -> str:
    """A human description of the dashboard address for the console."""
    if link is None:
        return "off"
    if not dashboard_available():
        return f"{link} (pages need bokeh>=3.1; /metrics is served)"
    return link


@contextlib.contextmanager
def dask_client(cfg: ClusterConfig, echo=None) -> Iterator[Any]:
    """A ``distributed.Client`` on the cluster described by ``cfg``; closed on exit.

    ``echo(str)`` (e.g. ``print`` or a rich console's ``print``) receives one line with the
    cluster kind, worker count and dashboard address.
    """
    import dask
    import distributed  # noqa: F401 - loads its config defaults *before* dask.config.set:
    # a set() that creates the 'distributed' key deletes the whole key on exit, defaults
    # loaded meanwhile included (the next cluster in this process then fails: KeyError 'comm')

    with dask.config.set(_local_cluster_settings() if cfg.kind == "local" else {}):
        yield from _client_on(cfg, echo)


# SpecCluster hard-closes a worker's nanny when no worker of that name is back 15 s after
# it left ("lost-worker-timeout", meant for lost batch jobs). Local nannies restart their
# own workers, and a timer left by one restart can fire during the next restart of the
# same worker, closing its nanny for good (seen in CI). Locally the nanny is the authority.
_NEVER_S = 10 * 365 * 24 * 3600


def _local_cluster_settings() -> dict[str, Any]:
    """Dask settings in force while a local cluster runs."""
    return {"distributed.deploy.lost-worker-timeout": f"{_NEVER_S}s"}


def _client_on(cfg: ClusterConfig, echo) -> Iterator[Any]:
    """The body of :func:`dask_client`, under its Dask settings."""
    from distributed import Client

    cluster = make_cluster(cfg)
    try:
        client = Client(cluster) if cluster is not None else Client(cfg.address, timeout="30s")
    except OSError as exc:
        if cluster is not None:
            cluster.close()
        raise ConfigError(
            f"cannot connect to Dask scheduler {cfg.address}: {exc}",
            hint="check cluster.address and that the scheduler is running",
        ) from None
    try:
        if echo is not None:
            link = dashboard_link(client)
            n = len(client.scheduler_info().get("workers", {}))
            where = "" if cfg.kind != "address" else f" at {cfg.address}"
            echo(f"dask: {cfg.kind} cluster{where}, {n} workers; dashboard: "
                 f"{describe_dashboard(link)}")
        yield client
    finally:
        with contextlib.suppress(Exception):
            client.close(timeout=10)
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.close(timeout=10)
