"""Helpers of the Slurm tests."""

from __future__ import annotations

import subprocess


def squeue_ids(name: str | None = None) -> list[str]:
    """Job ids in the queue (optionally only those with job name ``name``)."""
    cmd = ["squeue", "-h", "-o", "%i"] + (["-n", name] if name else [])
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
