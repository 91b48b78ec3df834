"""Core- and GPU-seconds per stage: our own measurement and Slurm's record, side by side.

Every stage appends :class:`Usage` records to ``<run>/accounting.jsonl`` (one JSON object
a line; sum ``core_s``/``gpu_s`` over any grouping):

* ``source: "self"`` — from the stage's own metrics: simulate = summed task seconds on
  single-threaded workers; train = ranks x threads x wall seconds (GPU-seconds = ranks x
  wall seconds when the ranks ran on GPUs);
* ``source: "slurm"`` — the Slurm job's accounting (``sacct`` where slurmdbd answers, else
  the ``jobcomp/filetxt`` file named by ``scontrol show config``): allocated CPUs x
  elapsed seconds, GPUs x elapsed from the allocated TRES.

``job_id`` ties the two together (a requeued job has a ``self`` record per attempt and a
``slurm`` record per run, ``detail.start`` tells them apart); :func:`collect_slurm` adds
Slurm's record of every ended run of each job a ``self`` record names (``convergent
report`` calls it; calling it again only adds runs that ended since).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from convergent.core.fsutil import dumps_json

ACCOUNTING_NAME = "accounting.jsonl"
LIVE = {"RUNNING", "PENDING", "REQUEUED", "SUSPENDED", "COMPLETING", "CONFIGURING"}


@dataclass
class Usage:
    """Resources one stage used (``self``) or one Slurm job was charged (``slurm``)."""

    stage: str  # simulate | train | ...
    source: Literal["self", "slurm"]
    core_s: float
    gpu_s: float = 0.0
    job_id: str | None = None  # the Slurm job (None: not on Slurm)
    wall_s: float = 0.0
    cores: int = 0
    gpus: int = 0
    detail: dict[str, Any] = field(default_factory=dict)  # e.g. sacct/jobcomp fields


def append_usage(run_dir: str | Path, records: list[Usage]) -> None:
    """Append records to ``<run>/accounting.jsonl`` (whole lines, flushed and fsynced)."""
    import os

    if not records:
        return
    path = Path(run_dir) / ACCOUNTING_NAME
    with path.open("a", encoding="utf-8") as fh:
        fh.write("".join(dumps_json(asdict(r)) + "\n" for r in records))
        fh.flush()
        os.fsync(fh.fileno())


def read_usage(run_dir: str | Path) -> list[Usage]:
    path = Path(run_dir) / ACCOUNTING_NAME
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(Usage(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue  # a torn last line of a killed writer
    return out


def _gpus(tres: str) -> int:
    m = re.search(r"gres/gpu(?::[^=,]*)?=(\d+)", tres or "")
    return int(m.group(1)) if m else 0


def _run(cmd: list[str]) -> subprocess.CompletedProcess | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None


def sacct_usage(stage: str, job_ids: list[str]) -> list[Usage] | None:
    """Records from sacct (None when sacct has no database to ask)."""
    out = _run(["sacct", "-X", "-D", "-n", "-P", "-j", ",".join(job_ids),
                "-o", "JobID,JobName,State,ElapsedRaw,AllocCPUS,AllocTRES,NodeList,Start"])
    if out is None or out.returncode != 0:
        return None
    recs = []
    for line in out.stdout.splitlines():
        f = line.split("|")
        if len(f) < 8 or not f[3].isdigit() or f[2].split()[0] in LIVE:
            continue  # a segment still running is collected once it has ended
        wall, cpus, gpus = float(f[3]), int(f[4] or 0), _gpus(f[5])
        recs.append(Usage(stage, "slurm", cpus * wall, gpus * wall, f[0], wall, cpus, gpus,
                          {"via": "sacct", "name": f[1], "state": f[2], "nodes": f[6],
                           "start": f[7]}))
    return recs


def jobcomp_path() -> Path | None:
    out = _run(["scontrol", "show", "config"])
    if out is None or out.returncode != 0:
        return None
    kv = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", out.stdout, flags=re.M))
    if kv.get("JobCompType") != "jobcomp/filetxt" or not kv.get("JobCompLoc"):
        return None
    return Path(kv["JobCompLoc"])


def jobcomp_usage(stage: str, job_ids: list[str], path: Path | None = None) -> list[Usage]:
    """Records from the jobcomp/filetxt file: one per line, i.e. per run of a job (a
    requeued job has a line for each run; the requeued run's state reads PENDING)."""
    path = path or jobcomp_path()
    if path is None or not path.exists():
        return []
    wanted, found = set(job_ids), []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        kv = dict(re.findall(r"(\w+)=(\S*)", line))
        if kv.get("JobId") not in wanted:
            continue
        try:
            start = datetime.fromisoformat(kv["StartTime"])
            end = datetime.fromisoformat(kv["EndTime"])
        except (KeyError, ValueError):
            continue
        wall = max(0.0, (end - start).total_seconds())
        cpus = int(kv.get("ProcCnt", "0") or 0)
        gpus = _gpus(kv.get("Tres", ""))
        found.append(Usage(
            stage, "slurm", cpus * wall, gpus * wall, kv["JobId"], wall, cpus, gpus,
            {"via": "jobcomp", "name": kv.get("Name"), "state": kv.get("JobState"),
             "nodes": kv.get("NodeList"), "start": kv["StartTime"]}))
    return found


def slurm_usage(stage: str, job_ids: list[str]) -> list[Usage]:
    """Slurm's record of each job: sacct if it answers, else the jobcomp file."""
    if not job_ids:
        return []
    recs = sacct_usage(stage, job_ids)
    return recs if recs else jobcomp_usage(stage, job_ids)


def collect_slurm(run_dir: str | Path) -> list[Usage]:
    """Append Slurm's record of every ended run of the jobs named by ``self`` records
    that is not there yet (idempotent: call it again after more jobs ended); returns them."""
    usage = read_usage(run_dir)
    have = {(u.stage, u.job_id, u.detail.get("start")) for u in usage if u.source == "slurm"}
    todo: dict[str, list[str]] = {}
    for u in usage:
        if u.source == "self":
            for job in [u.job_id, *u.detail.get("job_ids", [])]:
                if job and job not in todo.get(u.stage, []):
                    todo.setdefault(u.stage, []).append(job)
    new = [r for stage, jobs in todo.items() for r in slurm_usage(stage, jobs)
           if (stage, r.job_id, r.detail.get("start")) not in have]
    append_usage(run_dir, new)
    return new


def usage_table(run_dir: str | Path) -> list[tuple[str, str, str, str]]:
    """(stage, source, core-hours, GPU-hours) rows summed per stage and source."""
    sums: dict[tuple[str, str], list[float]] = {}
    for u in read_usage(run_dir):
        s = sums.setdefault((u.stage, u.source), [0.0, 0.0])
        s[0] += u.core_s
        s[1] += u.gpu_s
    return [(stage, src, f"{c / 3600:.4f}", f"{g / 3600:.4f}")
            for (stage, src), (c, g) in sorted(sums.items())]
