"""Fixtures of the simulation tests: one real 2-worker LocalCluster shared by the module."""

from __future__ import annotations

import os

import pytest

# In-process calculations (tblite, PySCF) in these tests: one OpenMP thread, like a worker.
# Spinning OpenMP teams on a shared 2-core machine are many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from convergent.cluster.config import ClusterConfig


@pytest.fixture(scope="session")
def sim_client():
    """A real Dask LocalCluster (2 single-threaded worker processes) built by our factory."""
    from convergent.cluster.pool import dask_client

    with dask_client(ClusterConfig(n_workers=2)) as client:
        client.wait_for_workers(2, timeout=120)
        yield client
