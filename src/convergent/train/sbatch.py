"""``convergent train --submit``: a readable sbatch script (srun + torchrun) and its submission.

The script is written to ``<run>/train.sbatch`` and is meant to be read, edited and
resubmitted by hand (``sbatch <run>/train.sbatch``). Its shape::

    #SBATCH --job-name=... --nodes=M --ntasks-per-node=1 --cpus-per-task=C
    #SBATCH --output=<run>/logs/slurm-%j.out --open-mode=append
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    srun --cpu-bind=cores ... bash -c 'exec python -m torch.distributed.run --nnodes=M
        --nproc-per-node=N --rdzv-backend=c10d --rdzv-endpoint=$head:$port
        --rdzv-conf=is_host=<node 0 only> -m convergent.train.main ...'

The first node of the allocation hosts the rendezvous store (``is_host`` is explicit, so
it also works when node names are aliases of one machine). With ``--requeue`` the job is
requeueable and asks for ``--signal=B:USR1@<s>``: the script answers the warning with
``scontrol requeue``, Slurm then sends SIGTERM to the training processes, which write a
DCP checkpoint and exit (:mod:`convergent.train.preempt`); the requeued job resumes from
it. ``scontrol requeue <job>`` by hand takes the same path.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from convergent.core.errors import ConfigError, ConvergentError
from convergent.core.fsutil import atomic_write_text
from convergent.train.preempt import REQUEUE_ENV


@dataclass
class SbatchJob:
    """Everything the script needs (one typed record, rendered by :func:`render`)."""

    run_dir: Path
    config_path: Path
    job_name: str
    nnodes: int
    nproc: int
    cpus_per_task: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str = "01:00:00"
    requeue: bool = False
    signal_s: int = 60
    rdzv_port: int | None = None  # None: a free port on the first node, chosen at start
    threads: int = 1
    python: str = field(default_factory=lambda: sys.executable)
    extra_directives: list[str] = field(default_factory=list)
    workdir: Path = field(default_factory=Path.cwd)

    @property
    def script_path(self) -> Path:
        return self.run_dir / "train.sbatch"

    @property
    def log_pattern(self) -> Path:
        return self.run_dir / "logs" / "slurm-%j.out"


def render(job: SbatchJob) -> str:
    """The sbatch script text (see the module doc)."""
    q = shlex.quote
    d = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nnodes}",
        "--ntasks-per-node=1",
        f"--time={job.time}",
        f"--output={job.log_pattern}",
        "--open-mode=append",
    ]
    if job.cpus_per_task:
        d.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.partition:
        d.append(f"--partition={job.partition}")
    if job.account:
        d.append(f"--account={job.account}")
    if job.requeue:
        d += ["--requeue", f"--signal=B:USR1@{job.signal_s}"]
    d += [x if x.startswith("-") else f"--{x}" for x in job.extra_directives]
    args = [
        f"exec {q(job.python)} -m torch.distributed.run",
        f"--nnodes={job.nnodes} --nproc-per-node={job.nproc} --max-restarts=0",
        '--rdzv-backend=c10d --rdzv-endpoint="$0:$1" --rdzv-id="$SLURM_JOB_ID"',
        '--rdzv-conf=is_host=$([ "$SLURM_NODEID" = 0 ] && echo true || echo false)',
        f"-m convergent.train.main --config {q(str(job.config_path))}",
        f"--run-dir {q(str(job.run_dir))}",
    ]
    if "'" in "".join(args):
        raise ConfigError(f"paths with a single quote cannot go into the sbatch script: {args}")
    torchrun = " \\\n    ".join(args)
    lines = [
        "#!/bin/bash",
        *[f"#SBATCH {x}" for x in d],
        "#",
        "# Written by `convergent train --submit`; edit and resubmit with",
        f"#   sbatch {job.script_path}",
        "# One torchrun per node (srun); the first node hosts the c10d rendezvous.",
        "set -uo pipefail",
        f"cd {q(str(job.workdir))}",
        f"export OMP_NUM_THREADS={job.threads} PYTHONUNBUFFERED=1",
    ]
    if job.requeue:
        lines += [
            f"export {REQUEUE_ENV}=1  # SIGTERM/SIGUSR1: checkpoint, exit, resume on requeue",
            "# the preemption warning (--signal=B:USR1@N) reaches this shell: requeue the job;",
            "# Slurm then sends SIGTERM to the training processes, which checkpoint and exit",
            "trap 'echo \"$(date -Is) preemption warning: requeue $SLURM_JOB_ID\"; "
            "scontrol requeue \"$SLURM_JOB_ID\"' USR1",
        ]
    lines += [
        'echo "$(date -Is) job $SLURM_JOB_ID on $SLURM_JOB_NODELIST '
        '(restart ${SLURM_RESTART_COUNT:-0})"',
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        (f"port={job.rdzv_port}" if job.rdzv_port else
         f"port=$({q(job.python)} -c 'import socket; s = socket.socket(); "
         "s.bind((\"\", 0)); print(s.getsockname()[1])')"
         "  # a free port on this (the first) node"),
        "srun --kill-on-bad-exit=1 --cpu-bind=cores bash -c \\",
        f"  '{torchrun}' \\",
        '  "$head" "$port" &',
        "wait $! ; rc=$?",
        "wait 2>/dev/null  # after a trapped signal, wait for srun itself",
        'echo "$(date -Is) training step ended with exit code $rc"',
        "exit $rc",
    ]
    return "\n".join(lines) + "\n"


def write_script(job: SbatchJob) -> Path:
    (job.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_text(job.script_path, render(job))
    return job.script_path


def submit(script: Path) -> str:
    """``sbatch script``; returns the job id, or raises with sbatch's message."""
    if shutil.which("sbatch") is None:
        raise ConfigError("--submit needs sbatch on PATH (a Slurm login node)",
                          hint="use --print-launch to see the script, or run without --submit")
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        msg = (out.stderr or out.stdout).strip().splitlines()
        raise ConvergentError(
            f"sbatch refused {script}: {msg[-1] if msg else out.returncode}",
            hint="edit the #SBATCH lines (or parallel.slurm.*) and submit again",
        )
    m = re.match(r"(\d+)", out.stdout.strip())
    if not m:
        raise ConvergentError(f"sbatch printed no job id: {out.stdout.strip()!r}")
    return m.group(1)


def job_for(cfg, run_dir: Path, config_path: Path, nproc: int, nnodes: int,
            requeue: bool) -> SbatchJob:
    """The job of ``convergent train --submit`` from the config (``parallel.slurm``)."""
    s = cfg.parallel.slurm
    return SbatchJob(
        run_dir=Path(run_dir).resolve(),
        config_path=Path(config_path).resolve(),
        job_name=s.job_name or f"convergent-train-{Path(run_dir).name}",
        nnodes=nnodes,
        nproc=nproc,
        cpus_per_task=s.cpus_per_task or max(1, nproc * cfg.train.threads),
        partition=s.partition,
        account=s.account,
        time=s.time,
        requeue=requeue,
        signal_s=s.signal_s,
        rdzv_port=s.rdzv_port,
        threads=cfg.train.threads,
        python=s.python or sys.executable,
        extra_directives=list(s.extra_directives),
        workdir=Path(os.getcwd()),
    )
