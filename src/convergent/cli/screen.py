"""`convergent screen`: predict a dataset with a model ensemble, pick the most uncertain."""

from __future__ import annotations

from pathlib import Path

import typer

from convergent.cli.common import CONFIG_ARG, SET_OPT, config_from_cli


def register(app: typer.Typer) -> None:
    """Add the `screen` command to the root app."""

    @app.command("screen")
    def _cmd(
        config: Path | None = CONFIG_ARG,
        sets: list[str] | None = SET_OPT,
        model: list[str] | None = typer.Option(
            None, "--model", "-m", help="Saved model directory; repeat for an ensemble."
        ),
        data: str | None = typer.Option(
            None, "--data", "-d", help="Dataset directory or structure file (extxyz, xyz...)."
        ),
        out: Path | None = typer.Option(None, "--out", "-o", help="Output directory."),
        select: int | None = typer.Option(None, "--select", "-k", min=0, help="How many to pick."),
        quantize: str | None = typer.Option(
            None, "--quantize", help="int8 (weight-only) or int8-dynamic; sets screen.quantize."
        ),
    ) -> None:
        """Predict energies/forces with a surrogate ensemble; select uncertain candidates."""
        from rich.console import Console

        from convergent.screen.command import screen_command

        console = Console(stderr=True)
        screen_command(
            config_from_cli(config, [*(sets or []), f"screen.quantize={quantize}"] if quantize else sets), typer.echo,
            lambda text: console.print(f"[yellow]{text}[/yellow]"),
            models=model, data=data, out=out, select=select, status=console.status,
        )
