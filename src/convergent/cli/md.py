"""`convergent md`: batched Langevin MD of a surrogate on many molecules, with a stability
verdict per run (see convergent.screen.batchmd and convergent.screen.mdcheck)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the `md` command to the root app."""

    @app.command("md")
    def _md(
        model: list[str] = typer.Option(..., "--model", "-m",
                                        help="Saved model directory; repeat for a committee (its mean drives)."),
        source: str = typer.Option("g2", "--source", help="Molecules: g2 | s22 | nci | smiles:FILE | an .xyz/.extxyz file."),
        max_molecules: int | None = typer.Option(None, "--max-molecules", min=1, help="The first N of the source."),
        max_atoms: int = typer.Option(12, "--max-atoms", min=1),
        seeds: int = typer.Option(1, "--seeds", min=1, help="Runs per molecule, each with its own random stream."),
        temperature: float = typer.Option(300.0, "--temperature", min=1.0, max=5000.0, help="K."),
        time_fs: float = typer.Option(500.0, "--time-fs", min=1.0, max=1e7, help="Simulated time per run, fs."),
        timestep_fs: float = typer.Option(0.5, "--timestep-fs", min=0.01, max=5.0),
        friction: float = typer.Option(0.01, "--friction", min=0.0, max=10.0, help="1/fs; 0: NVE."),
        every: int = typer.Option(10, "--every", min=1, help="Steps between kept (and checked) frames."),
        out: Path = typer.Option(Path("md"), "--out", "-o", help="Output directory (md.json, trajectories.extxyz)."),
        device: str = typer.Option("cpu", "--device", help="cpu | cuda."),
    ) -> None:
        """Advance every molecule of a source together (one model call a step for all),
        flag the runs whose bonds break or atoms collide, and write the trajectories."""
        from convergent.screen.mdcommand import md_command

        res = md_command(model, source, max_molecules=max_molecules, max_atoms=max_atoms,
                         seeds=seeds, temperature_K=temperature, time_fs=time_fs,
                         timestep_fs=timestep_fs, friction_per_fs=friction, every=every, out=out,
                         device=device)
        typer.echo(res.line())
        typer.echo(f"wrote {out / 'md.json'} and {out / 'trajectories.extxyz'}")
