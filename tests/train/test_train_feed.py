"""The input pipeline (prefetch thread) and the step timer, on the CPU."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from convergent.monitor.timers import StepTimer
from convergent.train.prefetch import Prefetcher, map_tensors


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    n: int


def _make(step: int) -> list[_Batch]:
    g = torch.Generator().manual_seed(step)
    return [_Batch(torch.randn(3, generator=g), step), _Batch(torch.randn(2, generator=g), -step)]


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetch_yields_the_same_batches_in_step_order(depth):
    feed = Prefetcher(_make, range(2, 9), torch.device("cpu"), depth)
    try:
        for step in range(2, 9):
            got, want = feed.get(step), _make(step)
            feed.ahead()
            assert [b.n for b in got] == [b.n for b in want]
            assert all(torch.equal(a.x, b.x) for a, b in zip(got, want, strict=True))
        with pytest.raises(RuntimeError, match="no batches left"):
            feed.get(9)
    finally:
        feed.close()


def test_prefetch_works_ahead_in_a_thread_and_reraises_its_errors():
    made: list[tuple[int, str]] = []

    def make(step: int) -> list[_Batch]:
        made.append((step, threading.current_thread().name))
        if step == 3:
            raise ValueError("shard 7 is corrupt")
        return _make(step)

    feed = Prefetcher(make, range(0, 6), torch.device("cpu"), depth=2)
    try:
        feed.get(0)
        deadline = time.monotonic() + 10
        while len(made) < 3 and time.monotonic() < deadline:  # steps 1, 2 built ahead
            time.sleep(0.01)
        assert [s for s, _ in made[:3]] == [0, 1, 2]
        assert {name for _, name in made} == {"prefetch"}
        feed.get(1)
        feed.get(2)
        with pytest.raises(ValueError, match="shard 7"):
            feed.get(3)
    finally:
        feed.close()


def test_map_tensors_reaches_nested_dataclasses_and_keeps_the_rest():
    b = {"a": (_Batch(torch.ones(2), 4), [torch.zeros(1)]), "k": "text"}
    out = map_tensors(b, lambda t: t + 1)
    assert torch.equal(out["a"][0].x, torch.full((2,), 2.0)) and out["a"][0].n == 4
    assert torch.equal(out["a"][1][0], torch.ones(1)) and out["k"] == "text"


def test_cpu_step_timer_snapshot_resolves_sections_and_moves():
    t = StepTimer()
    with t.section("data_wait"):
        time.sleep(0.01)
    t.add("compute", 0.5)
    t.move("compute", "comm", 0.2)
    snap = t.snapshot().resolve()
    assert snap["data_wait"] > 0 and snap["comm"] == pytest.approx(0.2)
    assert snap["compute"] == pytest.approx(0.3)
    assert snap["step_s"] >= snap["data_wait"]


def test_collate_checks_all_atoms_at_once_and_still_names_the_record():
    import numpy as np

    from convergent.core.errors import DataError
    from convergent.models.batching import collate_records

    good = {"key": "a", "numbers": [1, 8], "positions": np.zeros((2, 3)), "energy": 1.0,
            "forces": np.zeros((2, 3)), "pbc": np.zeros(3, bool)}
    bad = {**good, "key": "b", "positions": np.array([[0.0, 0.0, 0.0], [np.nan, 0, 0]])}
    with pytest.raises(DataError, match="record b: positions contain NaN/inf"):
        collate_records([good, bad])
    unlabelled = {**good, "key": "c", "energy": float("nan"), "forces": np.full((2, 3), np.nan)}
    b = collate_records([good, unlabelled])
    assert b.energy is None and b.forces is None and b.cell is None and b.pbc is None
    assert b.batch.tolist() == [0, 0, 1, 1] and b.n_atoms.tolist() == [2, 2]
    periodic = {**good, "key": "d", "pbc": [True, True, False], "cell": np.eye(3) * 5}
    b = collate_records([good, periodic])
    assert b.pbc.tolist() == [[False] * 3, [True, True, False]]
    assert b.cell[0].abs().sum() == 0 and b.cell[1, 0, 0] == 5


class _Source:
    """A record source as the column store reads it (read / records / atom_counts)."""

    def __init__(self, recs):
        self.recs = recs
        self.atom_counts = [len(r["numbers"]) for r in recs]

    def read(self, i):
        return self.recs[i]

    def records(self, idx):
        return [self.recs[i] for i in idx]


def _assert_same_batch(a, b):
    for f in ("numbers", "positions", "batch", "n_atoms", "energy", "forces", "cell", "pbc"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None and y is None) or torch.equal(x, y), f
    assert a.keys == b.keys and a.molecule_ids == b.molecule_ids
    assert a.n_molecules == b.n_molecules


def test_column_store_batches_equal_collate_records_including_fallbacks():
    import numpy as np

    from convergent.core.errors import DataError
    from convergent.models.batching import collate_records
    from convergent.train.molcolumns import ColumnStore

    rng = np.random.default_rng(0)
    recs = []
    for i in range(40):
        n = int(rng.integers(1, 9))
        recs.append({"key": f"k{i}", "molecule_id": f"m{i % 7}",
                     "numbers": rng.integers(1, 9, n), "positions": rng.normal(size=(n, 3)),
                     "energy": float(rng.normal()), "forces": rng.normal(size=(n, 3)),
                     "pbc": np.zeros(3, bool)})
    store = ColumnStore(_Source(recs))
    for idx in ([3, 1, 4, 1, 5], list(range(40)), [39], list(range(39, -1, -3))):
        _assert_same_batch(store.batch(idx), collate_records([recs[i] for i in idx]))
    # records the columns do not hold go through collate_records itself
    recs[7] = {**recs[7], "forces": np.full((len(recs[7]["numbers"]), 3), np.nan)}
    recs[8] = {**recs[8], "pbc": [True, True, True], "cell": np.eye(3) * 9}
    recs[9] = {**recs[9], "positions": np.full((len(recs[9]["numbers"]), 3), np.inf)}
    store = ColumnStore(_Source(recs))
    for idx in ([6, 7], [8, 2], [10, 11, 12]):
        _assert_same_batch(store.batch(idx), collate_records([recs[i] for i in idx]))
    assert store.batch([6, 7]).forces is None and store.batch([8, 2]).pbc is not None
    with pytest.raises(DataError, match="record k9: positions contain NaN/inf"):
        store.batch([10, 9])
