"""Write then read round-trips (hypothesis), append/flush checkpoints, split and subsets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from convergent.core.errors import DataError
from convergent.data.manifest import read_manifest
from convergent.data.reader import open_dataset, split_by_molecule
from convergent.data.writer import DatasetWriter, write_subset
from tests.data.datarecords import assert_same_record, bytes_records, molecular_records

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def mol_record(draw, i):
    n = draw(st.integers(0, 6))
    return {
        "key": f"k{i}-" + draw(st.text(min_size=0, max_size=8)),
        "molecule_id": draw(st.text(max_size=6)),
        "numbers": draw(hnp.arrays(np.int64, n, elements=st.integers(0, 118))),
        "positions": draw(hnp.arrays(np.float64, (n, 3), elements=finite)),
        "energy": draw(finite),
        "forces": draw(hnp.arrays(np.float64, (n, 3), elements=finite)),
        "cell": draw(hnp.arrays(np.float64, (3, 3), elements=finite)),
        "pbc": np.array(draw(st.lists(st.booleans(), min_size=3, max_size=3))),
        "charge": draw(st.integers(-3, 3)),
        "multiplicity": draw(st.integers(1, 4)),
        "meta": draw(st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=5), max_size=3)),
    }


@st.composite
def mol_records(draw):
    n = draw(st.integers(0, 25))
    return [draw(mol_record(i)) for i in range(n)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recs=mol_records(), compression=st.sampled_from(["none", "zstd"]),
       shard_bytes=st.sampled_from([4096, 10_000, 2**20]))
def test_molecular_roundtrip(tmp_path_factory, recs, compression, shard_bytes):
    path = tmp_path_factory.mktemp("rt") / "ds"
    with DatasetWriter(path, schema="molecular", shard_bytes=shard_bytes, compression=compression) as w:
        w.write_many(recs)
    ds = open_dataset(path)
    assert len(ds) == len(recs) == ds.manifest.records
    assert ds.keys() == [r["key"] for r in recs]
    for a, b in zip(recs, ds, strict=True):
        assert_same_record(a, b)
    np.testing.assert_array_equal(ds.column("energy"), np.array([r["energy"] for r in recs], float).reshape(-1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payloads=st.lists(st.binary(max_size=3000), max_size=30),
       inline=st.sampled_from([0, 16, 256]), compression=st.sampled_from(["none", "zstd"]))
def test_bytes_roundtrip(tmp_path_factory, payloads, inline, compression):
    path = tmp_path_factory.mktemp("rt") / "ds"
    recs = [{"key": f"f/{i}.bin", "payload": p} for i, p in enumerate(payloads)]
    with DatasetWriter(path, schema="bytes", shard_bytes=8192, compression=compression,
                       inline_bytes=inline) as w:
        w.write_many(recs)
    ds = open_dataset(path)
    assert [ds[i]["payload"] for i in range(len(ds))] == payloads
    assert [ds[i]["key"] for i in range(len(ds))] == [r["key"] for r in recs]
    assert ds.column("size").tolist() == [len(p) for p in payloads]


def test_flush_is_a_durable_checkpoint_and_append_adds(tmp_path):
    recs = molecular_records(60)
    path = tmp_path / "ds"
    w = DatasetWriter(path, schema="molecular", shard_bytes=2**20)
    w.write_many(recs[:10])
    w.flush()  # a small shard is sealed and committed
    assert len(open_dataset(path)) == 10
    w.write_many(recs[10:25])
    # not flushed yet: readers see the last commit only
    assert len(open_dataset(path)) == 10
    w.close()
    assert len(open_dataset(path)) == 25
    with DatasetWriter(path, append=True) as w2:
        w2.write_many(recs[25:])
    ds = open_dataset(path)
    assert len(ds) == 60 and len(ds.manifest.shards) == 3
    for a, b in zip(recs, ds, strict=True):
        assert_same_record(a, b)


def test_existing_dataset_is_not_clobbered_and_duplicate_keys_rejected(tmp_path):
    recs = molecular_records(5)
    path = tmp_path / "ds"
    with DatasetWriter(path) as w:
        w.write_many(recs)
    with pytest.raises(DataError, match="already exists"):
        DatasetWriter(path)
    with pytest.raises(DataError, match="duplicate record key 'r1'"):
        with DatasetWriter(path, append=True) as w:
            w.write(recs[1])
    with pytest.raises(DataError, match="cannot append 'bytes'"):
        DatasetWriter(path, schema="bytes", append=True)
    assert len(open_dataset(path)) == 5
    old = {s.name for s in read_manifest(path).shards}
    with DatasetWriter(path, overwrite=True) as w:
        w.write_many(recs[:2])
    assert len(open_dataset(path)) == 2
    assert not any((path / n).exists() for n in old)


def test_error_in_with_block_commits_records_so_far(tmp_path):
    recs = molecular_records(8)
    path = tmp_path / "ds"
    with pytest.raises(RuntimeError):
        with DatasetWriter(path) as w:
            w.write_many(recs[:5])
            raise RuntimeError("calculation crashed")
    assert open_dataset(path).keys() == [r["key"] for r in recs[:5]]


def test_rollback_on_error_when_asked(tmp_path):
    recs = molecular_records(8)
    path = tmp_path / "ds"
    with DatasetWriter(path) as w:
        w.write_many(recs[:3])
    with pytest.raises(RuntimeError):
        with DatasetWriter(path, append=True, commit_on_error=False, shard_bytes=4096) as w:
            w.write_many(recs[3:])
            raise RuntimeError
    assert len(open_dataset(path)) == 3
    assert len(list(path.glob("shard-*"))) == len(read_manifest(path).shards)


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"key": "a", "numbers": [1, 2], "positions": [[0, 0, 0]], "energy": 0.0}, "positions"),
        ({"key": "", "numbers": [1]}, "key"),
        ({"key": "a", "numbers": [300], "positions": [[0, 0, 0]], "energy": 0.0}, "0..255"),
        ({"key": "a", "numbers": [1], "positions": [[0, 0, 0]], "energy": 0.0, "meta": {"x": object()}}, "meta"),
    ],
)
def test_malformed_records_are_clear_errors(tmp_path, bad, needle):
    with pytest.raises(DataError, match=needle):
        with DatasetWriter(tmp_path / "ds", commit_on_error=False) as w:
            w.write(bad)


def test_bytes_schema_inlines_small_payloads(tmp_path):
    recs = bytes_records(50, max_size=600)
    with DatasetWriter(tmp_path / "b", schema="bytes", inline_bytes=256) as w:
        w.write_many(recs)
    ds = open_dataset(tmp_path / "b")
    inl = ds.shards[0].meta.index["inlined"].astype(bool)
    assert inl.tolist() == [len(r["payload"]) <= 256 for r in recs]
    assert [ds[i]["payload"] for i in range(50)] == [r["payload"] for r in recs]


def test_split_by_molecule_and_write_subset(small_molecular, tmp_path):
    path, recs = small_molecular
    ds = open_dataset(path)
    tr, va = split_by_molecule(ds, val_fraction=0.3, seed=1)
    assert len(tr) + len(va) == len(ds) and not set(tr) & set(va)
    mol = ds.molecule_ids()
    assert not {mol[i] for i in tr} & {mol[i] for i in va}
    assert len({mol[i] for i in va}) == 2  # round(0.3 * 7)
    tr2, va2 = split_by_molecule(ds, val_fraction=0.3, seed=1)
    assert np.array_equal(tr, tr2) and np.array_equal(va, va2)
    write_subset(ds, va, tmp_path / "val")
    val = open_dataset(tmp_path / "val")
    assert val.keys() == [recs[i]["key"] for i in va]
    assert_same_record(recs[int(va[0])], val[0])
