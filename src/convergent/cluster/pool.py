"""Dask cluster factory: ``local`` (default) | ``slurm`` (dask-jobqueue) | ``address``.

>>> from convergent.cluster.pool import dask_client
>>> with dask_client(ClusterConfig()) as client:   # LocalCluster, 1 thread per worker
...     client.submit(...)

``local`` starts one single-threaded worker *process* per usable core (affinity mask or
SLURM_CPUS_ON_NODE, see :func:`convergent.cluster.resources.usable_cpus`), with BLAS/OpenMP/torch
pinned to one thread in each worker. ``slurm`` builds a ``dask_jobqueue.SLURMCluster``
from the job options in config (one single-threaded worker per core of each job) and
calls ``adapt(minimum, maximum)``. ``address`` connects to a running scheduler.
With ``gpu_jobs`` and ``cluster.gpu.enabled`` a Slurm pool has a second job kind under the
same scheduler: GPU jobs (``--gres``), whose workers carry the Dask resource ``GPU`` while
the CPU jobs' workers carry ``CPU``; each kind adapts on its own tasks
(:func:`make_gpu_jobs`, :class:`convergent.cluster.slurm.KindAdaptive`).
For clusters created here the scheduler does not silently re-run a task whose worker
died (``allowed_failures``, default 0): the caller sees ``KilledWorker`` and applies its
own retry policy.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Iterator
from typing import Any

from convergent.cluster.config import ClusterConfig
from convergent.cluster.resources import usable_cpus
from convergent.core.errors import ConfigError, NotAvailableError

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


#: Dask worker resources of a Slurm pool with a GPU job kind (``cluster.gpu``): a task that
#: asks for ``GPU`` runs only on the GPU jobs' workers, one that asks for ``CPU`` only on the
#: CPU jobs' workers (each worker carries ``CPU`` = its threads). The local GPU worker of
#: ``convergent learn`` carries ``GPU`` too.
GPU_RESOURCE = "GPU"
CPU_RESOURCE = "CPU"


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


def _need_jobqueue() -> None:
    if importlib.util.find_spec("dask_jobqueue") is None:
        raise NotAvailableError(
            "cluster.kind=slurm needs dask-jobqueue", hint="pip install 'convergent[slurm]'"
        )


def make_slurm_cluster(cfg: ClusterConfig, start_adapt: bool = True, check: bool = True,
                       shared: bool = False):
    """A dask-jobqueue SLURMCluster from ``cfg.slurm``; adaptive between min and max workers.

    Unset ``cores``/``memory`` come from ``sinfo`` (the partition's largest node); with
    ``check`` the job script goes through ``sbatch --test-only`` first, so a job Slurm
    refuses is one ConfigError naming the field (see :mod:`convergent.cluster.slurm`). With
    ``shared`` another job kind will join its scheduler (:func:`make_gpu_jobs`): its
    workers carry the Dask resource ``CPU`` and it adapts on the tasks they run.
    """
    _need_jobqueue()
    import dask
    from dask_jobqueue import SLURMCluster

    from convergent.cluster.slurm import (
        JobAdaptive,
        KindAdaptive,
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
    slots = {CPU_RESOURCE: cfg.threads_per_worker}
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
        worker_extra_args=_resources_args(slots) if shared else None,
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
    if start_adapt:  # whole jobs: see convergent.cluster.slurm.JobAdaptive
        per_job = kwargs["processes"]
        # shared: its own tasks only (those asking for CPU, or for nothing)
        kind: dict[str, Any] = {"Adaptive": JobAdaptive}
        if shared:
            kind = {"Adaptive": KindAdaptive, "resources": slots, "unrestricted": True}
        cluster.adapt(minimum=s.adapt_min, maximum=max(per_job, s.adapt_max // per_job * per_job),
                      worker_key=job_of_worker, **kind)
    return cluster


def _resources_args(resources: dict[str, float]) -> list[str]:
    return ["--resources", ",".join(f"{k}={v:g}" for k, v in resources.items())]


#: The scheduler plugin through which a cluster manager follows workers come and go.
_WORKER_STATUS = "worker-status"


@functools.cache
def _joined_slurm_cluster():
    """``SLURMCluster`` whose jobs join the scheduler of another cluster of this process
    (``joins``) instead of starting one: SpecCluster keeps a scheduler that a subclass set
    before ``_start``, and closing the cluster (``shutdown_scheduler`` off) ends its jobs,
    not the scheduler it shares. dask-jobqueue has no such option of its own
    (dask/dask-jobqueue#419); both clusters run on one event loop (``loop=``).

    A scheduler keeps one cluster manager's subscription to worker events (the plugin
    ``worker-status``, a fixed name): this cluster's subscription would replace the owner's,
    and the owner would no longer see its workers arrive or leave. So its plugin is renamed
    ``worker-status-<name>`` and the owner's put back: each manager sees every event."""
    import warnings

    from dask_jobqueue import SLURMCluster

    class JoinedSLURMCluster(SLURMCluster):
        def __init__(self, *, joins, **kwargs: Any) -> None:
            self._joins = joins
            super().__init__(loop=joins.loop, **kwargs)

        async def _start(self) -> None:
            sched = self._joins.scheduler
            self.scheduler, self.shutdown_scheduler = sched, False
            owner = sched.plugins.get(_WORKER_STATUS)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Scheduler already contains a plugin")
                await super()._start()
            mine = sched.plugins.pop(_WORKER_STATUS, None)
            if mine is not None and mine is not owner:
                mine.name = f"{_WORKER_STATUS}-{self._name}"  # what it removes on a closed comm
                sched.plugins[mine.name] = mine
            if owner is not None:
                sched.plugins[_WORKER_STATUS] = owner

    return JoinedSLURMCluster


def make_gpu_jobs(cfg: ClusterConfig, cpu, start_adapt: bool = True, check: bool = True):
    """The GPU job kind of ``cfg.gpu``: a dask-jobqueue SLURMCluster whose jobs (each
    ``--gres=<gres>``, one worker with the Dask resource ``GPU=1``) join the scheduler of
    ``cpu`` (a :func:`make_slurm_cluster` made with ``shared``), adaptive between
    ``cfg.gpu.adapt_min`` and ``adapt_max`` jobs on the tasks that ask for ``GPU``. Queue,
    account, network, scratch, logs and python default to ``cfg.slurm``'s; with ``check``
    its job script goes through ``sbatch --test-only`` (a refusal names ``cluster.gpu``)."""
    _need_jobqueue()
    import dask

    from convergent.cluster.slurm import KindAdaptive, describe_request, job_of_worker, preflight

    g, s = cfg.gpu, cfg.slurm
    queue = g.queue or s.queue
    slots = {GPU_RESOURCE: 1}
    kwargs: dict[str, Any] = dict(
        name="gpu",  # worker names gpu-<n>; the CPU jobs' are SLURMCluster-<n>-<i>
        job_name="dask-gpu-worker",
        cores=g.cores,
        processes=1,
        memory=g.memory,
        walltime=g.walltime,
        queue=queue,
        account=g.account or s.account,
        job_extra_directives=[f"--gres={g.gres}", *g.job_extra_directives],
        job_script_prologue=[f"export {k}={v}" for k, v in WORKER_ENV.items()]
        + list(g.job_script_prologue),
        interface=s.interface,
        local_directory=s.local_directory,
        log_directory=s.log_directory,
        python=s.python,
        worker_extra_args=_resources_args(slots),
    )
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    with dask.config.set(_dask_settings(cfg)):
        gpu = _joined_slurm_cluster()(joins=cpu, **kwargs)
    if check:
        try:
            preflight(gpu.job_script(), describe_request(g.cores, g.memory, queue, "cluster.gpu",
                                                         g.gres), section="cluster.gpu")
        except BaseException:
            gpu.close()
            raise
    if start_adapt:
        gpu.adapt(minimum=g.adapt_min, maximum=g.adapt_max, Adaptive=KindAdaptive,
                  resources=slots, worker_key=job_of_worker)
    return gpu


def watch_jobs(client, cfg: ClusterConfig, on_error=None) -> list[Any]:
    """A started :class:`~convergent.cluster.slurm.JobWatch` for each job kind of ``client``'s
    Slurm pool (:func:`job_kinds`): a job that ends early is replaced, and ``on_error``
    gets the error when a kind's jobs cannot start. The caller stops them."""
    from convergent.cluster.slurm import JobWatch, describe_request, resolved_job_size

    s, g = cfg.slurm, cfg.gpu
    watches = []
    for kind, cluster in job_kinds(client).items():
        if kind == "gpu":
            section = "cluster.gpu"
            request = describe_request(g.cores, g.memory, g.queue or s.queue, section, g.gres)
        else:
            section = "cluster.slurm"
            request = describe_request(*resolved_job_size(s.cores, s.memory, s.queue), s.queue)
        watch = JobWatch(cluster, client, s.start_timeout_s, request, on_error=on_error,
                         section=section)
        watch.start()
        watches.append(watch)
    return watches


def job_kinds(client) -> dict[str, Any]:
    """The job kinds of ``client``'s Slurm pool by name (``cpu``, and ``gpu`` when
    :func:`dask_client` made one), each a dask-jobqueue cluster; empty for other pools."""
    cluster = getattr(client, "cluster", None)
    if cluster is None or getattr(cluster, "job_cls", None) is None:
        return {}
    return dict(getattr(cluster, "job_kinds", None) or {"cpu": cluster})


def make_cluster(cfg: ClusterConfig, gpu_jobs: bool = False):
    """The Dask cluster object for ``cfg`` (None for ``kind=address``). With ``gpu_jobs``
    and ``cfg.gpu.enabled``, a Slurm cluster also has the GPU job kind
    (:func:`make_gpu_jobs`), kept in its ``job_kinds`` (see :func:`job_kinds`)."""
    if cfg.kind == "local":
        return make_local_cluster(cfg)
    if cfg.kind == "slurm":
        if not (gpu_jobs and cfg.gpu.enabled):
            return make_slurm_cluster(cfg)
        cpu = make_slurm_cluster(cfg, shared=True)
        try:
            cpu.job_kinds = {"cpu": cpu, "gpu": make_gpu_jobs(cfg, cpu)}
        except BaseException:
            cpu.close()
            raise
        return cpu
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
def dask_client(cfg: ClusterConfig, echo=None, gpu_jobs: bool = False) -> Iterator[Any]:
    """A ``distributed.Client`` on the cluster described by ``cfg``; closed on exit.

    ``echo(str)`` (e.g. ``print`` or a rich console's ``print``) receives one line with the
    cluster kind, worker count and dashboard address. ``gpu_jobs``: a Slurm cluster gets
    the GPU job kind of ``cfg.gpu`` when it is enabled (:func:`make_cluster`).
    """
    import dask
    import distributed  # noqa: F401 - loads its config defaults *before* dask.config.set:
    # a set() that creates the 'distributed' key deletes the whole key on exit, defaults
    # loaded meanwhile included (the next cluster in this process then fails: KeyError 'comm')

    with dask.config.set(_local_cluster_settings() if cfg.kind == "local" else {}):
        yield from _client_on(cfg, echo, gpu_jobs)


# SpecCluster hard-closes a worker's nanny when no worker of that name is back 15 s after
# it left ("lost-worker-timeout", meant for lost batch jobs). Local nannies restart their
# own workers, and a timer left by one restart can fire during the next restart of the
# same worker, closing its nanny for good (seen in CI). Locally the nanny is the authority.
_NEVER_S = 10 * 365 * 24 * 3600


def _local_cluster_settings() -> dict[str, Any]:
    """Dask settings in force while a local cluster runs."""
    return {"distributed.deploy.lost-worker-timeout": f"{_NEVER_S}s"}


def _close_cluster(cluster) -> None:
    """Close ``cluster``, its other job kinds first (they share its scheduler)."""
    kinds = getattr(cluster, "job_kinds", None) or {}
    for other in [c for c in kinds.values() if c is not cluster][::-1] + [cluster]:
        with contextlib.suppress(Exception):
            other.close(timeout=10)


def _client_on(cfg: ClusterConfig, echo, gpu_jobs: bool = False) -> Iterator[Any]:
    """The body of :func:`dask_client`, under its Dask settings."""
    from distributed import Client

    cluster = make_cluster(cfg, gpu_jobs)
    try:
        client = Client(cluster) if cluster is not None else Client(cfg.address, timeout="30s")
    except OSError as exc:
        if cluster is not None:
            _close_cluster(cluster)
        raise ConfigError(
            f"cannot connect to Dask scheduler {cfg.address}: {exc}",
            hint="check cluster.address and that the scheduler is running",
        ) from None
    try:
        if echo is not None:
            link = dashboard_link(client)
            n = len(client.scheduler_info().get("workers", {}))
            where = "" if cfg.kind != "address" else f" at {cfg.address}"
            gpu = ("" if "gpu" not in job_kinds(client) else
                   f", GPU jobs --gres={cfg.gpu.gres} ({cfg.gpu.adapt_min}-{cfg.gpu.adapt_max})")
            echo(f"dask: {cfg.kind} cluster{where}, {n} workers{gpu}; dashboard: "
                 f"{describe_dashboard(link)}")
        yield client
    finally:
        with contextlib.suppress(Exception):
            client.close(timeout=10)
        if cluster is not None:
            _close_cluster(cluster)
