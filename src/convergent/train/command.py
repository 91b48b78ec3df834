"""``convergent train`` below the CLI: launch here, print the launch, or submit to Slurm.

The CLI parses the options and calls :func:`train_command`; the progress lines, the
usage record of the stage and the MLflow finish happen here. ``echo`` prints a line.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from convergent.config import ConvergentConfig
from convergent.core.errors import ConfigError
from convergent.runsdb.rundir import RunDir, open_run, run_path
from convergent.runsdb.trainrecords import TrainStep, ValRecord
from convergent.runsdb.usage import measure, record_stage
from convergent.tracking.finish import finish_run
from convergent.train.launch import build_command, launch_training, preflight
from convergent.train.submit import submit_training
from convergent.train.tasks import check_before_launch

Echo = Callable[[str], None]


def progress_line(row: dict[str, Any], steps: int, log_every: int) -> str | None:
    """The console line of a metrics record (a val pass, or every ``log_every``-th step
    and the last), or None."""
    if row.get("kind") == ValRecord.KIND:
        val = ValRecord.from_dict(row)
        return f"  val step {val.step}: loss {val.loss:.5g}"
    rec = TrainStep.from_dict(row)
    if rec.step % max(1, log_every) and rec.step != steps:
        return None
    mfu = f"{rec.mfu:.2%}" if rec.mfu is not None else "n/a"
    return (f"step {rec.step}/{steps} loss {rec.loss:.5g} "
            f"{rec.unit}/s {rec.units_per_s:.0f} mfu {mfu}")


def train_command(
    cfg: ConvergentConfig, echo: Echo, run_dir: Path | None = None, resume: bool = False,
    nproc: int | None = None, nnodes: int | None = None, print_launch: bool = False,
    max_restarts: int = 0, submit: bool = False, requeue: bool = False,
) -> None:
    """Train (or print the launch command, or submit it with ``submit``)."""
    if requeue and not submit:
        raise ConfigError("--requeue needs --submit (it makes the submitted job requeueable)")
    if submit:
        submit_training(cfg, run_dir, resume, nproc, nnodes, requeue, print_launch, echo)
        return
    # before any run dir; a printed command may be meant for other nodes' GPUs
    placement = preflight(cfg, nproc, data=not print_launch, fit=not print_launch)
    if print_launch:
        path = run_path(cfg, run_dir, "train")
        cmd = build_command(
            RunDir(path).config, path, placement.nproc, nnodes or cfg.parallel.nnodes,
            max_restarts,
            cfg.parallel.rdzv_endpoint,
        )
        echo(shlex.join(cmd))
        return
    # inputs are checked before the run directory exists: a failed start leaves nothing
    run = open_run(cfg, run_dir, resume=resume, command="train",
                   check=lambda: check_before_launch(cfg))

    def show(row: dict[str, Any]) -> None:
        line = progress_line(row, cfg.train.steps, cfg.metrics.log_every)
        if line is not None:
            echo(line)

    echo(
        f"placement: {placement.nproc} x {placement.device} ({placement.backend})"
        + (f" on {', '.join(placement.gpu_names)}" if placement.gpu_names else "")
    )
    result, usage = measure(cfg, "train", lambda: launch_training(
        cfg, run, nproc=nproc, max_restarts=max_restarts, nnodes=nnodes, progress=show
    ), placement=placement)
    record_stage(run, "train", {"steps": result.steps, "restarts": result.restarts, **usage})
    echo(
        f"trained {result.steps} steps in {result.seconds:.1f} s "
        f"(restarts: {result.restarts}); final loss {result.final_loss:.5g}; "
        f"weights: {result.final_dir}"
    )
    if cfg.tracking.mlflow:
        tracked = finish_run(cfg, run.path)
        echo(f"mlflow: run {tracked['run_id']} in {tracked['uri']} "
             f"(model version {tracked['model_version']})")
