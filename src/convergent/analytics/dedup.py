"""`data dedup`: exact duplicates by structure hash, near duplicates by geometry fingerprint.

Three Dask stages:

1. **scan** (one task per shard): per record its global index, structure hash,
   composition hash and fingerprint (:func:`~convergent.analytics.derived.fingerprint`,
   32 floats), bucketed by composition hash into ``P`` partitions (P grows with the
   dataset, so one partition's arrays stay bounded).
2. **match** (one task per partition): within each composition, exact duplicates (same
   structure hash) and near duplicates: ``max |fp_a - fp_b| <= tolerance`` (Å). Candidates
   come from a sliding window on the fingerprint sum (``|Σ Δ| <= 32 * tolerance`` is
   implied), then all 32 values are checked. The first record (lowest global index)
   of a cluster is kept; a record is dropped if it matches an earlier kept one.
3. **write** (one task per shard): the kept records into per-worker sinks.

Output: the kept set (a dataset) and ``dropped.jsonl`` in it (key, reason, kept key,
distance) listing every dropped record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from convergent.analytics import derived
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
from convergent.errors import DataError
from convergent.fsutil import atomic_write_text

OUT = "kept"
DROPPED = "dropped.jsonl"
_MASK = np.uint64(2**62 - 1)


def _scan_task(task: ShardTask, parts: int) -> list[dict[str, np.ndarray]]:
    v = ShardView(task)
    n = v.n
    gidx = np.arange(task.start, task.start + n, dtype=np.int64)
    sh = np.zeros(n, np.uint64)
    comp = np.zeros(n, np.uint64)
    fp = np.zeros((n, derived.FP_LEN), np.float32)
    for i in range(n):
        r = v.record(i)
        sh[i] = derived.structure_hash(r)
        comp[i] = derived.composition_hash(r)
        fp[i] = derived.fingerprint(r["numbers"], r["positions"])
    v.close()
    groups = shard_groups((comp & _MASK).astype(np.int64), parts)
    return [{"idx": gidx[g], "hash": sh[g], "comp": comp[g], "fp": fp[g]} for g in groups]


def _match_task(pieces: list[dict[str, np.ndarray]], tol: float) -> dict[str, np.ndarray]:
    """Dropped global indices of one partition, each with its reason and kept partner."""
    idx = np.concatenate([p["idx"] for p in pieces])
    if idx.size == 0:
        return {"drop": np.zeros(0, np.int64), "keep": np.zeros(0, np.int64),
                "exact": np.zeros(0, bool), "dist": np.zeros(0)}
    hs = np.concatenate([p["hash"] for p in pieces])
    comp = np.concatenate([p["comp"] for p in pieces])
    fp = np.concatenate([p["fp"] for p in pieces]).astype(np.float64)
    order = np.lexsort((idx, comp))
    idx, hs, comp, fp = idx[order], hs[order], comp[order], fp[order]
    drop, keep, exact, dist = [], [], [], []
    bounds = np.flatnonzero(np.diff(comp)) + 1
    for g in np.split(np.arange(idx.size), bounds):
        dropped = np.zeros(g.size, bool)
        # exact: same structure hash -> keep the lowest index
        gh = hs[g]
        o = np.lexsort((idx[g], gh))
        first = o[0] if o.size else 0
        for k in range(1, o.size):
            if gh[o[k]] == gh[o[k - 1]]:
                dropped[o[k]] = True
                drop.append(idx[g][o[k]])
                keep.append(idx[g][first])
                exact.append(True)
                dist.append(0.0)
            else:
                first = o[k]
        if tol <= 0:
            continue
        # near: sliding window on the fingerprint sum, survivors of the exact pass only
        live = np.flatnonzero(~dropped)
        f = fp[g][live]
        s = f.sum(axis=1)
        so = np.argsort(s, kind="stable")
        width = derived.FP_LEN * tol
        hi = np.searchsorted(s[so], s[so] + width, side="right")
        pairs = []
        for a in range(so.size):
            if hi[a] - a <= 1:
                continue
            cand = so[a + 1: hi[a]]
            d = np.abs(f[cand] - f[so[a]]).max(axis=1)
            for c, dd in zip(cand[d <= tol].tolist(), d[d <= tol].tolist(), strict=True):
                pairs.append((live[so[a]], live[c], dd))
        if not pairs:
            continue
        gi = idx[g]
        # greedy in global-index order: a record is dropped if near an earlier kept one
        pairs = [(i, j, dd) if gi[i] < gi[j] else (j, i, dd) for i, j, dd in pairs]
        pairs.sort(key=lambda t: (gi[t[1]], gi[t[0]]))
        for i, j, dd in pairs:
            if not dropped[i] and not dropped[j]:
                dropped[j] = True
                drop.append(gi[j])
                keep.append(gi[i])
                exact.append(False)
                dist.append(dd)
    return {"drop": np.asarray(drop, np.int64), "keep": np.asarray(keep, np.int64),
            "exact": np.asarray(exact, bool), "dist": np.asarray(dist, np.float64)}


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
                  partition_records: int = 200_000, overwrite: bool = False) -> dict[str, Any]:
    """Write the records of ``src`` minus exact and near duplicates to ``out`` (see module)."""
    if not tolerance >= 0:
        raise DataError(f"dedup tolerance {tolerance} must be >= 0 (Å)")
    engine = engine or Engine(progress=False)
    tasks, (m,) = plan([src])
    if m.schema != "molecular":
        raise DataError(f"{src}: data dedup needs a molecular dataset, not {m.schema!r}")
    spec = OutSpec(str(out), m.schema, m.compression, shard_bytes)
    prepare_outputs({OUT: spec}, overwrite)
    parts = max(engine.workers, -(-m.records // max(1, partition_records)), 1)
    run = new_run()
    try:
        match = _match(engine, tasks, parts, tolerance)
        order = np.argsort(match["drop"])
        drop = match["drop"][order]
        per = [(drop[slice(*np.searchsorted(drop, [t.start, t.start + t.info.records]))],) for t in tasks]
        engine.map(_write_task, tasks, run, spec, label="dedup: write", per_task=per)
    except BaseException:
        engine.abort(run, {OUT: spec})
        raise
    keys = _keys(tasks, np.concatenate([drop, match["keep"]]))
    lines = [json.dumps({"key": keys[int(d)], "reason": "exact" if ex else "near",
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
            "tolerance": tolerance, "table": str(Path(out) / DROPPED), "partitions": parts}


def _match(engine: Engine, tasks: list[ShardTask], parts: int, tol: float) -> dict[str, np.ndarray]:
    """Stages 1 and 2 (scan, match); on a cluster the pieces move worker to worker."""
    if engine.client is None:
        scanned = engine.map(_scan_task, tasks, parts, label="dedup: scan")
        res = [_match_task([s[p] for s in scanned], tol) for p in range(parts)]
    else:
        client = engine.client
        tasks = engine.with_cache(tasks)
        placed = engine.placed = engine._placement(tasks)
        scanned = [client.submit(_scan_task, t, parts, pure=False, workers=placed.get(k),
                                 allow_other_workers=False if placed.get(k) else None)
                   for k, t in enumerate(tasks)]
        _progress(engine, scanned, "dedup: scan")
        pieces = [[client.submit(_pick, s, p, pure=False) for s in scanned] for p in range(parts)]
        futs = [client.submit(_match_task, pc, tol, pure=False) for pc in pieces]
        _progress(engine, futs, "dedup: match")
        res = client.gather(futs)
        del scanned, pieces
    cat = {k: np.concatenate([r[k] for r in res]) for k in ("drop", "keep", "exact", "dist")}
    return cat


def _pick(scanned: list[dict[str, np.ndarray]], p: int) -> dict[str, np.ndarray]:
    return scanned[p]


def _progress(engine: Engine, futs: list[Any], label: str) -> None:
    from distributed import wait
    from rich.console import Console
    from rich.progress import Progress

    err = Console(stderr=True)
    with Progress(transient=True, console=err, disable=not (engine.progress and err.is_terminal)) as bar:
        t = bar.add_task(label, total=len(futs))
        from distributed import as_completed

        for f in as_completed(futs):
            if f.status == "error":
                f.result()
            bar.advance(t)
    wait(futs)


def _keys(tasks: list[ShardTask], wanted: np.ndarray) -> dict[int, str]:
    """Keys of the records at global indices ``wanted`` (read from the shard indices)."""
    from convergent.data import format as fmt
    from convergent.data.reader import ShardReader

    wanted = np.unique(wanted)
    out: dict[int, str] = {}
    for t in tasks:
        lo, hi = np.searchsorted(wanted, [t.start, t.start + t.info.records])
        if hi > lo:
            ks = fmt.strings(ShardReader(Path(t.dataset), t.info).meta.index, "key")
            for g in wanted[lo:hi].tolist():
                out[g] = ks[g - t.start]
    return out
