"""The data-read benchmark's reference streaming reader (bench/dataio/stream.py, order.py):
exactly-once over ranks x workers, equal counts, exact resume, mixing, the node-local
cache's prefetch under DataLoader workers."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.dataio.stream import MixedStreamingDataset, StreamingDataset, StreamingLoader
from convergent.core.errors import DataError
from convergent.data.reader import open_dataset
from convergent.data.writer import DatasetWriter
from tests.data.datarecords import molecular_records


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory):
    """157 records in ~12 shards (uneven sizes)."""
    path = tmp_path_factory.mktemp("stream") / "ds"
    with DatasetWriter(path, schema="molecular", shard_bytes=4096, compression="none") as w:
        w.write_many(molecular_records(157, max_atoms=4))
    return path


def rank_streams(path, world, workers, batch, drop_last, seed=3, epoch=0, state=None, block=16, indices=None):
    """For each rank: the sequence its DataLoader would return (workers' chunks interleaved)."""
    out = []
    for r in range(world):
        sd = StreamingDataset(path, indices, seed=seed, rank=r, world_size=world, drop_last=drop_last,
                              batch_size=batch, block_size=block)
        sd.set_epoch(epoch)
        if state is not None:
            sd.load_state_dict(state)
        k = max(1, workers)
        per_worker = [sd.worker_ids(w, k).tolist() for w in range(k)]
        # a DataLoader takes one batch from each worker in turn
        seq, cursors, w = [], [0] * k, 0
        while any(cursors[i] < len(per_worker[i]) for i in range(k)):
            if cursors[w] < len(per_worker[w]):
                seq.extend(per_worker[w][cursors[w] : cursors[w] + batch])
                cursors[w] += batch
            w = (w + 1) % k
        assert len(seq) == len(sd)
        assert seq == sd.rank_ids().tolist()  # worker chunks re-interleave into the rank order
        out.append(seq)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 8), workers=st.integers(0, 4), batch=st.integers(1, 9),
       drop_last=st.booleans(), epoch=st.integers(0, 3))
