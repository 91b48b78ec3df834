"""`data dedup`: exact duplicates by structure hash, near duplicates by geometry fingerprint.

Three Dask stages, with a disk-backed shuffle between the first two:

1. **scan** (one task per shard, a few shards per Dask task): per record its global index, structure hash,
   composition hash and fingerprint (:func:`~convergent.analytics.derived.fingerprint`,
   32 floats), bucketed by composition hash into ``P`` partitions (P grows with the
   dataset: ``records / partition_records``) and appended to the worker's spill file
   (:mod:`~convergent.analytics.spill`); the task returns only where its blocks are.
2. **match** (one task per partition): reads its blocks back from the spill files, so a
   worker holds one shard's or one partition's rows at a time, whatever the dataset's
   size (a partition holds whole compositions: one composition larger than
   ``partition_records`` makes its partition that large). Exact duplicates (same structure hash) and,
   within a composition, near duplicates: ``max |fp_a - fp_b| <= tolerance`` (Å).
   Candidates come from a hash join on grid cells of 4 fingerprint values (see
   :func:`_near`; no pair is missed), then all 32 values are checked. The first record
   (lowest global index) of a cluster is kept; a record is dropped if it matches an
   earlier kept one.
3. **write** (one task per shard, a few shards per Dask task): the kept records into
   per-worker sinks.

Output: the kept set (a dataset) and ``dropped.jsonl`` in it (key, reason, kept key,
distance) listing every dropped record.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from convergent.analytics import derived, spill
from convergent.analytics.engine import (
    Engine,
    OutSpec,
    ShardTask,
    ShardView,
    commit,
    lineage,
    new_run,
    plan,
    prepare_outputs,
    shard_groups,
    sink,
)
from convergent.core.errors import DataError
from convergent.core.fsutil import atomic_write_text, dumps_json

OUT = "kept"
DROPPED = "dropped.jsonl"
_MASK = np.uint64(2**62 - 1)


ROW = np.dtype([("idx", "<i8"), ("hash", "<u8"), ("comp", "<u8"), ("n", "<i4"),
                ("fp", "<f4", (derived.FP_LEN,))])  # one record in the spill files


def _scan_task(task: ShardTask, parts: int, directory: str, run: str) -> list[spill.Block]:
    """Stage 1: fingerprint a shard's records; spill them by partition (composition hash)."""
    v = ShardView(task)
    n = v.n
    sh = np.zeros(n, np.uint64)
    comp = np.zeros(n, np.uint64)
    fp = np.zeros((n, derived.FP_LEN), np.float32)
    nat = np.zeros(n, np.int32)
    for i in range(n):
        r = v.record(i)
        nat[i] = len(r["numbers"])
        sh[i] = derived.structure_hash(r)
        comp[i] = derived.composition_hash(r)
        fp[i] = derived.fingerprint(r["numbers"], r["positions"])
    v.close()
    rows = np.zeros(n, ROW)
    rows["idx"] = np.arange(task.start, task.start + n, dtype=np.int64)
    rows["hash"], rows["comp"], rows["n"], rows["fp"] = sh, comp, nat, fp
    del sh, comp, fp, nat
    groups = shard_groups((rows["comp"] & _MASK).astype(np.int64), parts)
    return spill.append(directory, run, [rows[g] for g in groups])


def _match_part(part: int, tol: float, blocks: list[spill.Block]) -> dict[str, np.ndarray]:
    """Stage 2: read partition ``part`` back from the spill files and match it."""
    return match_rows(spill.read(blocks, ROW), tol)


def match_rows(rows: np.ndarray, tol: float) -> dict[str, np.ndarray]:
    """Dropped global indices among ``rows`` (:data:`ROW`), each with its reason and kept
    partner: exact duplicates (same structure hash), then near ones (:func:`_near`)."""
    idx, hs, comp, nat = rows["idx"], rows["hash"], rows["comp"], rows["n"]
    fp = rows["fp"].astype(np.float64)
    # exact: equal structure hash -> all but the lowest index of each run are dropped
    o = np.lexsort((idx, hs))
    same = np.zeros(idx.size, bool)
    same[1:] = hs[o][1:] == hs[o][:-1]
    head = np.maximum.accumulate(np.where(~same, np.arange(idx.size), 0))
    ex_drop, ex_keep = idx[o][same], idx[o][head][same]
    live = np.ones(idx.size, bool)
    live[o[same]] = False
    drop, keep, dist = [ex_drop], [ex_keep], [np.zeros(ex_drop.size)]
    if tol > 0 and live.sum() > 1:
        d, k, dd = _near(idx[live], comp[live], fp[live], nat[live], tol)
        drop.append(d)
        keep.append(k)
        dist.append(dd)
    n_exact = ex_drop.size
    d = np.concatenate(drop)
    return {"drop": d, "keep": np.concatenate(keep), "dist": np.concatenate(dist),
            "exact": np.arange(d.size) < n_exact}


