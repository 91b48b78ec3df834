"""`convergent simulate` and `convergent relabel`: thin CLI over :mod:`convergent.sim`.

    convergent simulate --source g2 --sampler md --temperatures 300,600 --frames 5000
    convergent simulate --out data/g2 --set simulate.rattle_sigma=0.1
    convergent relabel runs/demo/data/sim data/dft --fraction 0.05

The shortcut options are ``--set simulate.<field>=<value>`` overrides. Without ``--out``
the dataset goes to ``<run dir>/data/sim`` (``--resume`` continues a run); with ``--out``
re-running the same command resumes that dataset.
"""

from __future__ import annotations

from pathlib import Path

import typer

from convergent.cli.common import CONFIG_ARG, RESUME_OPT, RUN_DIR_OPT, SET_OPT, config_from_cli
from convergent.core.fsutil import dumps_json


def _shortcuts(**values: object) -> list[str]:
    out = []
    for field, value in values.items():
        if value is None:
            continue
        if field == "temperatures":
            temps = [t.strip() for t in str(value).split(",") if t.strip()]
            out.append(f"simulate.temperatures=[{','.join(temps)}]")
        elif field.startswith("cluster."):
            out.append(f"{field}={value}")
        else:
            out.append(f"simulate.{field}={value}")
    return out


def _print_summary(console, title: str, summary) -> None:
    s = summary
    console.print(
        f"[bold]{title}[/bold]: done {s.done}, skipped {s.skipped} (already present), "
        f"retried {s.retried}, quarantined {s.quarantined}"
        + (f", inputs rejected {s.input_rejected}" if s.input_rejected else "")
    )
    console.print(
        f"  wall {s.wall_s:.1f} s (compute {s.compute_wall_s:.1f} s), {s.frames_per_s:.1f} frames/s, "
        f"mean calculation {s.mean_calc_s * 1e3:.2f} ms, {s.n_workers} workers"
    )
    console.print(f"  dataset: {s.dataset}")
    if s.quarantined or s.input_rejected:
        console.print(f"  quarantine: {s.quarantine_file}  reasons: {dumps_json(s.reasons)}")


def register(app: typer.Typer) -> None:
    """Add the `simulate` and `relabel` commands to the root app."""

    @app.command("simulate")
    def _simulate(
        config: Path | None = CONFIG_ARG,
        sets: list[str] | None = SET_OPT,
        source: str | None = typer.Option(
            None, help="g2 | s22 | nci | smiles:<file> | <file>.xyz/.extxyz"),
        sampler: str | None = typer.Option(None, help="rattle | md"),
        temperatures: str | None = typer.Option(None, help="MD temperatures in K, e.g. 300,600"),
        frames: int | None = typer.Option(None, help="Total labelled frames to produce."),
        calculator: str | None = typer.Option(None, help="xtb | dft | emt"),
        method: str | None = typer.Option(None, help="GFN2-xTB, or HF/<xc> for dft"),
        chunk_size: int | None = typer.Option(None, help="Frames per Dask task (rattle)."),
        seed: int | None = typer.Option(None, help="Campaign seed."),
        cluster: str | None = typer.Option(None, help="local | slurm | address"),
        address: str | None = typer.Option(None, help="Scheduler address for --cluster address."),
        workers: int | None = typer.Option(None, help="Local workers (default: usable cores)."),
        out: Path | None = typer.Option(
            None, "--out", "-o", help="Dataset directory (default <run dir>/data/sim)."),
        run_dir: Path | None = RUN_DIR_OPT,
        resume: bool = RESUME_OPT,
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar."),
    ) -> None:
        """Label molecules with a fault-tolerant Dask task farm into a dataset."""
        from rich.console import Console

        from convergent.sim.command import simulate_command

        overrides = list(sets or []) + _shortcuts(
            source=source, sampler=sampler, temperatures=temperatures, frames=frames,
            calculator=calculator, method=method, chunk_size=chunk_size, seed=seed,
            **{"cluster.kind": cluster, "cluster.address": address, "cluster.n_workers": workers},
        )
        console = Console(stderr=True)
        summary = simulate_command(config_from_cli(config, overrides), out, run_dir, resume,
                                   progress, console)
        _print_summary(console, "simulate", summary)

    @app.command("relabel")
    def _relabel(
        source: Path = typer.Argument(..., help="Dataset to take frames from."),
        target: Path = typer.Argument(..., help="Dataset to write relabelled frames to."),
        config: Path | None = typer.Option(None, "--config", "-c", help="YAML config file."),
        sets: list[str] | None = SET_OPT,
        fraction: float | None = typer.Option(None, help="Fraction of frames (seeded choice)."),
        calculator: str | None = typer.Option(None, help="dft | xtb | emt"),
        method: str | None = typer.Option(None, help="HF or an xc functional, e.g. B3LYP"),
        basis: str | None = typer.Option(None, help="Basis set, e.g. 6-31G*"),
        density_fit: bool | None = typer.Option(
            None, "--density-fit/--no-density-fit", help="RI density fitting."),
        cluster: str | None = typer.Option(None, help="local | slurm | address"),
        address: str | None = typer.Option(None, help="Scheduler address for --cluster address."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar."),
    ) -> None:
        """Multi-fidelity: relabel a fraction of a dataset at a higher level (same keys)."""
        from rich.console import Console

        from convergent.sim.relabel import relabel

        overrides = list(sets or [])
        for field, value in (("fraction", fraction), ("calculator", calculator),
                             ("method", method), ("basis", basis), ("density_fit", density_fit)):
            if value is not None:
                overrides.append(f"simulate.relabel.{field}={value}")
        overrides += _shortcuts(**{"cluster.kind": cluster, "cluster.address": address})
        cfg = config_from_cli(config, overrides)
        console = Console(stderr=True)
        summary = relabel(source, target, cfg.simulate.relabel, cfg.cluster, progress=progress,
                          console=console)
        _print_summary(console, "relabel", summary)
