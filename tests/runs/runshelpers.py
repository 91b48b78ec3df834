"""Helpers of the runs/tracking tests: the CLI as a subprocess and the tiny demo's settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXE = str(Path(sys.executable).parent / "convergent")
TINY = ["--set", "simulate.frames=24", "--set", "simulate.max_atoms=5",
        "--set", "checkpoint.interval=3"]


def run_cli(*args: str, timeout: int = 600, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], capture_output=True, text=True, timeout=timeout,
                          input=stdin)
