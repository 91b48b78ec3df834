"""Fixtures of the dataset-store tests."""

from __future__ import annotations

import pytest

from tests.data.datarecords import molecular_records


@pytest.fixture
def small_molecular(tmp_path):
    """A 300-record molecular dataset in ~10 shards; returns (path, records)."""
    from convergent.data.writer import DatasetWriter

    recs = molecular_records(300)
    path = tmp_path / "mol"
    with DatasetWriter(path, schema="molecular", shard_bytes=8192) as w:
        w.write_many(recs)
    return path, recs
