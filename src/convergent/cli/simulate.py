"""`convergent simulate`: thin CLI over the stage API (placeholder until the simulation campaign issue lands)."""

from __future__ import annotations

from pathlib import Path

import typer

from convergent.cli.common import CONFIG_ARG, SET_OPT, config_from_cli, not_landed


def register(app: typer.Typer) -> None:
    """Add the `simulate` command to the root app."""

    @app.command("simulate")
    def _cmd(config: Path | None = CONFIG_ARG, sets: list[str] | None = SET_OPT) -> None:
        """simulation campaign (not built yet)."""
        config_from_cli(config, sets)
        not_landed("simulate", "simulation campaign")
