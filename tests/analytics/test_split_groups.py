"""split's numeric group keys, group assignment, leakage check from what was written, batched maps."""

from __future__ import annotations

import numpy as np
import pytest

from convergent.analytics import derived
from convergent.analytics import groupkeys as gk
from convergent.analytics import split as split_mod
from convergent.analytics.engine import Engine, plan
from convergent.analytics.split import GREEDY_MAX_GROUPS, _assign, split_dataset
from convergent.core.errors import DataError
from convergent.core.fsutil import start_writeback
from convergent.data import writer as writer_mod
from convergent.data.index import strings
from convergent.data.indexscan import IndexScan
from convergent.data.manifest import read_manifest
from convergent.data.reader import ShardReader, open_dataset
from convergent.data.verify import verify_dataset
from convergent.data.writer import write_records
from tests.analytics.analyticsdata import distinct_records, shard_records_plus


def _column(strs: list[str]) -> tuple[np.ndarray, bytes]:
    raw = [s.encode() for s in strs]
    return np.cumsum([0, *map(len, raw)]).astype(np.int64), b"".join(raw)


# padded-matrix path; with a row mix that collides (only the last word counts: the exact
# check must catch it); one-by-one path
@pytest.mark.parametrize(("pad_max", "mix"), [(gk._PAD_MAX, gk._MIX), (gk._PAD_MAX, np.uint64(0)), (1, gk._MIX)])
def test_hash_strings_matches_hashing_each_string(monkeypatch, pad_max, mix):
    monkeypatch.setattr(gk, "_PAD_MAX", pad_max)
    monkeypatch.setattr(gk, "_MIX", mix)
    strs = ["mol1", "mol1", "", "ab", "ab\0", "mölécule-ü", "mol1", "x" * 300, "", "ab", "y" + "x" * 299]
    h = gk.hash_strings(*_column(strs))
    assert h.dtype == np.uint64 and h.tolist() == gk.hash_list(strs).tolist()
    assert h[0] == h[1] == h[6] and h[2] == h[8] and h[3] == h[9]
    assert len(set(h.tolist())) == len(set(strs))  # "ab" and "ab\0" are different keys


def _records(n: int, missing_every: int = 0) -> list[dict]:
    """``distinct_records`` made chemically consistent for a split, whose leakage check
    compares chemical identity: each molecule id one formula of its own (C_k H_(k+1)), each
    record without an id a formula of its own (C_k H_(k+20)); geometries stay random."""
    recs = distinct_records(n)
    rng = np.random.default_rng(0)
    for i, r in enumerate(recs):
        if missing_every and i % missing_every == 0:
            r["molecule_id"] = ""
            c, h = 1 + i % 7, 20 + i
        else:
            k = int(r["molecule_id"].removeprefix("mol"))
            c, h = 1 + k % 7, 1 + k
        z = np.array([6] * c + [1] * h, np.int64)
        r.update(numbers=z, positions=rng.normal(scale=1.5, size=(len(z), 3)),
                 forces=rng.normal(size=(len(z), 3)))
    return recs


def test_index_scan_reads_the_columns_in_pieces_and_checks_the_index(tmp_path):
    write_records(tmp_path / "ds", _records(300, missing_every=7), shard_bytes=2**20, compression="none")
    tasks, (m,) = plan([tmp_path / "ds"])
    info = m.shards[0]
    want = strings(ShardReader(tmp_path / "ds", info).meta.index, "molecule_id")
    with IndexScan(tmp_path / "ds", info) as sc:
        assert sc.count == info.records == 300 and sc.schema == "molecular"
        got = []
        for a in range(0, sc.count, 64):
            off, data = sc.strings("molecule_id", a, min(a + 64, sc.count))
            got += [data[off[i]: off[i + 1]].decode() for i in range(len(off) - 1)]
        assert got == want
        keys = gk.molecule_keys(sc, 0, sc.count)
    recs = {r["key"]: r for r in _records(300, missing_every=7)}
    ks = strings(ShardReader(tmp_path / "ds", info).meta.index, "key")
    assert keys.tolist() == gk.hash_list([gk.molecule_key(recs[k]["molecule_id"], k) for k in ks]).tolist()
    # a flipped byte inside the index fails the header/index CRC, naming the shard
    p = tmp_path / "ds" / info.name
    raw = bytearray(p.read_bytes())
    raw[-60] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"shard {info.name}: header/index checksum mismatch"):
        IndexScan(tmp_path / "ds", info)
    p.unlink()
    with pytest.raises(DataError, match=f"shard {info.name}: file missing"):
        IndexScan(tmp_path / "ds", info)


