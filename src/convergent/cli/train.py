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
        import shlex

        from convergent.runs import RunDir, open_run, run_path
        from convergent.train.launch import build_command, launch_training, preflight

        cfg = config_from_cli(config, sets)
        if requeue and not submit:
            from convergent.errors import ConfigError

            raise ConfigError("--requeue needs --submit (it makes the submitted job requeueable)")
        if submit:
            from convergent.train.submit import submit_training

            submit_training(cfg, run_dir, resume, nproc, nnodes, requeue, print_launch,
                            typer.echo)
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
            typer.echo(shlex.join(cmd))
            return
        from convergent.train.tasks import check_before_launch

        # inputs are checked before the run directory exists: a failed start leaves nothing
        run = open_run(cfg, run_dir, resume=resume, command="train",
                       check=lambda: check_before_launch(cfg))

        def show(rec: dict) -> None:
            if rec["kind"] == "val":
                typer.echo(f"  val step {rec['step']}: loss {rec['loss']:.5g}")
            elif rec["step"] % max(1, cfg.metrics.log_every) == 0 or rec["step"] == cfg.train.steps:
                unit = "atoms_per_s" if "atoms_per_s" in rec else "tokens_per_s"
                mfu = f"{rec['mfu']:.2%}" if rec.get("mfu") is not None else "n/a"
                typer.echo(
                    f"step {rec['step']}/{cfg.train.steps} loss {rec['loss']:.5g} "
                    f"{unit.split('_')[0]}/s {rec[unit]:.0f} mfu {mfu}"
                )

        typer.echo(
            f"placement: {placement.nproc} x {placement.device} ({placement.backend})"
            + (f" on {', '.join(placement.gpu_names)}" if placement.gpu_names else "")
        )
        from convergent.runsdb.usage import measure, record_stage

        result, usage = measure(cfg, "train", lambda: launch_training(
            cfg, run, nproc=nproc, max_restarts=max_restarts, nnodes=nnodes, progress=show
        ), placement=placement)
        record_stage(run, "train", {"steps": result.steps, "restarts": result.restarts, **usage})
        typer.echo(
            f"trained {result.steps} steps in {result.seconds:.1f} s "
            f"(restarts: {result.restarts}); final loss {result.final_loss:.5g}; "
            f"weights: {result.final_dir}"
        )
        if cfg.tracking.mlflow:
            from convergent.tracking.finish import finish_run

            tracked = finish_run(cfg, run.path)
            typer.echo(f"mlflow: run {tracked['run_id']} in {tracked['uri']} "
                       f"(model version {tracked['model_version']})")
