"""Bad input: flipped bytes, truncated shards, manifest mismatch, unknown versions."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from convergent.core.errors import DataError
from convergent.data.manifest import read_manifest
from convergent.data.reader import open_dataset
from convergent.data.verify import verify_dataset
from convergent.data.writer import DatasetWriter
from tests.cli_exe import EXE
from tests.data.datarecords import bytes_records, molecular_records


def read_all(path) -> None:
    ds = open_dataset(path)
    for _ in ds:
        pass
    ds.close()


@pytest.mark.parametrize("schema", ["molecular", "bytes"])
def test_every_flipped_byte_is_detected_by_verify_and_reader(tmp_path, schema):
    src = tmp_path / "good"
    recs = molecular_records(12, max_atoms=5) if schema == "molecular" else bytes_records(30, max_size=700)
    with DatasetWriter(src, schema=schema, shard_bytes=2**20, compression="zstd", inline_bytes=64) as w:
        w.write_many(recs)
    name = read_manifest(src).shards[0].name
    pristine = (src / name).read_bytes()
    rng = np.random.default_rng(0)
    positions = sorted(set(rng.integers(0, len(pristine), 60).tolist()) | {0, 9, 15, 16, len(pristine) - 1,
                                                                              len(pristine) - 20})
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    for pos in positions:
        flipped = bytearray(pristine)
        flipped[pos] ^= int(rng.integers(1, 256))
        (bad / name).write_bytes(bytes(flipped))
        rep = verify_dataset(bad)
        assert not rep.ok and name in rep.problems[0], pos
        with pytest.raises(DataError, match=name):
            read_all(bad)
    (bad / name).write_bytes(pristine)
    assert verify_dataset(bad).ok
    read_all(bad)


def test_frame_damage_is_located(tmp_path):
    path = tmp_path / "ds"
    with DatasetWriter(path, compression="none") as w:
        w.write_many(molecular_records(10))
    ds = open_dataset(path)
    off = int(ds.shards[0].meta.index["offsets"][4]) + 40
    name = ds.manifest.shards[0].name
    data = bytearray((path / name).read_bytes())
    data[off] ^= 0xFF
    (path / name).write_bytes(bytes(data))
    rep = verify_dataset(path)
    assert any("record 4 at offset" in p for p in rep.problems)
    ds = open_dataset(path)
    assert ds[3]["key"] == "r3"
    with pytest.raises(DataError, match=rf"{name} record 4 at offset \d+: frame checksum mismatch"):
        ds[4]


def test_truncated_shard(tmp_path):
    path = tmp_path / "ds"
    with DatasetWriter(path) as w:
        w.write_many(molecular_records(20))
    name = read_manifest(path).shards[0].name
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=rf"shard {name}: size .*\(truncated\)"):
        read_all(path)
    assert "truncated" in verify_dataset(path).problems[0]


def test_manifest_mismatch_and_versions(tmp_path):
    path = tmp_path / "ds"
    with DatasetWriter(path, shard_bytes=4096) as w:
        w.write_many(molecular_records(30))
    mpath = path / "manifest.json"
    good = json.loads(mpath.read_text())
    m = json.loads(mpath.read_text())
    m["shards"][0]["records"] += 1
    m["records"] += 1
    mpath.write_text(json.dumps(m))
    with pytest.raises(DataError, match="holds .* records, manifest says"):
        read_all(path)
    m = dict(good, schema_version=99)
    mpath.write_text(json.dumps(m))
    with pytest.raises(DataError, match="unknown schema version 99"):
        open_dataset(path)
    m = dict(good, format_version=7)
    mpath.write_text(json.dumps(m))
    with pytest.raises(DataError, match="unknown dataset format version 7"):
        open_dataset(path)
    mpath.write_text("{not json")
    with pytest.raises(DataError, match=r"manifest\.json:1: not valid JSON \(Expecting property name"):
        open_dataset(path)
    mpath.unlink()
    with pytest.raises(DataError, match="no manifest.json"):
        open_dataset(path)


def test_half_written_dataset_is_not_readable_as_complete(tmp_path):
    path = tmp_path / "ds"
    w = DatasetWriter(path, shard_bytes=4096)
    w.write_many(molecular_records(40))  # several shards sealed, no manifest yet
    assert list(path.glob("shard-*.cvs"))
    with pytest.raises(DataError, match="no manifest.json"):
        open_dataset(path)
    w.close()
    assert len(open_dataset(path)) == 40


def test_cli_verify_exit_2_names_the_shard(tmp_path):
    path = tmp_path / "ds"
    with DatasetWriter(path) as w:
        w.write_many(molecular_records(10))
    out = subprocess.run([EXE, "data", "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok: 1 shards, 10 records")
    name = read_manifest(path).shards[0].name
    data = bytearray((path / name).read_bytes())
    data[100] ^= 1
    (path / name).write_bytes(bytes(data))
    out = subprocess.run([EXE, "data", "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    first = out.stderr.splitlines()[0]
    assert first.startswith("error: ") and name in first and "offset" in out.stderr
    assert "Traceback" not in out.stderr


def test_batch_decode_fast_path_detects_every_flipped_byte(tmp_path):
    """Uncompressed bytes shards are decoded in batches (``ShardReader.records`` through
    records.decode_plain_bytes_frames); that path returns the same records and misses no
    damage."""
    from convergent.data.records import decode_plain_bytes_frames

    src = tmp_path / "good"
    recs = bytes_records(60, max_size=900)
    with DatasetWriter(src, schema="bytes", shard_bytes=2**20, compression="none", inline_bytes=64) as w:
        w.write_many(recs)
    ds = open_dataset(src)
    sh = ds.shards[0]
    sh.records([0])  # maps the shard
    fast = decode_plain_bytes_frames(sh._view, sh._offsets_np, list(range(len(recs))))
    framed = [i for i, r in enumerate(recs) if len(r["payload"]) > 64]
    assert framed and all(fast[i] == recs[i] for i in framed)  # the fast path did the work
    assert all(fast[i] is None for i in range(len(recs)) if i not in framed)  # inlined ones
    ds.close()

    def stream(path) -> list:  # every record, each shard's in a shuffled order, in batches
        out = []
        for sh in open_dataset(path).shards:
            local = np.random.default_rng(3).permutation(sh.info.records).tolist()
            for k in range(0, len(local), 16):
                out.extend(sh.records(local[k : k + 16]))
        return out

    assert sorted(stream(src), key=lambda r: r["key"]) == sorted(recs, key=lambda r: r["key"])
    name = read_manifest(src).shards[0].name
    pristine = (src / name).read_bytes()
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    rng = np.random.default_rng(1)
    for pos in sorted(set(rng.integers(0, len(pristine), 80).tolist()) | {16, 17, 36, 40}):
        flipped = bytearray(pristine)
        flipped[pos] ^= int(rng.integers(1, 256))
        (bad / name).write_bytes(bytes(flipped))
        with pytest.raises(DataError, match=name):
            stream(bad)
