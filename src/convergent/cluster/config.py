"""Config of the Dask cluster (``cluster`` section): where simulation and analytics work runs.

In the core layer because :mod:`convergent.cluster.pool` builds clusters from it and the stages
above (sim, analytics, learn) take it as an argument.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from convergent.core.configbase import Count, Count0, PathStr, Section, Walltime

#: A job's memory request: a number with an optional unit (``4GiB``, ``16G``, ``500MB``).
MEMORY_PATTERN = r"^[0-9]+(\.[0-9]+)?\s*([kKmMgGtT]i?[bB]?|[bB])?$"


class SlurmConfig(Section):
    """Job options of ``dask_jobqueue.SLURMCluster`` (``cluster.kind: slurm``).

    One Slurm job holds ``cores`` single-threaded Dask workers (``processes = cores``);
    the cluster adapts between ``adapt_min`` and ``adapt_max`` workers.
    """

    queue: str | None = None  # -p / --partition
    account: str | None = None  # -A
    cores: Count | None = None  # per job = single-threaded workers per job; None: sinfo
    # per job; None: 90% of the partition's node memory (sinfo)
    memory: str | None = Field(None, pattern=MEMORY_PATTERN)
    walltime: Walltime = "01:00:00"
    job_extra_directives: list[str] = []  # extra '#SBATCH ...' lines, e.g. ['--qos=debug']
    job_script_prologue: list[str] = []  # shell lines run before the worker (module load ...)
    interface: str | None = None  # network interface of workers, e.g. 'ib0'
    local_directory: PathStr | None = None  # node-local scratch for worker spill files
    log_directory: PathStr | None = None  # one dask-worker-<jobid>.out/.err per job (default: cwd)
    python: PathStr | None = None  # python executable on compute nodes (default: this one)
    adapt_min: Count0 = 0  # workers
    adapt_max: Count = 64  # workers
    # no worker connected for this long while work waits (jobs refused, pending forever):
    # the campaign stops with an error naming the job options and Slurm's reasons
    start_timeout_s: float = Field(600.0, ge=5.0, le=7 * 86400.0)

    @model_validator(mode="after")
    def _adapt_range(self) -> SlurmConfig:
        if self.adapt_min > self.adapt_max:
            raise ValueError(f"adapt_min ({self.adapt_min}) must be <= adapt_max ({self.adapt_max})")
        return self


class GpuJobsConfig(Section):
    """The GPU job kind of a Slurm pool (``cluster.kind: slurm``; off unless ``enabled``).

    A second kind of dask-jobqueue worker job under the same Dask scheduler as the CPU jobs
    of ``cluster.slurm``: each job asks Slurm for ``gres`` (``#SBATCH --gres=gpu:1``) and
    runs one Dask worker with the Dask resource ``GPU=1``. The GPU task kinds of a campaign
    ask for that resource and run only there; the other kinds ask for the CPU jobs' resource
    ``CPU`` and stay off the GPU jobs. The kind scales between ``adapt_min`` and
    ``adapt_max`` jobs on its own tasks, independently of the CPU jobs. Only ``convergent
    learn`` asks for it (with ``learn.device`` auto or cuda). Network, scratch, log
    directory and python come from ``cluster.slurm``; so do ``queue`` and ``account`` when
    unset here.
    """

    enabled: bool = False
    # one GPU per job (the job's one worker runs one GPU task at a time): name[:type]:1
    gres: str = Field("gpu:1", pattern=r"^[A-Za-z0-9_]+(:[A-Za-z0-9_.-]+)?:1$")
    cores: Count = 4  # CPU cores per job (the worker's threads)
    memory: str = Field("16GiB", pattern=MEMORY_PATTERN)  # per job
    walltime: Walltime = "01:00:00"
    queue: str | None = None  # -p; None: cluster.slurm.queue
    account: str | None = None  # -A; None: cluster.slurm.account
    job_extra_directives: list[str] = []  # extra '#SBATCH ...' lines, e.g. ['--constraint=a100']
    job_script_prologue: list[str] = []  # shell lines before the worker (module load cuda ...)
    adapt_min: Count0 = 0  # jobs (= workers: one a job)
    adapt_max: Count = 1  # jobs

    @model_validator(mode="after")
    def _adapt_range(self) -> GpuJobsConfig:
        if self.adapt_min > self.adapt_max:
            raise ValueError(f"adapt_min ({self.adapt_min}) must be <= adapt_max ({self.adapt_max})")
        return self


class ClusterConfig(Section):
    """Where Dask work runs.

    ``local``: a LocalCluster with one single-threaded worker process per usable core
    (affinity mask / SLURM_CPUS_ON_NODE); ``slurm``: dask-jobqueue SLURMCluster with
    ``adapt(min, max)``; ``address``: connect to an existing scheduler at ``address``.
    """

    kind: Literal["local", "slurm", "address"] = "local"
    n_workers: Count | None = None  # None: one per usable core (local)
    threads_per_worker: Count = 1
    address: str | None = None  # for kind=address, e.g. tcp://10.0.0.1:8786
    dashboard_address: str | None = ":0"  # ':8787', ':0' (any free port) or None (off)
    memory_limit: str = "auto"  # per local worker
    allowed_failures: Count0 = 0  # scheduler re-runs of a task after a worker death (local/slurm)
    slurm: SlurmConfig = SlurmConfig()
    gpu: GpuJobsConfig = GpuJobsConfig()  # a second, GPU job kind under the same scheduler
