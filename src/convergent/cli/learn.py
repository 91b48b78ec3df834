"""`convergent learn`: active learning on one shared Dask pool (see convergent.learn)."""

from __future__ import annotations

from pathlib import Path

import typer

from convergent.cli.common import CONFIG_ARG, RESUME_OPT, RUN_DIR_OPT, SET_OPT, config_from_cli


def register(app: typer.Typer) -> None:
    """Add the `learn` command to the root app."""

    @app.command("learn")
    def _learn(
        config: Path | None = CONFIG_ARG,
        sets: list[str] | None = SET_OPT,
        run_dir: Path | None = RUN_DIR_OPT,
        resume: bool = RESUME_OPT,
    ) -> None:
        """Rounds of committee training -> candidates (pool + surrogate MD) -> selection by
        disagreement -> labels on Dask, until a label, time or error budget is reached."""
        from convergent.learn.config import LEARN_PRESET
        from convergent.learn.loop import check_inputs, run_learning
        from convergent.runsdb.rundir import open_run

        cfg = config_from_cli(config, sets, preset=LEARN_PRESET)
        run = open_run(cfg, run_dir, resume=resume, command="learn", check=lambda: check_inputs(cfg))
        summary = run_learning(cfg, run)
        final = summary.get("final") or {}
        typer.echo(f"labels: {summary['labels']}; rounds: {summary['rounds']}; stopped by: "
                   f"{summary['stop']}; held-out energy MAE "
                   f"{final.get('energy_mae_per_atom', float('nan')):.4f} eV/atom, per-element "
                   f"baseline {final.get('baseline_energy_mae_per_atom') or float('nan'):.4f}")
        typer.echo(f"report: {summary['report']}")
