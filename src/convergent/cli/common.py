"""Options and helpers shared by the stage commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from convergent.config import ConvergentConfig, load_config

CONFIG_ARG = typer.Argument(None, help="YAML config file (defaults work without one).")
SET_OPT = typer.Option(
    None, "--set", "-s", help="Override a config value: section.key=value (repeatable)."
)
RUN_DIR_OPT = typer.Option(None, "--run-dir", help="Run directory (default runs/<run.name>, else runs/<command>).")
RESUME_OPT = typer.Option(False, "--resume", help="Continue an existing run directory.")


def config_from_cli(config: Path | None, sets: list[str] | None,
                    preset: dict[str, Any] | None = None) -> ConvergentConfig:
    """Load the config named on the command line with its ``--set`` overrides (over the
    command's ``preset`` defaults, if it has its own)."""
    return load_config(config, sets, preset)
