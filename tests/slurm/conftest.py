"""A real two-node Slurm for these tests (scripts/slurm_cluster.py), started once per session.

Where Slurm is not installed, or the process may not start its daemons (not root), every
test here is skipped and pytest's summary says why.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _fixture_module():
    spec = importlib.util.spec_from_file_location("slurm_cluster", ROOT / "scripts" / "slurm_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("slurm_cluster", mod)
    spec.loader.exec_module(mod)
    return mod


slurm_cluster = _fixture_module()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The running fixture (``SLURM_CONF`` set for this process and its children)."""
    reason = slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    # its own ports, so a fixture started by hand (scripts/slurm_cluster.py) can keep running,
    # and one per pytest-xdist worker (gw0, gw1, ...: make test runs files side by side)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    fx = slurm_cluster.SlurmFixture(tmp_path_factory.mktemp("slurm"), port=16917 + 40 * worker)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(fx.conf))
        try:
            fx.start()
            yield fx
        finally:
            fx.stop()

