"""Fixtures of the analytics tests: one 2-worker Dask cluster for the module, datasets."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(scope="session")
def client():
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=logging.CRITICAL) as cl, Client(cl) as c:
        yield c


@pytest.fixture(scope="session")
def demo_like(tmp_path_factory):
    """The training tests' EMT dataset (G2 molecules, built like the demo's labels)."""
    from tests.train.moldataset import make_dataset

    train, _ = make_dataset(tmp_path_factory.mktemp("demo"), n_train=96, n_val=24)
    return train
