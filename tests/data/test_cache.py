"""Node-local cache tier: budget, checksum on copy, eviction by next use, only-copy safety."""

from __future__ import annotations

import shutil

import pytest

from convergent.core.errors import DataError
from convergent.data.cache import ShardCache
from convergent.data.manifest import read_manifest
from convergent.data.reader import open_dataset
from convergent.data.writer import DatasetWriter
from tests.data.datarecords import molecular_records


@pytest.fixture
def remote(tmp_path):
    """A 'remote' dataset of ~10 shards of a few KiB."""
    path = tmp_path / "pfs" / "ds"
    with DatasetWriter(path, shard_bytes=6000, compression="none") as w:
        w.write_many(molecular_records(120, max_atoms=6))
    return path


def test_reads_through_cache_within_budget(remote, tmp_path):
    m = read_manifest(remote)
    biggest = max(s.bytes for s in m.shards)
    budget = 3 * biggest
    cache = ShardCache(tmp_path / "local", budget_bytes=budget)
    ds = open_dataset(remote, cache=cache)
    keys = [r["key"] for r in ds]
    assert keys == open_dataset(remote).keys()
    assert cache.used_bytes() <= budget
    assert cache.stats["evicted"] > 0 and cache.stats["copied_bytes"] >= m.bytes
    for s in m.shards:  # the remote copy is complete and untouched
        assert (remote / s.name).stat().st_size == s.bytes


def test_checksum_on_copy_refuses_a_corrupted_source(remote, tmp_path):
    info = read_manifest(remote).shards[2]
    data = bytearray((remote / info.name).read_bytes())
    data[len(data) // 2] ^= 0x10
    (remote / info.name).write_bytes(bytes(data))
    cache = ShardCache(tmp_path / "local", budget_bytes=2**20)
    with pytest.raises(DataError, match=f"shard {info.name}: checksum mismatch on copy"):
        cache.get(info, remote)
    assert not cache.local_path(info, remote).exists()
    assert not list(cache.local_path(info, remote).parent.glob("*.tmp"))


def test_eviction_by_next_use(remote, tmp_path):
    shards = read_manifest(remote).shards[:4]
    size = max(s.bytes for s in shards)
    cache = ShardCache(tmp_path / "local", budget_bytes=3 * size)
    for s in shards[:3]:
        cache.get(s, remote)
    # next uses: shard 3 now, then 0, then 2; shard 1 is needed last -> it goes
    names = [s.name for s in shards]
    cache.plan(remote, [names[3], names[0], names[2], names[1]])
    cache.get(shards[3], remote)
    present = {s.name for s in shards if cache.local_path(s, remote).exists()}
    assert present == {names[0], names[2], names[3]}
    # without a plan entry the least recently used goes
    cache.plan(remote, [])
    cache.get(shards[0], remote)  # touch 0
    cache.get(shards[1], remote)
    present = {s.name for s in shards if cache.local_path(s, remote).exists()}
    assert names[0] in present and names[1] in present and len(present) == 3


def test_never_deletes_the_only_copy(remote, tmp_path):
    shards = read_manifest(remote).shards
    size = max(s.bytes for s in shards)
    cache = ShardCache(tmp_path / "local", budget_bytes=2 * size)
    cache.get(shards[0], remote)
    cache.get(shards[1], remote)
    # the remote copies of the cached shards disappear: the cached ones are now the only ones
    saved = tmp_path / "saved"
    saved.mkdir()
    for s in shards[:2]:
        shutil.move(remote / s.name, saved / s.name)
    cache.get(shards[2], remote)  # no room can be made: read in place, keep the only copies
    assert all(cache.local_path(s, remote).exists() for s in shards[:2])
    assert cache.stats["bypass"] == 1
    assert cache.clear() == 0 and all(cache.local_path(s, remote).exists() for s in shards[:2])


def test_dataset_inside_cache_dir_is_read_in_place(tmp_path):
    cache_dir = tmp_path / "local"
    path = cache_dir / "ds"
    with DatasetWriter(path, shard_bytes=6000) as w:
        w.write_many(molecular_records(40))
    cache = ShardCache(cache_dir, budget_bytes=7000)
    ds = open_dataset(path, cache=cache)
    assert len([r for r in ds]) == 40
    cache.clear()
    assert len(open_dataset(path)) == 40 and verify_ok(path)


def verify_ok(path) -> bool:
    from convergent.data.verify import verify_dataset

    return verify_dataset(path).ok

