"""The ``--submit`` path of ``convergent train``: run dir, config, sbatch script, sbatch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from convergent.core.errors import ConfigError
from convergent.runsdb.rundir import RunDir, open_run, run_path
from convergent.train.launch import preflight, resolved_config_path
from convergent.train.sbatch import job_for, render, submit, write_script


def submit_training(cfg, run_dir: Path | None, resume: bool, nproc: int | None,
                    nnodes: int | None, requeue: bool, print_only: bool,
                    echo: Callable[[str], None]) -> str | None:
    """Write ``<run>/train.sbatch`` and submit it (or only print it); returns the job id."""
    # the GPUs are on the compute nodes, not here: no ranks-vs-visible-GPUs check
    # (parallel.nproc: auto resolves on this machine; give --nproc for GPU nodes)
    n = preflight(cfg, nproc, data=not print_only, fit=False).nproc
    m = nnodes or cfg.parallel.nnodes
    if n < 1 or m < 1:
        raise ConfigError(f"--nproc ({n}) and --nnodes ({m}) must be >= 1")
    if print_only:
        path = run_path(cfg, run_dir, "train")
        echo(render(job_for(cfg, path, RunDir(path).config, n, m, requeue)).rstrip())
        return None
    run = open_run(cfg, run_dir, resume=resume, command="train")
    for sub in (run.logs, run.ckpt):
        sub.mkdir(parents=True, exist_ok=True)
    job = job_for(cfg, run.path, resolved_config_path(cfg, run), n, m, requeue)
    script = write_script(job)
    job_id = submit(script)
    log = str(job.log_pattern).replace("%j", job_id)
    echo(f"submitted job {job_id} ({job.job_name}, {m} node(s) x {n} process(es)): {script}")
    echo(f"  log: {log}")
    echo(f"  watch: squeue -j {job_id}; metrics: {run.metrics}")
    return job_id
