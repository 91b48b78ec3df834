"""``data export --to mds``: the files follow the MDS v2 layout, decoded here from the
format description (independently of the writer), and the real mosaicml-streaming 0.13.0
reader reads them (slow: it runs in the benchmark's peers venv, since streaming's pins
conflict with this environment)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import xxhash

from bench.lib.paths import child_env
from convergent.core.errors import DataError
from convergent.data.export import export_dataset
from convergent.data.writer import DatasetWriter
from tests.data.datarecords import bytes_records, molecular_records

ROOT = Path(__file__).resolve().parents[2]
_SHAPE = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}


def _decode(enc: str, data: bytes):
    if enc == "str":
        return data.decode()
    if enc == "bytes":
        return data
    if enc == "int":
        return struct.unpack("<q", data)[0]
    if enc == "float64":
        return struct.unpack("<d", data)[0]
    if enc == "json":
        return json.loads(data)
    assert enc.startswith("ndarray:")
    ndim, k = data[0] >> 2, data[0] & 3
    w = 2**k
    shape = np.frombuffer(data, _SHAPE[k], ndim, 1)
    return np.frombuffer(data, enc.split(":")[1], offset=1 + ndim * w).reshape(shape)


def read_mds(root: Path) -> list[dict]:
    """Every sample of an MDS v2 directory, parsed from index.json and the shard bytes."""
    index = json.loads((root / "index.json").read_text())
    assert index["version"] == 2
    out = []
    for sh in index["shards"]:
        raw = (root / sh["raw_data"]["basename"]).read_bytes()
        assert len(raw) == sh["raw_data"]["bytes"] and sh["zip_data"] is None
        assert sh["raw_data"]["hashes"]["xxh3_64"] == xxhash.xxh3_64_hexdigest(raw)
        (n,) = struct.unpack_from("<I", raw, 0)
        assert n == sh["samples"]
        offs = np.frombuffer(raw, "<u4", n + 1, 4).astype(np.int64)
        conf = json.loads(raw[4 + 4 * (n + 1) : offs[0]])
        assert conf == {k: sh[k] for k in conf} and conf["format"] == "mds" and offs[-1] == len(raw)
        names, encs, sizes = conf["column_names"], conf["column_encodings"], conf["column_sizes"]
        assert names == sorted(names)
        nvar = sum(s is None for s in sizes)
        for i in range(n):
            a = int(offs[i])
            var = iter(struct.unpack_from(f"<{nvar}I", raw, a))
            a += 4 * nvar
            rec = {}
            for name, enc, size in zip(names, encs, sizes, strict=True):
                ln = next(var) if size is None else size
                rec[name] = _decode(enc, raw[a : a + ln])
                a += ln
            assert a == offs[i + 1]
            out.append(rec)
    return out


def test_mds_bytes_layout_and_records(tmp_path):
    recs = bytes_records(200, max_size=6000)
    with DatasetWriter(tmp_path / "b", schema="bytes") as w:
        w.write_many(recs)
    assert export_dataset(tmp_path / "b", tmp_path / "mds", "mds", shard_bytes=60_000) == 200
    shards = json.loads((tmp_path / "mds" / "index.json").read_text())["shards"]
    assert len(shards) > 3 and all(s["raw_data"]["bytes"] <= 60_000 for s in shards)
    assert read_mds(tmp_path / "mds") == recs
    assert not [p for p in os.listdir(tmp_path / "mds") if p.endswith(".tmp")]


def test_mds_molecular_records(small_molecular, tmp_path):
    path, recs = small_molecular
    export_dataset(path, tmp_path / "mds", "mds")
    got = read_mds(tmp_path / "mds")
    assert len(got) == len(recs)
    for a, b in zip(recs, got, strict=True):
        for k in ("numbers", "positions", "forces", "cell"):
            np.testing.assert_array_equal(np.asarray(a[k]), b[k], err_msg=k)
        assert b["numbers"].dtype == np.int64 and b["pbc"] == list(map(bool, a["pbc"]))
        for k in ("key", "molecule_id", "energy", "charge", "multiplicity", "meta"):
            assert b[k] == a[k], k


def test_mds_rejects_empty_molecule(tmp_path):
    rec = molecular_records(1)[0]
    rec.update(numbers=np.zeros(0, int), positions=np.zeros((0, 3)), forces=np.zeros((0, 3)))
    with DatasetWriter(tmp_path / "m", schema="molecular") as w:
        w.write(rec)
    with pytest.raises(DataError, match="record 'r0' column .*cannot store an array"):
        export_dataset(tmp_path / "m", tmp_path / "mds", "mds")
    assert not (tmp_path / "mds" / "index.json").exists()


_REAL_READER = """
from bench.dataio import read as data_read
data_read.install_torchvision_stub()
import json, streaming
ds = streaming.LocalDataset({mds!r})
sd = streaming.StreamingDataset(local={mds!r}, shuffle=True, shuffle_seed=1, batch_size=4,
                                validate_hash="xxh3_64")
print(json.dumps({{"version": streaming.__version__,
                  "records": [[ds[i]["key"], ds[i]["payload"].hex()] for i in range(len(ds))],
                  "streamed": sorted(x["key"] for x in sd)}}))
"""


@pytest.fixture(scope="session")
def peers_python(tmp_path_factory) -> str:
    """The benchmark's peers venv (made with ``python -m bench.dataio.read --setup-peers`` if absent)."""
    have = ROOT / "bench" / "data" / "peers-venv" / "bin" / "python"
    if have.exists():
        return str(have)
    from bench.dataio import read as data_read

    return data_read.setup_peers(tmp_path_factory.mktemp("peers") / "venv")


@pytest.mark.slow
def test_mds_read_by_real_streaming(tmp_path, peers_python):
    recs = bytes_records(120, max_size=5000)
    with DatasetWriter(tmp_path / "b", schema="bytes") as w:
        w.write_many(recs)
    export_dataset(tmp_path / "b", tmp_path / "mds", "mds", shard_bytes=40_000)
    code = _REAL_READER.format(mds=str(tmp_path / "mds"))
    out = subprocess.run([peers_python, "-c", code], capture_output=True, text=True, timeout=600,
                         env=child_env())  # imports bench and convergent
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["version"] == "0.13.0"
    assert got["records"] == [[r["key"], r["payload"].hex()] for r in recs]
    assert got["streamed"] == sorted(r["key"] for r in recs)