def _old_greedy(sizes: np.ndarray, targets: list[int], order: np.ndarray) -> np.ndarray:
    """The per-group numpy version split used before (the reference for the fast one)."""
    out = np.full(len(sizes), -1, np.int64)
    filled = np.zeros(len(targets), np.int64)
    t = np.asarray(targets, np.int64)
    for g in order:
        room = t - filled
        if room.max() <= 0:
            break
        share = np.where(t > 0, room / np.maximum(t, 1), -np.inf)
        cand = np.flatnonzero((room >= sizes[g]) & (t > 0))
        s = int(cand[np.argmax(share[cand])]) if cand.size else int(np.argmax(share))
        out[g] = s
        filled[s] += sizes[g]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_assign_few_groups_is_the_greedy_fill(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 200, size=500)
    for targets in ([8000, 1000, 1000], [int(sizes.sum()) - 900, 500, 400], [300, 0, 300]):
        got = _assign(sizes, targets, np.random.default_rng(seed))
        order = np.random.default_rng(seed).permutation(len(sizes))
        assert got.tolist() == _old_greedy(sizes, targets, order).tolist()


def test_assign_many_groups_meets_the_targets_within_one_group():
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 40, size=GREEDY_MAX_GROUPS * 3)
    total = int(sizes.sum())
    for targets in ([total - 2 * (total // 10), total // 10, total // 10], [total // 3, 0, total // 3]):
        a = _assign(sizes, targets, np.random.default_rng(1))
        assert a.tolist() == _assign(sizes, targets, np.random.default_rng(1)).tolist()  # seeded
        assert a.tolist() != _assign(sizes, targets, np.random.default_rng(2)).tolist()
        got = np.bincount(a[a >= 0], weights=sizes[a >= 0], minlength=3)
        assert np.all(np.abs(got - targets) <= sizes.max()), (got, targets)
        assert all(g == 0 for g, t in zip(got, targets, strict=True) if t == 0)
        if sum(targets) == total:
            assert (a >= 0).all()
        else:
            assert abs(int(sizes[a < 0].sum()) - (total - sum(targets))) <= sizes.max()


def test_split_by_molecule_with_records_lacking_a_molecule_id(client, tmp_path):
    """A record without a molecule id is its own molecule: such records spread over the
    splits without being reported as one molecule in two splits."""
    recs = _records(200, missing_every=4)
    write_records(tmp_path / "ds", recs, shard_bytes=8192)
    rep = split_dataset(tmp_path / "ds", tmp_path / "split", "molecule", "train=0.5,val=0.5", seed=2,
                        engine=Engine(client, progress=False), shard_bytes=16384)
    lk = rep["leakage"]
    assert lk["ok"] and lk["molecules_in_two_splits"] == 0 and lk["molecule_groups_in_two_splits"] == 0
    assert rep["groups"] == 11 + 50 and sum(rep["records"].values()) == 200
    ids = {s: set(open_dataset(tmp_path / "split" / s).molecule_ids()) - {""} for s in ("train", "val")}
    assert not ids["train"] & ids["val"]
    lacking = {s: sum(1 for x in open_dataset(tmp_path / "split" / s).molecule_ids() if x == "")
               for s in ("train", "val")}
    assert sum(lacking.values()) == 50 and min(lacking.values()) > 0


@pytest.mark.parametrize("mode", ["molecule", "composition"])
def test_split_leakage_check_catches_a_planted_leak(client, monkeypatch, tmp_path, mode):
    """One record sent to the other split than its group's: the check, derived from the
    records the write tasks appended (not from the plan), reports the molecule and the
    group in two splits, and agrees with the outputs read back."""
    write_records(tmp_path / "ds", _records(200), shard_bytes=8192)
    real = split_mod._records_split
    planted = []

    def leaky(split_g: np.ndarray, group_all: np.ndarray) -> np.ndarray:
        where = real(split_g, group_all)
        i = int(np.flatnonzero(where >= 0)[7])
        where[i] = 1 - where[i]  # two splits: the other one
        planted.append(i)
        return where

    eng = Engine(client, progress=False)
    clean = split_dataset(tmp_path / "ds", tmp_path / "ok", mode, "train=0.5,val=0.5", seed=1, engine=eng)
    assert clean["leakage"]["ok"] and clean["leakage"][f"{mode}_groups_in_two_splits"] == 0
    monkeypatch.setattr(split_mod, "_records_split", leaky)
    rep = split_dataset(tmp_path / "ds", tmp_path / "leak", mode, "train=0.5,val=0.5", seed=1, engine=eng)
    lk = rep["leakage"]
    assert planted and not lk["ok"] and lk[f"{mode}_groups_in_two_splits"] == 1
    assert sum(rep["records"].values()) == 200

    def group(r: dict) -> str:
        return r["molecule_id"] if mode == "molecule" else derived.formula(r["numbers"])

    seen = {s: {group(r) for r in open_dataset(tmp_path / "leak" / s)} for s in ("train", "val")}
    assert len(seen["train"] & seen["val"]) == 1  # the report agrees with the outputs read back
    if mode == "molecule":
        assert lk["molecules_in_two_splits"] == 1


def test_batched_map_returns_every_result_in_task_order(client, tmp_path):
    write_records(tmp_path / "ds", _records(400), shard_bytes=4096)
    tasks, _ = plan([tmp_path / "ds"])
    assert len(tasks) > 16
    eng = Engine(client, progress=False)
    per = [(k * 10,) for k in range(len(tasks))]
    plain = eng.map(shard_records_plus, tasks, 1, per_task=per)
    batched = eng.map(shard_records_plus, tasks, 1, per_task=per, batch=True)
    assert batched == plain == [(t.shard_no, t.info.records + 1 + 10 * k) for k, t in enumerate(tasks)]


def test_writer_starts_writeback_as_a_shard_grows_and_the_shard_is_intact(monkeypatch, tmp_path):
    monkeypatch.setattr(writer_mod, "WRITEBACK_BYTES", 4096)
    ranges = []

    def spy(fd: int, offset: int, nbytes: int) -> None:
        ranges.append((offset, nbytes))
        start_writeback(fd, offset, nbytes)

    monkeypatch.setattr(writer_mod, "start_writeback", spy)
    recs = _records(120)
    write_records(tmp_path / "ds", recs, shard_bytes=2**20, compression="none")
    (info,) = read_manifest(tmp_path / "ds").shards
    # handed to the disk in order, in pieces of >= 4 KiB, as the shard grew
    assert len(ranges) > 3 and ranges[0][0] == 0 and all(n >= 4096 for _, n in ranges)
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:], strict=False))
    assert ranges[-1][0] + ranges[-1][1] <= info.bytes
    assert verify_dataset(tmp_path / "ds", deep=True).ok
    ds = open_dataset(tmp_path / "ds")
    assert [ds[i]["key"] for i in range(len(ds))] == [r["key"] for r in recs]


