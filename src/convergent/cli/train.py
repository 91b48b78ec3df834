"""`convergent train`: launch the training engine (torchrun, or srun+torchrun in Slurm)."""

from __future__ import annotations

from pathlib import Path

import typer

from convergent.cli.common import CONFIG_ARG, RESUME_OPT, RUN_DIR_OPT, SET_OPT, config_from_cli

NPROC_OPT = typer.Option(None, "--nproc", min=1, help="Processes per node (default parallel.nproc).")
NNODES_OPT = typer.Option(None, "--nnodes", min=1, help="Nodes (>1 needs Slurm or parallel.rdzv_endpoint).")
PRINT_OPT = typer.Option(False, "--print-launch", help="Print the launch command and exit.")
RESTARTS_OPT = typer.Option(0, "--max-restarts", min=0, help="Elastic restarts after a worker failure.")
SUBMIT_OPT = typer.Option(
    False, "--submit", help="Write <run>/train.sbatch (srun + torchrun) and sbatch it; with "
    "--print-launch only print the script.")
REQUEUE_OPT = typer.Option(
    False, "--requeue", help="With --submit: on preemption (USR1 warning or scontrol requeue) "
    "checkpoint, exit and resume when Slurm requeues the job.")


def register(app: typer.Typer) -> None:
    """Add the `train` command to the root app."""

    @app.command("train")
    def _cmd(
        config: Path | None = CONFIG_ARG,
        sets: list[str] | None = SET_OPT,
        nproc: int | None = NPROC_OPT,
        nnodes: int | None = NNODES_OPT,
        print_launch: bool = PRINT_OPT,
        max_restarts: int = RESTARTS_OPT,
        run_dir: Path | None = RUN_DIR_OPT,
        resume: bool = RESUME_OPT,
        submit: bool = SUBMIT_OPT,
        requeue: bool = REQUEUE_OPT,
    ) -> None:
        """Train the molecular surrogate or a Llama LM (single|ddp|fsdp|hsdp|pipeline)."""
        from convergent.train.command import train_command

        train_command(
            config_from_cli(config, sets), typer.echo, run_dir=run_dir, resume=resume,
            nproc=nproc, nnodes=nnodes, print_launch=print_launch, max_restarts=max_restarts,
            submit=submit, requeue=requeue,
        )