def test_every_record_once_per_epoch_across_ranks_and_workers(ds_path, world, workers, batch, drop_last, epoch):
    streams = rank_streams(ds_path, world, workers, batch, drop_last, epoch=epoch)
    n = 157
    lens = {len(s) for s in streams}
    assert len(lens) == 1  # equal per-rank counts: DDP never hangs
    counts = collections.Counter(i for s in streams for i in s)
    if drop_last:
        assert lens == {n // world} and all(c == 1 for c in counts.values())
        assert len(counts) == (n // world) * world
    else:
        assert lens == {-(-n // world)}
        assert set(counts) == set(range(n))
        assert sum(c - 1 for c in counts.values()) == -(-n // world) * world - n  # explicit pad only


def test_shuffle_is_a_function_of_seed_and_epoch_with_shard_locality(ds_path):
    a = StreamingDataset(ds_path, seed=1, rank=0, world_size=1, block_size=16)
    b = StreamingDataset(ds_path, seed=1, rank=0, world_size=1, block_size=16)
    e0 = a.rank_ids().tolist()
    assert e0 == b.rank_ids().tolist() and sorted(e0) == list(range(157))
    a.set_epoch(1)
    assert a.rank_ids().tolist() != e0
    c = StreamingDataset(ds_path, seed=2, rank=0, world_size=1, block_size=16)
    assert c.rank_ids().tolist() != e0
    # shard locality: any window of 16 consecutive samples touches few shards
    shards = open_dataset(ds_path).shard_of(np.array(e0))
    assert max(len(set(shards[i : i + 16])) for i in range(0, 157, 16)) <= 3
    assert StreamingDataset(ds_path, shuffle=False, world_size=1, rank=0).rank_ids().tolist() == list(range(157))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 8), workers=st.integers(0, 4), batch=st.integers(1, 7),
       drop_last=st.booleans(), data=st.data())
def test_resume_after_k_continues_exactly(ds_path, world, workers, batch, drop_last, data):
    full = rank_streams(ds_path, world, workers, batch, drop_last, epoch=2)
    k = data.draw(st.integers(0, len(full[0])))
    sd = StreamingDataset(ds_path, seed=3, rank=0, world_size=world, drop_last=drop_last, block_size=16)
    sd.set_epoch(2)
    state = sd.state_dict(consumed=k)
    resumed = rank_streams(ds_path, world, workers, batch, drop_last, epoch=2, state=state)
    for r in range(world):
        assert full[r][:k] + resumed[r] == full[r]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w1=st.integers(1, 8), w2=st.integers(1, 8), workers=st.integers(0, 4), data=st.data())
def test_resume_with_other_world_size_keeps_exactly_once(ds_path, w1, w2, workers, data):
    first = rank_streams(ds_path, w1, workers, 2, False, epoch=1)
    k = data.draw(st.integers(0, len(first[0]) - 1))
    sd = StreamingDataset(ds_path, seed=3, rank=0, world_size=w1, block_size=16)
    sd.set_epoch(1)
    state = sd.state_dict(consumed=k)
    second = rank_streams(ds_path, w2, workers, 3, False, epoch=1, state=state)
    assert len({len(s) for s in second}) == 1
    seen = [i for s in first for i in s[:k]] + [i for s in second for i in s]
    counts = collections.Counter(seen)
    assert set(counts) == set(range(157))
    # duplicates only from the explicit end-of-epoch padding (< world size of each phase)
    assert sum(c - 1 for c in counts.values()) < w1 + w2


def test_real_dataloader_with_workers_matches_and_resumes(ds_path):
    def collate(batch):
        return [r["key"] for r in batch]

    keys = open_dataset(ds_path).keys()
    sd = StreamingDataset(ds_path, seed=5, rank=1, world_size=3, block_size=16)
    loader = StreamingLoader(sd, batch_size=4, num_workers=2, collate_fn=collate)
    loader.set_epoch(0)
    got = [k for b in loader for k in b]
    assert got == [keys[i] for i in sd.rank_ids()]
    # stop after 3 batches, checkpoint, resume in a fresh loader (2 ranks now, rank 0)
    it = iter(loader)
    part = [k for _, b in zip(range(3), it, strict=False) for k in b]
    state = loader.state_dict()
    assert state["position"] == 3 * 4 * 3
    del it
    sd2 = StreamingDataset(ds_path, seed=5, rank=1, world_size=3, block_size=16)
    l2 = StreamingLoader(sd2, batch_size=4, num_workers=2, collate_fn=collate)
    l2.load_state_dict(state)
    l2.set_epoch(0)  # same epoch keeps the resume point
    rest = [k for b in l2 for k in b]
    assert part + rest == got


def test_in_process_iteration_counts_itself(ds_path):
    sd = StreamingDataset(ds_path, seed=0, rank=0, world_size=2, block_size=16)
    full = [r["key"] for r in sd]
    it = iter(sd)
    head = [next(it)["key"] for _ in range(10)]
    state = sd.state_dict()
    sd2 = StreamingDataset(ds_path, seed=0, rank=0, world_size=2, block_size=16)
    sd2.load_state_dict(state)
    assert head + [r["key"] for r in sd2] == full


def test_state_of_another_dataset_is_refused(ds_path):
    sd = StreamingDataset(ds_path, seed=0, world_size=1, rank=0)
    state = sd.state_dict(consumed=3)
    with pytest.raises(DataError, match="different dataset"):
        StreamingDataset(ds_path, indices=range(10), seed=0, world_size=1, rank=0).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        StreamingDataset(ds_path, seed=1, world_size=1, rank=0).load_state_dict(state)


def test_indices_subset_and_transform(ds_path):
    idx = [3, 5, 7, 100]
    sd = StreamingDataset(ds_path, idx, seed=0, world_size=1, rank=0, transform=lambda r: r["key"])
    assert sorted(sd) == sorted(f"r{i}" for i in idx)


def test_default_world_comes_from_torch_distributed(ds_path, tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        sd = StreamingDataset(ds_path)
        assert (sd.rank, sd.world_size) == (0, 1)
    finally:
        torch.distributed.destroy_process_group()


def test_weighted_mixing(tmp_path, ds_path):
    other = tmp_path / "other"
    with DatasetWriter(other, schema="bytes") as w:
        for i in range(20):
            w.write({"key": f"b{i}", "payload": bytes([i])})
    mix = MixedStreamingDataset([ds_path, other], weights=[0.25, 0.75], samples_per_epoch=400,
                                seed=1, rank=0, world_size=1, shuffle=True, transform=lambda r: r["key"])
    keys = list(mix)
    assert len(keys) == 400
    frac_b = sum(k.startswith("b") for k in keys) / 400
    assert 0.65 < frac_b < 0.85
    # the small source is up-sampled evenly: each of its 20 records ~15 times
    cb = collections.Counter(k for k in keys if k.startswith("b"))
    assert len(cb) == 20 and max(cb.values()) - min(cb.values()) <= 1
    again = MixedStreamingDataset([ds_path, other], weights=[0.25, 0.75], samples_per_epoch=400,
                                  seed=1, rank=0, world_size=1, transform=lambda r: r["key"])
    assert list(again) == keys
    # split over 3 ranks with resume support like a single dataset
    parts = [MixedStreamingDataset([ds_path, other], [0.25, 0.75], 400, seed=1, rank=r, world_size=3)
             for r in range(3)]
    ids = [p.rank_ids().tolist() for p in parts]
    assert {len(x) for x in ids} == {134}
    delivered = collections.Counter(i for x in ids for i in x)
    epoch = collections.Counter(parts[0]._order(0).tolist())
    assert not (epoch - delivered) and sum((delivered - epoch).values()) == 3 * 134 - 400
    with pytest.raises(DataError, match="weight"):
        MixedStreamingDataset([ds_path], weights=[0.0])


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("world, workers, batch", [(2, 3, 5), (3, 4, 7)])
def test_real_dataloaders_cover_the_epoch_exactly_once(ds_path, world, workers, batch):
    keys = open_dataset(ds_path).keys()
    got = []
    for r in range(world):
        sd = StreamingDataset(ds_path, seed=9, rank=r, world_size=world, block_size=16, drop_last=True)
        loader = StreamingLoader(sd, batch_size=batch, num_workers=workers,
                                 collate_fn=lambda b: [x["key"] for x in b])
        seq = [k for b in loader for k in b]
        assert seq == [keys[i] for i in sd.rank_ids()] and len(seq) == 157 // world
        got.extend(seq)
    assert len(got) == len(set(got)) == (157 // world) * world


def test_reader_keeps_few_shards_mapped_and_unmaps_at_the_end(tmp_path):
    from bench.dataio.stream import MAPPED_SHARDS

    path = tmp_path / "bytes"
    with DatasetWriter(path, schema="bytes", shard_bytes=4096, compression="none") as w:
        for i in range(300):
            w.write({"key": f"k{i}", "payload": bytes([i % 251]) * (100 + i % 200)})
    sd = StreamingDataset(path, seed=1, rank=0, world_size=1, batch_size=8, block_size=32)
    shards = sd.dataset.shards
    assert len(shards) > 2 * MAPPED_SHARDS
    most, seen = 0, []
    for rec in sd:
        seen.append(rec["key"])
        most = max(most, sum(sh._mm is not None for sh in shards))
    assert sorted(seen) == sorted(f"k{i}" for i in range(300))
    assert 1 <= most <= MAPPED_SHARDS
    assert all(sh._mm is None for sh in shards)


def test_streaming_with_prefetch_and_workers(tmp_path):
    """Through the node-local cache tier (data/cache.py's ShardCache and Prefetcher), with
    DataLoader workers: the same records in the same order, the cache within its budget."""
    from convergent.data.cache import ShardCache
    from convergent.data.manifest import read_manifest

    remote = tmp_path / "pfs" / "ds"  # ~10 shards of a few KiB
    with DatasetWriter(remote, shard_bytes=6000, compression="none") as w:
        w.write_many(molecular_records(120, max_atoms=6))
    m = read_manifest(remote)
    budget = 4 * max(s.bytes for s in m.shards)
    sd = StreamingDataset(remote, seed=0, rank=0, world_size=1, block_size=8,
                          cache=tmp_path / "local", cache_bytes=budget, prefetch_shards=2)
    loader = StreamingLoader(sd, batch_size=5, num_workers=2, collate_fn=lambda b: [r["key"] for r in b])
    got = [k for b in loader for k in b]
    keys = open_dataset(remote).keys()
    assert got == [keys[i] for i in sd.rank_ids()]
    cache = ShardCache(tmp_path / "local", budget_bytes=budget)
    assert 0 < cache.used_bytes() <= budget
