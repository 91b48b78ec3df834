"""Records encoded on the worker: the same bytes and the same dataset as encoding on the
driver; a record the dataset would refuse is quarantined, not fatal."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from convergent.data.reader import open_dataset
from convergent.data.writer import DatasetWriter
from convergent.sim.config import SimulateConfig
from convergent.sim.plan import plan_tasks
from convergent.sim.records import PackedRecord, make_record, pack_record, pack_records
from convergent.sim.sources import load_molecules
from convergent.sim.tasks import TaskResult
from convergent.sim.worker import execute_task, execute_task_packed


def _record(key: str = "k/0", numbers=(8, 1, 1)) -> dict:
    n = len(numbers)
    rng = np.random.default_rng(1)
    return make_record(key, "g2-H2O", np.array(numbers), rng.normal(size=(n, 3)), 0, 1,
                       -137.5, rng.normal(size=(n, 3)), {"program": "tblite", "frame": 0})


def _read(path) -> list[dict]:
    ds = open_dataset(path)
    try:
        return list(ds)
    finally:
        ds.close()


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_packed_record_reads_back_like_a_driver_written_one(tmp_path, compression):
    recs = [_record(f"k/{i}") for i in range(3)]
    with DatasetWriter(tmp_path / "driver", compression=compression) as w:
        for r in recs:
            w.write(r)
    with DatasetWriter(tmp_path / "worker", compression=compression) as w:
        for r in recs:
            p = pickle.loads(pickle.dumps(pack_record(r, compression)))  # as shipped
            assert p.index.body == b"" and p.key == r["key"]
            w.write_encoded(p.index, p.frame)
    a, b = _read(tmp_path / "driver"), _read(tmp_path / "worker")
    assert [r["key"] for r in a] == [r["key"] for r in b] == ["k/0", "k/1", "k/2"]
    for ra, rb in zip(a, b, strict=True):
        np.testing.assert_array_equal(ra["positions"], rb["positions"])
        np.testing.assert_array_equal(ra["forces"], rb["forces"])
        assert ra["energy"] == rb["energy"] and ra["meta"] == rb["meta"]
    # byte-identical shards apart from the random shard names
    sa = sorted(p.read_bytes() for p in (tmp_path / "driver").glob("shard-*"))
    sb = sorted(p.read_bytes() for p in (tmp_path / "worker").glob("shard-*"))
    assert sa == sb


def test_refused_record_is_quarantined_with_its_reason():
    good, bad = _record("k/good"), _record("k/bad", numbers=(300, 1))
    packed, refused = pack_records([good, bad])
    assert [p.key for p in packed] == ["k/good"]
    assert len(refused) == 1 and refused[0]["key"] == "k/bad"
    assert refused[0]["reason"].startswith("record refused by the dataset:")
    assert "0..255" in refused[0]["reason"]


def test_execute_task_packed_matches_execute_task():
    sim = SimulateConfig(frames=4, max_atoms=3, chunk_size=4)
    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms)
    task = plan_tasks(sim, mols)[0]
    res = pickle.loads(execute_task_packed(task, compression="none"))
    assert isinstance(res, TaskResult) and all(isinstance(r, PackedRecord) for r in res.records)
    assert [r.key for r in res.records] == task.keys and not res.quarantined
    plain = execute_task(task)
    for packed, rec in zip(res.records, plain.records, strict=True):
        assert packed.index.energy == pytest.approx(rec["energy"], abs=1e-8)
        assert packed.index.n_atoms == len(rec["numbers"])
        assert packed.index.molecule_id == rec["molecule_id"]
