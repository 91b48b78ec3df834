"""Launching training: torchrun on one machine, ``srun ... torchrun`` inside Slurm.

:func:`launch_training` is the stage API (used by ``convergent train`` and the demo):
it writes the resolved config into the run directory, runs torchrun with the entry
point :mod:`convergent.train.main`, blocks, and returns a :class:`TrainResult`; on
failure it raises :class:`~convergent.core.errors.ConvergentError` with the failing rank's
last log lines.

Command shapes (see :func:`build_command`):

* one machine: ``python -m torch.distributed.run --standalone --nnodes 1
  --nproc-per-node N --max-restarts K -m convergent.train.main --config C --run-dir D``
  (``--standalone`` picks a free port, so parallel runs never collide);
* Slurm with ``--nnodes M > 1``: ``srun --nodes M --ntasks-per-node 1 --kill-on-bad-exit=1
  python -m torch.distributed.run --nnodes M --nproc-per-node N --rdzv-backend c10d
  --rdzv-endpoint <first node>:29500 --rdzv-id <job id> ...``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convergent.cluster.placement import Placement, gpu_names, plan_training, visible_gpus
from convergent.config import ConvergentConfig, dump_config
from convergent.core.errors import ConfigError, ConvergentError
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.runsdb.rundir import RunDir
from convergent.train.tasks import check_before_launch
from convergent.train.topology import expand_hostlist

DEFAULT_RDZV_PORT = 29500


@dataclass
class TrainResult:
    """Outcome of a training run (rank 0's summary plus what the launcher saw)."""

    steps: int
    final: dict[str, Any] | None  # last train_step record
    val: dict[str, Any] | None  # last val record
    seconds: float
    restarts: int
    checkpoint: Path | None  # last DCP checkpoint directory
    final_dir: Path | None  # safetensors export (models.io layout), or None
    command: list[str] = field(default_factory=list)
    placement: Placement | None = None  # device, processes, backend, GPU names

    @property
    def final_loss(self) -> float | None:
        return None if self.final is None else self.final.get("loss")


def in_slurm(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return "SLURM_JOB_ID" in env and "SLURM_JOB_NODELIST" in env


def entry_args(config_path: Path, run_dir: Path) -> list[str]:
    return ["-m", "convergent.train.main", "--config", str(config_path), "--run-dir", str(run_dir)]


def build_command(
    config_path: Path,
    run_dir: Path,
    nproc: int,
    nnodes: int = 1,
    max_restarts: int = 0,
    rdzv_endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
) -> list[str]:
    """The launch command (see the module doc); Slurm form when ``nnodes > 1``."""
    env = os.environ if env is None else env
    py = python or sys.executable
    if nproc < 1 or nnodes < 1:
        raise ConfigError(f"--nproc ({nproc}) and --nnodes ({nnodes}) must be >= 1")
    torchrun = [py, "-m", "torch.distributed.run"]
    common = [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    if nnodes == 1 and rdzv_endpoint is None:
        return [*torchrun, "--standalone", "--nnodes=1", *common, *entry_args(config_path, run_dir)]
    if rdzv_endpoint is None:
        if not in_slurm(env):
            raise ConfigError(
                f"--nnodes {nnodes} needs a Slurm allocation or parallel.rdzv_endpoint",
                hint="run inside salloc/sbatch, or set parallel.rdzv_endpoint=host:port "
                "and start the printed command on every node",
            )
        head = expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        rdzv_endpoint = f"{head}:{DEFAULT_RDZV_PORT}"
    rdzv_id = env.get("SLURM_JOB_ID", "convergent")
    cmd = [
        *torchrun,
        f"--nnodes={nnodes}",
        *common,
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        *entry_args(config_path, run_dir),
    ]
    if in_slurm(env):
        srun = [
            "srun",
            f"--nodes={nnodes}",
            f"--ntasks={nnodes}",
            "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
        ]
        cpus = env.get("SLURM_CPUS_ON_NODE")
        if cpus:
            srun.append(f"--cpus-per-task={cpus}")
        return [*srun, *cmd]
    return cmd


def resolved_config_path(cfg: ConvergentConfig, run: RunDir) -> Path:
    """The run's config file if it equals ``cfg``, else a written ``train_config.yaml``."""
    text = dump_config(cfg)
    if run.config.exists() and run.config.read_text(encoding="utf-8") == text:
        return run.config
    path = run.path / "train_config.yaml"
    atomic_write_text(path, text)
    return path


def child_env(cfg: ConvergentConfig, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(cfg.train.threads)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TORCHELASTIC_ERROR_FILE", "")
    env.pop("TORCHELASTIC_ERROR_FILE")
    if extra:
        env.update(extra)
    return env


def _tail(path: Path, n: int = 15) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:]
    except OSError:
        return []


def failure_lines(run: RunDir, launcher_log: Path, n: int = 15) -> tuple[str, list[str]]:
    """(where, last lines) of the rank that failed first, else of the launcher log."""
    logdir = run.logs / "train"
    failed = []
    for p in sorted(logdir.glob("rank*.log")):
        text = p.read_text(encoding="utf-8", errors="replace") if p.exists() else ""
        idx = text.rfind("FAILED:")
        if idx >= 0:
            failed.append((p.stat().st_mtime, p))
    if failed:
        failed.sort()
        p = failed[0][1]
        return p.stem, _tail(p, n)
    return "torchrun", _tail(launcher_log, n)


@dataclass
class RankFailure:
    """Why a rank stopped, written by :mod:`convergent.train.main` as
    ``logs/train/rank<R>.failed.json`` so the launcher can say it in one line."""

    rank: int
    attempt: int
    type: str  # exception class name
    message: str  # first line of str(exc)
    hint: str | None = None
    user_error: bool = False  # a ConvergentError (bad data/config), not a bug
    time: float = 0.0


def write_rank_failure(run_path: Path, rank: int, exc: BaseException) -> None:
    """Record ``exc`` for the launcher (never raises: it runs while a rank is failing)."""
    try:
        msg = str(getattr(exc, "message", None) or exc or type(exc).__name__)
        if "Original Traceback" in msg:  # re-raised from a DataLoader worker: its last line
            last = [ln for ln in msg.splitlines() if ln.strip()][-1]
            msg = last.split(": ", 1)[1] if ": " in last else last
        rec = RankFailure(
            rank=rank, attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            type=type(exc).__name__, message=" ".join(msg.split("\n")[0].split()),
            hint=getattr(exc, "hint", None), user_error=isinstance(exc, ConvergentError),
            time=time.time(),
        )
        atomic_write_text(run_path / "logs" / "train" / f"rank{rank}.failed.json",
                          dumps_json(vars(rec)))
    except Exception:  # noqa: BLE001 - the log line above already holds the traceback
        pass


def first_failure(run: RunDir) -> RankFailure | None:
    """The earliest rank failure recorded in this launch (None if no rank wrote one)."""
    found = []
    for p in (run.logs / "train").glob("rank*.failed.json"):
        try:
            found.append(RankFailure(**json.loads(p.read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError):
            continue
    # the root cause fails first; the other ranks then fail on the broken collective
    return min(found, key=lambda f: (not f.user_error, f.time)) if found else None


def _failure_error(run: RunDir, launcher_log: Path, returncode: int | None) -> ConvergentError:
    """One line naming the failing rank and its error; ``--debug`` adds the log tail."""
    fail = first_failure(run)
    where, lines = failure_lines(run, launcher_log)
    if fail is not None:
        log = run.logs / "train" / f"rank{fail.rank}.log"
        kind = "" if fail.user_error else f"{fail.type}: "
        msg = f"training failed on rank {fail.rank}: {kind}{fail.message}"
        hint = (fail.hint + "; " if fail.hint else "") + f"full log: {log}"
    else:
        last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "no log lines")
        msg = f"training failed (exit code {returncode}); last line of {where}: {last}"
        hint = f"full logs in {run.logs / 'train'} and {launcher_log}"
    if os.environ.get("CONVERGENT_DEBUG", "") not in ("", "0"):
        msg += f"\nlast lines of {where}:\n  " + "\n  ".join(lines)
    err = ConvergentError(msg, hint=hint)
    if fail is not None and not fail.user_error:
        err.exit_code = 1  # a bug or a crash inside training, not the user's input
    return err


def _count_restarts(run: RunDir) -> int:
    attempts = set()
    for p in (run.logs / "train").glob("rank*.log"):
        for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
            i = line.find(" attempt")
            if i >= 0:
                tok = line[i + 8 :].split(" ", 1)[0]
                if tok.isdigit():
                    attempts.add(int(tok))
    return max(attempts) if attempts else 0


def plan_placement(
    cfg: ConvergentConfig, nproc: int | None = None, env: Mapping[str, str] | None = None,
    fit: bool = True,
) -> Placement:
    """Device, processes per node and backend of this job on this node's GPUs.

    ``nproc`` (``--nproc``) overrides ``parallel.nproc``. Raises ConfigError (exit 2)
    when more ranks than visible GPUs are asked for on CUDA (see :mod:`convergent.cluster.placement`;
    ``fit=False``: not checked, for a command printed to run elsewhere).
    """
    gpus = visible_gpus(env)
    return plan_training(
        cfg.train.device, nproc or cfg.parallel.nproc, cfg.parallel.strategy,
        cfg.parallel.backend, gpus, cfg.precision.dtype, gpu_names(env) if gpus else [], fit,
    )


def preflight(
    cfg: ConvergentConfig, nproc: int | None = None, data: bool = True, fit: bool = True
) -> Placement:
    """Every check that can fail before a run directory is created; the placement
    (``data``/``fit`` false: skip the dataset paths / the ranks-vs-GPUs check)."""
    check_before_launch(cfg, data=data)
    return plan_placement(cfg, nproc, fit=fit)


def launch_training(
    cfg: ConvergentConfig,
    run: RunDir,
    nproc: int | None = None,
    max_restarts: int = 0,
    nnodes: int | None = None,
    print_only: bool = False,
    env: Mapping[str, str] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Run training with torchrun (or srun+torchrun inside Slurm) and wait for it.

    ``nproc`` defaults to ``cfg.parallel.nproc`` (``auto``: one per visible GPU on
    CUDA, 2 on CPU; 1 for ``strategy: single``), ``nnodes``
    to ``cfg.parallel.nnodes``. ``progress`` is called with each new metrics record
    (rank 0's ``train_step``/``val`` lines) while the job runs. ``print_only`` returns at
    once with the command in ``TrainResult.command``. Raises ConvergentError naming the
    failing rank and showing its last log lines.
    """
    # fail before launching (exit 2)
    placement = preflight(cfg, nproc, data=not print_only, fit=not print_only)
    nproc = placement.nproc
    nnodes = nnodes or cfg.parallel.nnodes
    for sub in (run.logs, run.ckpt):
        sub.mkdir(parents=True, exist_ok=True)
    config_path = resolved_config_path(cfg, run)
    cmd = build_command(
        config_path, run.path, nproc, nnodes, max_restarts, cfg.parallel.rdzv_endpoint
    )
    if print_only:
        return TrainResult(0, None, None, 0.0, 0, None, None, cmd, placement)
    launcher_log = run.logs / "torchrun.log"
    result_file = run.logs / "train_result.json"
    if result_file.exists():
        result_file.unlink()
    for stale in (run.logs / "train").glob("rank*.failed.json"):
        stale.unlink()
    offset = run.metrics.stat().st_size if run.metrics.exists() else 0
    t0 = time.time()
    with launcher_log.open("a", encoding="utf-8") as fh:
        fh.write(f"$ {shlex.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=child_env(cfg, env),
            cwd=os.getcwd(),
        )
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                if progress is not None:
                    offset = _feed_progress(run.metrics, offset, progress)
        except BaseException:
            proc.terminate()  # torchrun forwards SIGTERM to its workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if progress is not None:
        _feed_progress(run.metrics, offset, progress)
    if proc.returncode != 0 or not result_file.exists():
        raise _failure_error(run, launcher_log, proc.returncode)
    summary = json.loads(result_file.read_text())
    return TrainResult(
        steps=int(summary["steps"]),
        final=summary.get("final"),
        val=summary.get("val"),
        seconds=time.time() - t0,
        restarts=_count_restarts(run),
        checkpoint=Path(summary["last_checkpoint"]) if summary.get("last_checkpoint") else None,
        final_dir=Path(summary["final_dir"]) if summary.get("final_dir") else None,
        command=cmd,
        placement=placement,
    )


def _feed_progress(path: Path, offset: int, progress: Callable[[dict[str, Any]], None]) -> int:
    if not path.exists():
        return offset
    with path.open("rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n")
    if end < 0:
        return offset
    for line in data[: end + 1].splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") in ("train_step", "val"):
            progress(rec)
    return offset + end + 1
