"""`convergent demo`: the whole converged loop on small data with embedded defaults."""

from __future__ import annotations

from pathlib import Path

import typer

from convergent.cli.common import CONFIG_ARG, RESUME_OPT, RUN_DIR_OPT, SET_OPT, config_from_cli


def register(app: typer.Typer) -> None:
    """Add the `demo` command to the root app."""

    @app.command("demo")
    def _demo(
        config: Path | None = CONFIG_ARG,
        sets: list[str] | None = SET_OPT,
        run_dir: Path | None = RUN_DIR_OPT,
        resume: bool = RESUME_OPT,
    ) -> None:
        """Simulate -> dataset -> DDP training -> screening -> report, on small data."""
        from convergent.demo import DEMO_PRESET, run_demo

        cfg = config_from_cli(config, sets, DEMO_PRESET)
        run_demo(cfg, run_dir=run_dir, resume=resume)