_DIMS = 4  # fingerprint values hashed into grid cells for the candidate search
_CHUNK = 200_000  # candidate pairs checked at a time (bounds the temporaries)


def _near(idx: np.ndarray, comp: np.ndarray, fp: np.ndarray, nat: np.ndarray,
          tol: float) -> tuple[np.ndarray, ...]:
    """Near duplicates among distinct structures: ``max |Δfp| <= tol``, same composition.

    ``max |Δfp| <= tol`` implies that 4 chosen fingerprint values (spread over the used
    length, the same columns for a composition) each differ by at most ``tol``; so on a
    grid of cell width ``tol`` a pair sits in the same or an adjacent cell in all 4
    dimensions. Candidates come from a hash join over the neighbour cells (vectorised),
    then each is checked on all 32 values. No pair is missed.
    """
    n = idx.size
    m = np.minimum(nat.astype(np.int64) * (nat - 1) // 2, derived.FP_LEN)
    cols = np.floor((np.arange(_DIMS) + 0.5)[None, :] * m[:, None] / _DIMS).astype(np.int64)
    cols = np.minimum(cols, derived.FP_LEN - 1)
    vals = np.take_along_axis(fp, cols, axis=1)
    cells = np.floor(vals / tol).astype(np.int64)

    def key(c: np.ndarray) -> np.ndarray:
        k = comp.copy()
        for b in range(_DIMS):
            k = (k * np.uint64(0x9E3779B97F4A7C15)) ^ c[:, b].astype(np.uint64)
        return k

    base = key(cells)
    order = np.argsort(base, kind="stable")
    sk = base[order]
    run_end = np.searchsorted(sk, sk, "right")  # end of the run of equal keys at each position
    offsets = np.array(np.meshgrid(*[[-1, 0, 1]] * _DIMS)).T.reshape(-1, _DIMS)
    # a pair found with offset o is found again from its partner with -o: half suffices
    first = np.array([next((x for x in o if x), 0) for o in offsets])
    ii, jj = [], []
    for off in offsets[first >= 0]:  # one neighbour cell at a time: candidates are checked at once,
        q = key(cells + off)         # only confirmed pairs are kept (memory: one offset's candidates)
        lo = np.searchsorted(sk, q, "left")
        hit = (lo < n) & (sk[np.minimum(lo, n - 1)] == q)
        lo = lo[hit]
        cnt = run_end[lo] - lo
        src = np.flatnonzero(hit)
        i = np.repeat(src, cnt)
        start = np.repeat(lo - np.concatenate([[0], np.cumsum(cnt)[:-1]]), cnt)
        j = order[np.arange(i.size) + start]
        m = (i != j) & (comp[i] == comp[j])
        i, j = np.minimum(i[m], j[m]), np.maximum(i[m], j[m])
        ok = np.concatenate([np.abs(fp[i[c: c + _CHUNK]] - fp[j[c: c + _CHUNK]]).max(axis=1) <= tol
                             for c in range(0, i.size, _CHUNK)]) if i.size else np.zeros(0, bool)
        ii.append(i[ok])
        jj.append(j[ok])
    if not ii:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    code = np.unique(np.concatenate(ii) * n + np.concatenate(jj))
    i, j = code // n, code % n
    swap = idx[i] > idx[j]  # i: the earlier record of the pair
    i, j = np.where(swap, j, i), np.where(swap, i, j)
    dd = np.abs(fp[i] - fp[j]).max(axis=1) if i.size else np.zeros(0)
    # greedy in global-index order: a record is dropped if near an earlier kept one
    o = np.lexsort((idx[i], idx[j]))
    dropped: set[int] = set()
    drop, keep, dist = [], [], []
    for a, b, x in zip(i[o].tolist(), j[o].tolist(), dd[o].tolist(), strict=True):
        if a not in dropped and b not in dropped:
            dropped.add(b)
            drop.append(idx[b])
            keep.append(idx[a])
            dist.append(x)
    return np.asarray(drop, np.int64), np.asarray(keep, np.int64), np.asarray(dist)


def _write_task(task: ShardTask, run: str, spec: OutSpec, drop: np.ndarray) -> int:
    v = ShardView(task)
    w = sink(run, OUT, spec)
    skip = set((drop - task.start).tolist())
    for i in range(v.n):
        if i not in skip:
            v.copy_to(w, i)
    v.close()
    return v.n - len(skip)


def dedup_dataset(src: str | os.PathLike[str], out: str | os.PathLike[str], tolerance: float = 0.01,
                  engine: Engine | None = None, shard_bytes: int = 128 * 2**20,
                  partition_records: int = 50_000, overwrite: bool = False) -> dict[str, Any]:
    """Write the records of ``src`` minus exact and near duplicates to ``out`` (see module)."""
    if not tolerance >= 0:
        raise DataError(f"dedup tolerance {tolerance} must be >= 0 (Å)")
    engine = engine or Engine(progress=False)
    tasks, (m,) = plan([src])
    if m.schema != "molecular":
        raise DataError(f"{src}: data dedup needs a molecular dataset, not {m.schema!r}")
    spec = OutSpec(str(out), m.schema, m.compression, shard_bytes)
    prepare_outputs({OUT: spec}, overwrite, [src])
    parts = max(2 * engine.workers, -(-m.records // max(1, partition_records)), 1)
    run = new_run()
    scratch = spill.spill_dir(out, run)
    try:
        scratch.mkdir()
        scanned = engine.map(_scan_task, tasks, parts, str(scratch), run, label="dedup: scan", batch=True)
        spilled = spill.usage(scratch)
        per_part = [([s[p] for s in scanned],) for p in range(parts)]
        largest = max(sum(b.rows for b in blocks) for (blocks,) in per_part)
        res = engine.map(_match_part, list(range(parts)), tolerance, label="dedup: match", per_task=per_part)
        spill.remove(scratch)
        match = {k: np.concatenate([r[k] for r in res]) for k in ("drop", "keep", "exact", "dist")}
        order = np.argsort(match["drop"])
        drop = match["drop"][order]
        per = [(drop[slice(*np.searchsorted(drop, [t.start, t.start + t.info.records]))],) for t in tasks]
        engine.map(_write_task, tasks, run, spec, label="dedup: write", per_task=per, batch=True)
    except BaseException:
        spill.remove(scratch)
        engine.abort(run, {OUT: spec})
        raise
    keys = _keys(tasks, np.concatenate([drop, match["keep"]]))
    lines = [dumps_json({"key": keys[int(d)], "reason": "exact" if ex else "near",
                         "duplicate_of": keys[int(k)], "max_distance_diff": round(float(dd), 6)})
             for d, k, ex, dd in zip(drop, match["keep"][order], match["exact"][order], match["dist"][order],
                                     strict=True)]
    lin = lineage("dedup", [src], [m], {"tolerance": tolerance, "fingerprint": f"sorted distances per element pair, {derived.FP_LEN} values",
                                         "dropped": int(drop.size)})
    (man,) = commit(engine, run, {OUT: spec}, lin, "dedup").values()
    atomic_write_text(Path(out) / DROPPED, "".join(x + "\n" for x in lines))
    n_exact = int(match["exact"].sum())
    return {"input": str(src), "output": str(out), "read": m.records, "kept": man.records,
            "dropped_exact": n_exact, "dropped_near": int(drop.size) - n_exact,
            "tolerance": tolerance, "table": str(Path(out) / DROPPED), "partitions": parts,
            "spill_files": spilled[0], "spill_bytes": spilled[1], "largest_partition": largest}


def _keys(tasks: list[ShardTask], wanted: np.ndarray) -> dict[int, str]:
    """Keys of the records at global indices ``wanted`` (read from the shard indices)."""
    from convergent.data.index import strings
    from convergent.data.reader import ShardReader

    wanted = np.unique(wanted)
    out: dict[int, str] = {}
    for t in tasks:
        lo, hi = np.searchsorted(wanted, [t.start, t.start + t.info.records])
        if hi > lo:
            ks = strings(ShardReader(Path(t.dataset), t.info).meta.index, "key")
            for g in wanted[lo:hi].tolist():
                out[g] = ks[g - t.start]
    return out
