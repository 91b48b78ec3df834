"""xTB campaigns on the real Slurm fixture through dask-jobqueue: two jobs, refused and
never-starting jobs, a cancelled job replaced, job counts on the progress line."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from convergent.cluster.config import ClusterConfig, SlurmConfig
from convergent.data.reader import open_dataset
from convergent.sim.campaign import run_campaign
from convergent.sim.config import SimulateConfig
from tests.slurm.slurmhelpers import squeue_ids

SMALL = dict(max_atoms=5, chunk_size=10, flush_every_s=0.0)
BIGGER = dict(max_atoms=10, chunk_size=10, flush_every_s=0.0)  # a few seconds per task


def _keys(path: Path) -> list[str]:
    ds = open_dataset(path)
    try:
        return [rec["key"] for rec in ds]
    finally:
        ds.close()


def _cluster(tmp_path: Path, **slurm) -> ClusterConfig:
    opts = dict(cores=1, memory="1GiB", adapt_min=2, adapt_max=2, interface="lo", walltime="00:20:00",
                log_directory=str(tmp_path / "joblogs"), start_timeout_s=120.0)
    opts.update(slurm)
    return ClusterConfig(kind="slurm", dashboard_address=None, slurm=SlurmConfig(**opts))


def _worker_jobs_seen(slurm) -> set[str]:
    """Ids of the dask-worker jobs in the jobcomp file that ran on a node (ended jobs)."""
    if not slurm.jobcomp.exists():
        return set()
    return {line.split()[0].split("=")[1] for line in slurm.jobcomp.read_text().splitlines()
            if "Name=dask-worker" in line and "NodeList=n" in line}


def test_campaign_on_two_jobs_every_frame_once(slurm, tmp_path):
    from rich.console import Console

    before = _worker_jobs_seen(slurm)
    console = Console(record=True, width=250, force_terminal=False)
    s = run_campaign(SimulateConfig(frames=300, **BIGGER), _cluster(tmp_path),
                     tmp_path / "ds", progress=True, console=console)
    keys = _keys(tmp_path / "ds")
    assert s.done == 300 and len(keys) == 300 and len(set(keys)) == 300
    time.sleep(1.0)  # the jobs were cancelled on close; jobcomp is written as they end
    assert len(_worker_jobs_seen(slurm) - before) == 2
    text = console.export_text()
    assert "pending" in text and "running" in text and "workers" in text
    # accounting: the campaign's own core-seconds, then Slurm's record of both worker jobs
    from convergent.runsdb.accounting import append_usage, collect_slurm, read_usage

    append_usage(tmp_path, [s.usage()])
    charged = collect_slurm(tmp_path)
    assert sorted(u.job_id for u in charged) == sorted(s.slurm_job_ids)
    assert len(s.slurm_job_ids) == 2 and all(u.cores == 1 for u in charged)
    assert {u.source for u in read_usage(tmp_path)} == {"self", "slurm"}


def test_refused_job_is_one_clear_error_and_keeps_the_data(slurm, tmp_path, capsys):
    from convergent.cli import main

    out = tmp_path / "ds"
    local = ["simulate", "--frames", "20", "--out", str(out), "--set", "simulate.max_atoms=4",
             "--chunk-size", "5", "--workers", "1", "--no-progress"]
    assert main(local) == 0
    capsys.readouterr()
    base = ["simulate", "--frames", "40", "--out", str(out), "--set", "simulate.max_atoms=4",
            "--chunk-size", "5", "--cluster", "slurm", "--no-progress",
            "--set", f"cluster.slurm.log_directory={tmp_path}", "--set", "cluster.slurm.interface=lo"]
    assert main([*base, "--set", "cluster.slurm.cores=64"]) == 2
    err = capsys.readouterr().err
    assert "cluster.slurm.cores" in err and "Requested node configuration is not available" in err
    wrong_queue = [*base, "--set", "cluster.slurm.queue=nosuchpartition"]
    assert main(wrong_queue) == 2  # job size from sinfo: the partition has no nodes
    assert "cluster.slurm.queue='nosuchpartition'" in capsys.readouterr().err
    sized = ["--set", "cluster.slurm.cores=1", "--set", "cluster.slurm.memory=1GiB"]
    assert main([*wrong_queue, *sized]) == 2  # sbatch's own refusal
    err = capsys.readouterr().err
    assert "cluster.slurm.queue" in err and "Invalid partition name" in err
    assert sorted(set(_keys(out))) == sorted(_keys(out)) and len(_keys(out)) == 20
    assert not squeue_ids("dask-worker")


def test_never_starting_job_ends_after_start_timeout(slurm, tmp_path, capsys):
    from convergent.cli import main

    out = tmp_path / "ds"
    common = ["simulate", "--out", str(out), "--set", "simulate.max_atoms=4", "--chunk-size",
              "5", "--no-progress"]
    assert main([*common, "--frames", "20", "--workers", "1"]) == 0
    capsys.readouterr()
    held = ["--cluster", "slurm", "--set", "cluster.slurm.interface=lo",
            "--set", f"cluster.slurm.log_directory={tmp_path}",
            "--set", "cluster.slurm.cores=1", "--set", "cluster.slurm.memory=1GiB",
            "--set", "cluster.slurm.start_timeout_s=5",
            "--set", 'cluster.slurm.job_extra_directives=["--begin=now+1hour"]']
    assert main([*common, "--frames", "40", *held]) == 2  # accepted by sbatch, never starts
    err = capsys.readouterr().err
    assert "cluster.slurm.start_timeout_s=5" in err and "BeginTime" in err
    assert "cluster.slurm.cores=1" in err and err.count("error:") == 1
    keys = _keys(out)
    assert len(keys) == 20 and len(set(keys)) == 20  # what was labelled is still there
    assert not squeue_ids("dask-worker")  # the held job was cancelled on the way out


def test_default_job_size_comes_from_sinfo(slurm):
    from convergent.cluster.pool import make_slurm_cluster

    cluster = make_slurm_cluster(ClusterConfig(kind="slurm", dashboard_address=None),
                                 start_adapt=False)  # sbatch --test-only accepts it
    try:
        script = cluster.job_script()
    finally:
        cluster.close()
    assert f"--cpus-per-task={slurm.cpus}" in script
    assert "--mem=3G" in script  # 90% of the node's 4000 MB, whole GiB


def test_cancelled_job_is_replaced_and_every_frame_lands_once(slurm, tmp_path):
    state = {"cancelled": None, "replacement": None}
    placed: dict[tuple[str, int], list[int]] = {}  # (job, pid) -> affinity

    def on_task(task, result, summary) -> None:
        placed[(result.slurm_job_id, result.pid)] = result.cpus
        if state["cancelled"] is None and summary.tasks_run >= 3:
            jobs = squeue_ids("dask-worker")
            state["cancelled"] = jobs[0]
            subprocess.run(["scancel", jobs[0]], check=True)
            deadline = time.monotonic() + 90  # wait (bounded) until Slurm holds a new job
            while time.monotonic() < deadline and state["replacement"] is None:
                new = set(squeue_ids("dask-worker")) - set(jobs)
                state["replacement"] = min(new) if new else None
                time.sleep(0.5)

    # two jobs of 2 cores = 2 workers each, every worker pinned to one core of its job
    cluster = _cluster(tmp_path, cores=2, memory="2GiB", adapt_min=4, adapt_max=4)
    s = run_campaign(SimulateConfig(frames=300, **BIGGER), cluster, tmp_path / "ds",
                     progress=False, on_task=on_task)
    keys = _keys(tmp_path / "ds")
    assert len(keys) == 300 and len(set(keys)) == 300
    assert state["cancelled"] and state["replacement"]
    assert state["cancelled"] in s.slurm_job_ids and state["replacement"] in s.slurm_job_ids
    assert all(job is not None and len(cpus) == 1 for (job, _), cpus in placed.items())
    for job in {j for j, _ in placed}:  # two workers of one job never share a core
        cores = [c[0] for (j, _), c in placed.items() if j == job]
        assert len(cores) == len(set(cores))
    assert s.slurm_jobs_replaced >= 1
    assert s.quarantined == 0


def test_adaptive_scaling_keeps_multi_worker_jobs(slurm, tmp_path):
    """Jobs of 2 workers, adapt from 0: dask-jobqueue alone retires one worker of a job
    still starting, which cancels the job, and resubmits it, again and again."""
    cluster = _cluster(tmp_path, cores=2, memory="2GiB", adapt_min=0, adapt_max=4)
    s = run_campaign(SimulateConfig(frames=60, **BIGGER), cluster, tmp_path / "ds",
                     progress=False)
    assert s.done == 60 and s.retried == 0
    assert 1 <= len(s.slurm_job_ids) <= 2
