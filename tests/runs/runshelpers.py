"""Helpers of the runs/tracking tests: the CLI as a subprocess and the tiny demo's settings."""

from __future__ import annotations

import os
import subprocess

from tests.cli_exe import EXE

TINY = ["--set", "simulate.frames=24", "--set", "simulate.max_atoms=5",
        "--set", "checkpoint.interval=3",
        "--set", "screen.md_check.seeds=1", "--set", "screen.md_check.time_fs=20"]


def run_cli(*args: str, timeout: int = 600, stdin: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``convergent ARGS`` in a subprocess (``env`` added to this process's environment)."""
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout,
                          input=stdin, env={**os.environ, **(env or {})})
