"""Parallel writer on a real Dask LocalCluster, index merge, and `data pack`."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from convergent.core.errors import DataError, InputError
from convergent.data.manifest import read_manifest
from convergent.data.pack import pack_directory
from convergent.data.parallel import write_parallel
from convergent.data.reader import open_dataset
from convergent.data.verify import verify_dataset
from tests.cli_exe import EXE
from tests.data.datarecords import assert_same_record, molecular_records


class MakeRecords:
    """Picklable part: produces its records on the worker."""

    def __init__(self, start: int, stop: int, dup: bool = False) -> None:
        self.start, self.stop, self.dup = start, stop, dup

    def __call__(self):
        recs = molecular_records(self.stop, seed=7)[self.start : self.stop]
        if self.dup:
            recs[0] = dict(recs[0], key="r0")
        return recs


@pytest.fixture(scope="module")
def client():
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cl, \
            Client(cl) as c:
        yield c


def test_parallel_write_on_local_cluster_merges_one_manifest(tmp_path, client):
    path = tmp_path / "par"
    parts = [MakeRecords(i, i + 50) for i in range(0, 200, 50)]
    m = write_parallel(parts, path, schema="molecular", shard_bytes=8192, client=client)
    assert m.records == 200 and read_manifest(path).records == 200
    tags = {s.name.rsplit("-", 1)[0] for s in m.shards}
    assert len(tags) == 4  # one writer per part
    ds = open_dataset(path)
    expected = molecular_records(200, seed=7)
    got = {r["key"]: r for r in ds}
    assert sorted(got) == sorted(r["key"] for r in expected)
    for r in expected:
        assert_same_record(r, got[r["key"]])
    assert verify_dataset(path).ok
    # append through the same machinery; a duplicate key across parts is refused
    write_parallel([MakeRecords(200, 230)], path, shard_bytes=8192, client=client, append=True)
    assert len(open_dataset(path)) == 230
    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(DataError, match="duplicate record key 'r0'"):
        write_parallel([MakeRecords(230, 240, dup=True)], path, client=client, append=True)
    assert sorted(p.name for p in path.iterdir()) == before  # nothing half-merged is left
    assert len(open_dataset(path)) == 230


def test_parallel_write_from_a_dask_bag(tmp_path, client):
    import dask.bag as db

    recs = molecular_records(40, seed=2)
    bag = db.from_sequence(recs, npartitions=3)
    m = write_parallel(bag, tmp_path / "bag", client=client)
    assert m.records == 40 and len(m.shards) == 3
    assert sorted(open_dataset(tmp_path / "bag").keys()) == sorted(r["key"] for r in recs)


def test_pack_any_files(tmp_path):
    src = tmp_path / "files"
    rng = np.random.default_rng(0)
    blobs = {}
    for i in range(120):
        rel = f"d{i % 5}/sub/f{i}.dat"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        blobs[rel] = rng.bytes(int(rng.integers(0, 2000)))
        (src / rel).write_bytes(blobs[rel])
    m = pack_directory(src, tmp_path / "packed", shard_bytes=16384)
    assert m.schema == "bytes" and m.records == 120 and len(m.shards) > 3
    ds = open_dataset(tmp_path / "packed")
    assert {r["key"]: r["payload"] for r in ds} == blobs
    with pytest.raises(InputError, match="inside the input"):
        pack_directory(src, src / "out")


def test_pack_in_parallel_parts(tmp_path, client):
    src = tmp_path / "files"
    (src / "a").mkdir(parents=True)
    blobs = {f"a/{i}.txt": f"content {i}".encode() * (i + 1) for i in range(30)}
    for rel, data in blobs.items():
        (src / rel).write_bytes(data)
    m = pack_directory(src, tmp_path / "out", workers=3, client=client)
    assert m.records == 30 and len({s.name.rsplit("-", 1)[0] for s in m.shards}) == 3
    assert {r["key"]: r["payload"] for r in open_dataset(tmp_path / "out")} == blobs


def test_pack_xyz_and_bad_xyz_via_cli(tmp_path):
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    src = tmp_path / "xyz"
    src.mkdir()
    for i in range(6):
        a = Atoms("H2O", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0.0 + i * 0.01]])
        a.calc = SinglePointCalculator(a, energy=-14.0 - i, forces=np.full((3, 3), 0.1 * i))
        a.info["molecule_id"] = "water"
        write(src / f"w{i}.extxyz", a, format="extxyz")
    m = pack_directory(src, tmp_path / "ds")
    assert m.schema == "molecular"
    ds = open_dataset(tmp_path / "ds")
    assert ds.schema == "molecular" and len(ds) == 6
    r = ds[ds.keys().index("w3.extxyz")]
    assert r["energy"] == pytest.approx(-17.0) and r["molecule_id"] == "water"
    np.testing.assert_allclose(r["forces"], 0.3)
    assert r["numbers"].tolist() == [1, 1, 8]
    (src / "broken.xyz").write_text("3\n\nH 0 0\n")
    out = subprocess.run([EXE, "data", "pack", str(src), str(tmp_path / "ds2")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "broken.xyz" in out.stderr.splitlines()[0]
    assert not (tmp_path / "ds2" / "manifest.json").exists()
    assert not list((tmp_path / "ds2").glob("shard-*"))
