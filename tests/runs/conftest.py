"""Two tiny but real demo runs with different settings (the second tracked in MLflow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runs.runshelpers import TINY, run_cli


@pytest.fixture(scope="session")
def demo_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<root>/a`` (6 steps, lr 1e-3) and ``<root>/b`` (8 steps, lr 3e-3, MLflow on)."""
    root = tmp_path_factory.mktemp("runs")
    a = run_cli("demo", "--run-dir", str(root / "a"), *TINY, "--set", "train.steps=6")
    assert a.returncode == 0, a.stderr[-3000:]
    tracked = ["--set", "tracking.mlflow=true"]
    try:
        import mlflow  # noqa: F401
    except ImportError:
        tracked = []
    b = run_cli("demo", "--run-dir", str(root / "b"), *TINY, "--set", "train.steps=8",
                "--set", "train.lr=3e-3", *tracked)
    assert b.returncode == 0, b.stderr[-3000:]
    return root
