"""`convergent report RUN_DIR`: rebuild the report (markdown + PNG plots) of a run."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the `report` command to the root app."""

    @app.command("report")
    def _report(run_dir: Path = typer.Argument(..., help="A run directory.")) -> None:
        """Rebuild runs/<name>/report/report.md and its plots from the run's files."""
        from convergent.monitor.report import build_report

        path = build_report(run_dir)
        typer.echo(f"report: {path}")
