"""The cluster factory: local worker count from the affinity mask, Slurm job options."""

from __future__ import annotations

import pytest

from convergent.cluster.config import ClusterConfig, GpuJobsConfig, SlurmConfig
from convergent.cluster.pool import WORKER_MALLOC, local_workers, make_cluster, make_slurm_cluster
from convergent.cluster.resources import usable_cpus
from convergent.core.errors import ConfigError


def test_local_default_is_one_worker_per_usable_core(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    assert local_workers(ClusterConfig()) == usable_cpus()
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "6")
    assert local_workers(ClusterConfig()) == 6
    assert local_workers(ClusterConfig(n_workers=3)) == 3


def test_address_kind_needs_an_address():
    with pytest.raises(ConfigError, match="cluster.address"):
        make_cluster(ClusterConfig(kind="address"))


def test_slurm_cluster_job_script_and_adapt():
    pytest.importorskip("dask_jobqueue")
    cfg = ClusterConfig(
        kind="slurm",
        dashboard_address=None,
        slurm=SlurmConfig(queue="debug", account="chem", cores=4, memory="16GB",
                          walltime="00:30:00", job_extra_directives=["--qos=short"],
                          job_script_prologue=["module load xtb"], adapt_min=0, adapt_max=8),
    )
    cluster = make_slurm_cluster(cfg, check=False)  # no sbatch --test-only (tests/slurm)
    try:
        script = cluster.job_script()
        assert "#SBATCH -p debug" in script
        assert "#SBATCH -A chem" in script
        assert "#SBATCH --qos=short" in script
        assert "#SBATCH -t 00:30:00" in script
        assert "--nworkers 4" in script and "--nthreads 1" in script
        assert "export OMP_NUM_THREADS=1" in script and "module load xtb" in script
        adaptive = cluster._adaptive
        assert (adaptive.minimum, adaptive.maximum) == (0, 8)
    finally:
        cluster.close()


def test_gpu_job_kind_joins_the_cpu_jobs_scheduler():
    """cluster.gpu: a second SLURMCluster whose jobs ask for the GRES and whose worker carries
    GPU=1, on the CPU cluster's scheduler (the CPU workers carry CPU); closing it leaves the
    scheduler running. Off by default; one GPU per job."""
    pytest.importorskip("dask_jobqueue")
    from pydantic import ValidationError

    from convergent.cluster.pool import make_gpu_jobs

    assert ClusterConfig().gpu.enabled is False
    with pytest.raises(ValidationError, match="gres"):
        GpuJobsConfig(gres="gpu:2")
    cfg = ClusterConfig(kind="slurm", dashboard_address=None,
                        slurm=SlurmConfig(queue="debug", cores=2, memory="4GB"),
                        gpu=GpuJobsConfig(enabled=True, gres="gpu:a100:1", cores=8, memory="32GB",
                                          walltime="00:30:00", job_script_prologue=["module load cuda"],
                                          adapt_max=3))
    cpu = make_slurm_cluster(cfg, check=False, shared=True)
    try:
        gpu = make_gpu_jobs(cfg, cpu, check=False)
        try:
            assert gpu.scheduler is cpu.scheduler and gpu.scheduler_address == cpu.scheduler_address
            script = gpu.job_script()
            assert "#SBATCH --gres=gpu:a100:1" in script and "#SBATCH -J dask-gpu-worker" in script
            assert "#SBATCH -p debug" in script and "#SBATCH --cpus-per-task=8" in script
            assert "--resources GPU=1" in script and "module load cuda" in script
            assert "--resources CPU=1" in cpu.job_script() and "gres" not in cpu.job_script()
            assert (gpu._adaptive.minimum, gpu._adaptive.maximum) == (0, 3)
            assert gpu._adaptive.resources == {"GPU": 1} and cpu._adaptive.unrestricted
        finally:
            gpu.close()
        assert cpu.scheduler.status.name == "running"
    finally:
        cpu.close()


def test_local_nanny_survives_back_to_back_restarts(sim_client):
    """Each restart leaves SpecCluster a 15 s "lost worker" timer; one that fired while a
    later restart of the same worker was under way closed that worker's nanny for good
    (a CI failure; without the fix in convergent.cluster.pool this test loses the worker)."""
    import time

    sim_client.wait_for_workers(2, timeout=120)
    start = time.monotonic()
    while time.monotonic() - start < 20.0:  # timers of the first restarts fire in here
        workers = sim_client.scheduler_info()["workers"]
        addr = next(a for a, info in workers.items() if info["name"] == 1)
        outcome = sim_client.restart_workers([addr], timeout=60, raise_for_error=False)
        assert list(outcome.values()) == ["OK"]
    time.sleep(2.0)
    sim_client.wait_for_workers(2, timeout=30)
    assert len(sim_client.scheduler_info()["workers"]) == 2


def test_local_workers_run_with_the_malloc_settings(sim_client):
    """Every worker process starts with glibc's malloc settings (trim threshold, top pad,
    mmap threshold), read from the workers' own environment."""
    import os

    got = sim_client.run(lambda: {k: os.environ.get(k) for k in WORKER_MALLOC})
    assert len(got) == 2 and all(v == WORKER_MALLOC for v in got.values()), got
    assert int(WORKER_MALLOC["MALLOC_TOP_PAD_"]) >= 2**20
