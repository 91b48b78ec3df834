"""The shard index accumulated compactly while writing: the same columns as building it
from the records at the end, and no frame bodies kept in memory."""

from __future__ import annotations

import tracemalloc

import numpy as np

from convergent.data.indexbuild import IndexBuilder
from convergent.data.reader import open_dataset
from convergent.data.records import encode_bytes, encode_molecular
from convergent.data.writer import DatasetWriter


def _reference(schema, encoded, offsets):
    """The columns as the writer built them from its list of records (before IndexBuilder)."""
    def strings(values):
        enc = [v.encode() for v in values]
        off = np.zeros(len(enc) + 1, np.uint64)
        np.cumsum([len(b) for b in enc], out=off[1:])
        return off, np.frombuffer(b"".join(enc), np.uint8)

    cols = {"offsets": np.asarray(offsets, np.uint64)}
    cols["key.off"], cols["key.utf8"] = strings([e.key for e in encoded])
    if schema == "molecular":
        cols["molecule_id.off"], cols["molecule_id.utf8"] = strings([e.molecule_id for e in encoded])
        cols["n_atoms"] = np.asarray([e.n_atoms for e in encoded], np.int32)
        cols["energy"] = np.asarray([e.energy for e in encoded], np.float64)
        cols["charge"] = np.asarray([e.charge for e in encoded], np.int32)
        cols["multiplicity"] = np.asarray([e.multiplicity for e in encoded], np.int32)
    else:
        cols["size"] = np.asarray([e.size for e in encoded], np.uint64)
        pay = [e.payload if e.payload is not None else b"" for e in encoded]
        off = np.zeros(len(pay) + 1, np.uint64)
        np.cumsum([len(b) for b in pay], out=off[1:])
        cols["inline.off"], cols["inline.data"] = off, np.frombuffer(b"".join(pay), np.uint8)
        cols["inlined"] = np.asarray([e.payload is not None for e in encoded], np.uint8)
    return cols


def _molecular(i, rng):
    n = int(rng.integers(1, 9))
    return {"key": f"k{i}-é", "molecule_id": f"m{i % 7}", "numbers": rng.integers(1, 9, n),
            "positions": rng.normal(size=(n, 3)), "energy": float(rng.normal()),
            "charge": int(rng.integers(-1, 2)), "multiplicity": int(rng.integers(1, 3))}


def _bytes(i, rng):
    return {"key": f"b{i}", "payload": rng.bytes(int(rng.integers(0, 600)))}


def test_columns_equal_the_reference_for_both_schemas():
    rng = np.random.default_rng(0)
    for schema, make, enc_fn in [("molecular", _molecular, encode_molecular),
                                 ("bytes", _bytes, lambda r: encode_bytes(r, 256))]:
        encoded = [enc_fn(make(i, rng)) for i in range(300)]
        offsets = list(np.cumsum(rng.integers(10, 1000, len(encoded) + 1)))
        b = IndexBuilder(schema)
        for e, off in zip(encoded, offsets, strict=False):
            b.add(e, int(off))
        got, want = b.columns(int(offsets[-1])), _reference(schema, encoded, offsets)
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_writer_keeps_no_record_bodies_and_reads_back(tmp_path):
    rng = np.random.default_rng(1)
    payloads = [rng.bytes(4096) for _ in range(2000)]  # 8 MiB of bodies, one open shard
    with DatasetWriter(tmp_path / "ds", schema="bytes", shard_bytes=64 * 2**20) as w:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for i, p in enumerate(payloads):
            w.write({"key": f"r{i:05d}", "payload": p})
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        assert held < 2 * 2**20, f"the open shard holds {held} bytes (bodies kept?)"
    ds = open_dataset(tmp_path / "ds")
    try:
        recs = list(ds)
        assert [r["key"] for r in recs] == [f"r{i:05d}" for i in range(2000)]
        assert all(r["payload"] == p for r, p in zip(recs, payloads, strict=True))
    finally:
        ds.close()


def test_spilled_columns_equal_the_reference(tmp_path):
    """A tiny spill threshold: every column goes through the spill file many times, and the
    streamed index is byte-identical to packing the reference columns."""
    from convergent.data.index import pack_index

    rng = np.random.default_rng(2)
    for schema, make, enc_fn in [("molecular", _molecular, encode_molecular),
                                 ("bytes", _bytes, lambda r: encode_bytes(r, 256))]:
        encoded = [enc_fn(make(i, rng)) for i in range(500)]
        offsets = list(np.cumsum(rng.integers(10, 1000, len(encoded) + 1)))
        b = IndexBuilder(schema, spill_dir=tmp_path, name=schema, spill_bytes=700)
        for e, off in zip(encoded, offsets, strict=False):
            b.add(e, int(off))
        assert b.spill_path and (tmp_path / b.spill_path).exists()
        assert len(b.cols["key.utf8"].chunks) > 10  # spilled many times
        want = _reference(schema, encoded, offsets)
        assert b"".join(b.stream(int(offsets[-1]))) == pack_index(want)
        got = b.columns(int(offsets[-1]))
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        b.close()
        assert not any(tmp_path.iterdir()), "the spill file was left behind"


def test_writer_index_memory_does_not_grow_with_the_shard(tmp_path):
    """Molecular records into one large shard: the index spills beside it, the memory the
    writer holds stays near the spill threshold, the shard reads back whole and no spill
    file remains."""
    from convergent.data import indexbuild

    rng = np.random.default_rng(3)
    recs = [_molecular(i, rng) for i in range(12000)]
    old = indexbuild.SPILL_BYTES
    indexbuild.SPILL_BYTES = 64 * 1024
    try:
        # check_unique off, as analytics' per-worker sinks run (the key set is its own cost)
        with DatasetWriter(tmp_path / "ds", schema="molecular", shard_bytes=2**30,
                           compression="none", check_unique=False) as w:
            tracemalloc.start()
            w.write_many(recs[:1000])
            after_1k = tracemalloc.get_traced_memory()[0]
            w.write_many(recs[1000:])
            after_12k = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
    finally:
        indexbuild.SPILL_BYTES = old
    assert after_12k - after_1k < 256 * 1024, (after_1k, after_12k)
    assert not [p for p in (tmp_path / "ds").iterdir() if p.name.endswith(".tmp")]
    ds = open_dataset(tmp_path / "ds")
    try:
        assert [r["key"] for r in ds] == [r["key"] for r in recs]
    finally:
        ds.close()
