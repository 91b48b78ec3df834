"""Where the benchmarks keep things, and how a bench starts one of its modules in a child.

``RESULTS`` (bench/results/) holds the JSON and figures a bench writes (tracked); ``DATA``
(bench/data/) the datasets and caches it generates (git-ignored). A child process runs a
bench module as ``python -m bench.<area>.<name>`` (``module_argv``) with :func:`child_env`,
which puts the checkout's root and src/ on its ``PYTHONPATH``: the child imports ``bench``
and ``convergent`` from any working directory, also under a peer's interpreter (the
data-read bench's venv) that has no convergent installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
DATA = REPO / "bench" / "data"


def module_argv(module: str, python: str | None = None) -> list[str]:
    """``[python, "-m", module]``: the start of a command that runs a bench module."""
    return [python or sys.executable, "-m", module]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout's root and src/ first on ``PYTHONPATH``
    (and ``extra`` set)."""
    old = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join([str(REPO), str(REPO / "src"), *filter(None, old.split(os.pathsep))])
    return {**os.environ, "PYTHONPATH": path, **extra}