def test_batched_units_cover_every_task_once_shrink_at_the_end_and_keep_placement():
    from convergent.analytics.batching import BATCH_MAX
    from convergent.analytics.batching import units as _units

    placed = {k: ["w1"] for k in range(0, 100, 10)}  # every 10th task only on worker w1
    units = _units(100, placed, 2, batch=True)
    assert sorted(k for u in units for k in u) == list(range(100))
    for u in units:
        assert len({tuple(placed.get(k) or ()) for k in u}) == 1  # one placement per unit
        assert u == sorted(u) and len(u) <= BATCH_MAX
    free = [len(u) for u in units if not placed.get(u[0])]
    assert free[0] == BATCH_MAX and free[-1] == 1 and free == sorted(free, reverse=True)
    assert [len(u) for u in _units(5, {}, 2, batch=False)] == [1] * 5


def test_even_units_one_run_per_worker_cut_by_records_and_keep_placement():
    from convergent.analytics.batching import EVEN
    from convergent.analytics.batching import units as _units

    sizes = [10] * 40 + [30] * 20  # the last third of the tasks hold 3x the records
    units = _units(60, {}, 2, EVEN, sizes)
    assert len(units) == 2 and [k for u in units for k in u] == list(range(60))
    loads = [sum(sizes[k] for k in u) for u in units]
    assert abs(loads[0] - loads[1]) <= 30  # within one task's records of an equal share
    assert len(units[0]) > len(units[1])  # so the runs differ in tasks, not in records
    placed = {k: ["w1"] for k in range(0, 60, 3)}
    units = _units(60, placed, 3, EVEN, sizes)
    assert sorted(k for u in units for k in u) == list(range(60))
    pinned = [u for u in units if placed.get(u[0])]
    assert len(pinned) == 1 and all(placed.get(k) for k in pinned[0])  # one worker: one run
    assert len(units) == 4  # the other tasks: one run per worker of three
    assert _units(2, {}, 5, EVEN, [1, 1]) == [[0], [1]]  # never an empty run


def test_balanced_units_even_runs_then_a_tail_of_single_tasks():
    from convergent.analytics.batching import BALANCED, TAIL_SHARE
    from convergent.analytics.batching import units as _units

    sizes = [10] * 40 + [30] * 20
    units = _units(60, {}, 2, BALANCED, sizes)
    assert [k for u in units for k in u] == list(range(60))
    head, tail = units[:2], units[2:]
    assert tail and all(len(u) == 1 for u in tail)  # the last shards: one task each
    total = sum(sizes)
    assert sum(sizes[u[0]] for u in tail) <= TAIL_SHARE * total + max(sizes)
    loads = [sum(sizes[k] for k in u) for u in head]
    assert abs(loads[0] - loads[1]) <= 30 and sum(loads) >= (1 - TAIL_SHARE) * total - 30
    placed = {k: ["w1"] for k in range(0, 60, 3)}  # placement is kept, as with EVEN
    units = _units(60, placed, 2, BALANCED, sizes)
    assert sorted(k for u in units for k in u) == list(range(60))
    for u in units:
        assert len({tuple(placed.get(k) or ()) for k in u}) == 1
    assert _units(3, {}, 2, BALANCED, [5, 5, 5]) == [[0], [1], [2]]  # never an empty run
