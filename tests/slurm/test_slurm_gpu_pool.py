"""A heterogeneous pool on the real Slurm fixture (cluster.gpu): CPU worker jobs and GPU
worker jobs (``--gres=gpu:1``, Dask resource ``GPU=1``) under one Dask scheduler.

The fixture's nodes declare emulated GPUs (gres gpu:2 with no GPU behind them), so Slurm
schedules, binds (``CUDA_VISIBLE_DEVICES``) and counts the GPU jobs as on a GPU cluster
while the tasks that ask for the resource ``GPU`` run on the CPU (learn's task code falls
back to the CPU when torch sees no CUDA): what is checked is placement. Each task's Slurm
job comes from its own process (``SLURM_JOB_ID``, kept in the timeline's spans).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from convergent.cluster.config import ClusterConfig, GpuJobsConfig, SlurmConfig
from convergent.cluster.pool import dask_client, job_kinds, watch_jobs
from convergent.learn.engine import read_timeline
from convergent.sim.taskfarm import Job, TaskFarm
from tests.learn.test_learn_campaign import SETS

GPU_KINDS = {"train", "explore", "score", "eval"}


def _cluster(tmp_path: Path, **gpu) -> ClusterConfig:
    slurm = SlurmConfig(cores=1, memory="1GiB", adapt_min=0, adapt_max=2, interface="lo",
                        walltime="00:20:00", log_directory=str(tmp_path / "joblogs"),
                        start_timeout_s=120.0)
    return ClusterConfig(kind="slurm", dashboard_address=None, slurm=slurm,
                         gpu=GpuJobsConfig(enabled=True, cores=1, memory="1GiB", adapt_max=1,
                                           walltime="00:20:00", **gpu))


def _where(seconds: float) -> dict[str, str | None]:
    """Sleep, then say where this ran: the worker's Slurm job and the GPUs it was bound to."""
    time.sleep(seconds)
    return {"job": os.environ.get("SLURM_JOB_ID"), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _squeue() -> dict[str, tuple[str, str]]:
    """{job id: (job name, gres per node)} of the jobs in the queue."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%j|%b"], capture_output=True, text=True,
                         check=True).stdout
    return {i: (n, b) for i, n, b in (ln.split("|") for ln in out.splitlines() if ln.strip())}


def _jobcomp(slurm, name: str) -> set[str]:
    """Ids of the ended jobs called ``name`` that ran on a node (the jobcomp file)."""
    if not slurm.jobcomp.exists():
        return set()
    return {ln.split()[0].split("=")[1] for ln in slurm.jobcomp.read_text().splitlines()
            if f"Name={name} " in ln and "NodeList=n" in ln}


def test_gpu_tasks_land_on_gpu_jobs_and_a_killed_gpu_job_is_replaced(slurm, tmp_path):
    cfg = _cluster(tmp_path)
    timeline = tmp_path / "timeline.jsonl"
    seen: dict[str, object] = {"killed": None, "queue": None}

    def on_done(job: Job, value: dict) -> list[Job]:
        if job.kind == "train" and seen["killed"] is None:  # the GPU job, with work queued on it
            seen["queue"] = _squeue()
            seen["killed"] = value["job"]
            subprocess.run(["scancel", value["job"]], check=True)
        return []

    def on_failed(job: Job, exc: BaseException) -> list[Job]:
        raise exc

    with dask_client(cfg, gpu_jobs=True) as client:
        kinds = job_kinds(client)
        assert set(kinds) == {"cpu", "gpu"}
        assert "--gres=gpu:1" in kinds["gpu"].job_script() and "GPU=1" in kinds["gpu"].job_script()
        watches = {w.section: w for w in watch_jobs(client, cfg)}
        farm = TaskFarm(client, timeline, {"train": 40, "label": 40}, gpu_kinds=("train",),
                        gpu=True, cpu_resource=True)
        jobs = ([Job("train", f"t{i}", _where, (2.0,)) for i in range(5)]
                + [Job("label", f"l{i}", _where, (0.5,)) for i in range(6)])
        try:
            farm.run(jobs, retries=3, on_done=on_done, on_failed=on_failed)
        finally:
            for w in watches.values():
                w.stop()
    gpu_ids, cpu_ids = watches["cluster.gpu"].seen_ids, watches["cluster.slurm"].seen_ids
    assert gpu_ids and cpu_ids and not gpu_ids & cpu_ids
    rows = read_timeline(timeline)
    done = {kind: [r for r in rows if r["kind"] == kind and r["ok"]] for kind in ("train", "label")}
    assert len(done["train"]) == 5 and len(done["label"]) == 6  # all of the work, once each
    # (a) the right tasks on the right jobs: GPU tasks only on GPU jobs, labels only on CPU jobs
    assert {r["job"] for r in done["train"]} <= gpu_ids
    assert {r["job"] for r in done["label"]} <= cpu_ids
    queue = seen["queue"]
    assert queue[seen["killed"]] == ("dask-gpu-worker", "gres:gpu:1")  # Slurm's view of that job
    assert all(name == "dask-worker" and gres == "N/A" for i, (name, gres) in queue.items()
               if i in cpu_ids)
    # (b) the cancelled GPU job was replaced, and the rest of the GPU work ran on the new one
    assert seen["killed"] in watches["cluster.gpu"].replaced_ids
    after = {r["job"] for r in done["train"]} - {seen["killed"]}
    assert after and after <= gpu_ids
    failed = [r for r in map(json.loads, timeline.read_text().splitlines()) if r["failure"]]
    assert failed and all(r["kind"] == "train" for r in failed)  # lost with the killed job


def test_learn_campaign_on_the_heterogeneous_pool_labels_once(slurm, tmp_path):
    """``convergent learn`` with cluster.gpu: members are trained, MD explored, candidates
    scored and the committee evaluated on the GPU job's worker; labels on the CPU jobs; the
    labels' keys are unique."""
    from convergent.cli import main
    from convergent.data.reader import open_dataset

    run = tmp_path / "learn"
    before_gpu, before_cpu = _jobcomp(slurm, "dask-gpu-worker"), _jobcomp(slurm, "dask-worker")
    sets = [s for s in SETS if not s.startswith("cluster.")] + [
        "cluster.kind=slurm", "cluster.dashboard_address=null", "cluster.slurm.cores=1",
        "cluster.slurm.memory=1GiB", "cluster.slurm.adapt_max=2", "cluster.slurm.interface=lo",
        f"cluster.slurm.log_directory={tmp_path / 'joblogs'}", "cluster.gpu.enabled=true",
        "cluster.gpu.cores=1", "cluster.gpu.memory=1GiB", "cluster.gpu.walltime=00:20:00"]
    assert main(["learn", "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]]) == 0
    ds = open_dataset(run / "data" / "labels")
    try:
        keys = ds.keys()
    finally:
        ds.close()
    assert len(keys) == len(set(keys)) == 4 + 2 * 3  # nothing labelled twice
    time.sleep(1.0)  # the jobs were cancelled on close; jobcomp is written as they end
    gpu_ids = _jobcomp(slurm, "dask-gpu-worker") - before_gpu
    cpu_ids = _jobcomp(slurm, "dask-worker") - before_cpu
    assert gpu_ids and cpu_ids
    spans = read_timeline(run / "learn" / "timeline.jsonl")
    # "holdout": the held-out set, labelled in the background while the first committee
    # trains (pipelined) — xTB work, so on the CPU jobs like "label"
    assert {s["kind"] for s in spans} == GPU_KINDS | {"label", "holdout"}
    for s in spans:
        assert s["job"] in (gpu_ids if s["kind"] in GPU_KINDS else cpu_ids), s
        assert s["device"] == ("cuda" if s["kind"] in GPU_KINDS else "cpu"), s


def test_gpu_job_kind_refused_or_never_starting_is_one_error(slurm, tmp_path, capsys):
    """A GPU job Slurm refuses stops learn before any work, naming cluster.gpu's field; one
    that never starts stops it after cluster.slurm.start_timeout_s, with its reason."""
    from convergent.cli import main

    base = ["learn", *[a for s in SETS if not s.startswith("cluster.")
                       for a in ("--set", s)],
            "--set", "cluster.kind=slurm", "--set", "cluster.slurm.interface=lo",
            "--set", "cluster.slurm.cores=1", "--set", "cluster.slurm.memory=1GiB",
            "--set", f"cluster.slurm.log_directory={tmp_path / 'joblogs'}",
            "--set", "cluster.gpu.enabled=true", "--set", "cluster.gpu.cores=1",
            "--set", "cluster.gpu.memory=1GiB"]
    refused = [*base, "--run-dir", str(tmp_path / "a"), "--set", "cluster.gpu.queue=nosuchpartition"]
    assert main(refused) == 2
    err = capsys.readouterr().err
    assert "cluster.gpu.queue" in err and "Invalid partition name" in err
    # 20 s: long enough for the CPU jobs to start on a busy machine (make test runs files
    # side by side), the held GPU job never does
    held = [*base, "--run-dir", str(tmp_path / "b"), "--set", "cluster.slurm.start_timeout_s=20",
            "--set", 'cluster.gpu.job_extra_directives=["--begin=now+1hour"]']
    assert main(held) == 2  # the CPU jobs label the initial set; the GPU job never starts
    err = capsys.readouterr().err
    assert "cluster.slurm.start_timeout_s=20" in err and "BeginTime" in err
    assert "cluster.gpu.gres=gpu:1" in err and err.count("error:") == 1
    assert not [i for i, (name, _) in _squeue().items() if name.startswith("dask-")]
