"""Training reads its shards through the node-local cache tier (``data.cache_dir``).

Real runs (torchrun, gloo): with the cache the losses are bit-for-bit those of the
run that reads the dataset in place (same records, same order), verified copies of the
shards appear in the cache directory, and a 2-rank DDP run through the cache matches
the single-process run (the usual cross-world-size tolerance).
"""

from __future__ import annotations

import math

import pytest

from convergent.data.manifest import read_manifest
from tests.train.trainhelpers import mol_overrides, run_training, val_records

SHORT = ["train.steps=4", "checkpoint.interval=2", "train.val_every=2"]


def _shard_copies(cache_dir):
    return sorted(p.name for p in cache_dir.rglob("*") if p.is_file() and not p.name.startswith("."))


@pytest.fixture(scope="module")
def in_place(moldata, tmp_path_factory):
    over = mol_overrides(moldata, "parallel.strategy=single", *SHORT)
    _, recs, _ = run_training(tmp_path_factory.mktemp("inplace"), over, 1, "ref")
    return recs


def test_single_run_through_cache_equals_in_place(moldata, in_place, tmp_path):
    cache = tmp_path / "node-cache"
    over = mol_overrides(moldata, "parallel.strategy=single", *SHORT, f"data.cache_dir={cache}")
    _, recs, run = run_training(tmp_path, over, 1, "cached")
    assert [r.loss for r in recs] == [r.loss for r in in_place]
    vals = val_records(run)
    assert vals
    # every shard of the train and val datasets was copied into the cache
    names = [s.name for d in moldata for s in read_manifest(d).shards]
    assert sorted(names) == _shard_copies(cache)


@pytest.mark.slow
def test_ddp_through_cache_matches_single(moldata, in_place, tmp_path):
    cache = tmp_path / "node-cache"
    over = mol_overrides(moldata, "parallel.strategy=ddp", *SHORT, f"data.cache_dir={cache}")
    _, recs, _ = run_training(tmp_path, over, 2, "ddp")
    for a, b in zip(recs, in_place, strict=True):
        assert math.isclose(a.loss, b.loss, rel_tol=1e-4)
    assert _shard_copies(cache)
