"""`data filter` and `data merge`: record-wise map over shards into per-worker sinks."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
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
    sink,
)
from convergent.analytics.where import compile_where
from convergent.core.errors import DataError
from convergent.data.reader import ShardReader

OUT = "out"


def _epa_moments(tasks: Sequence[ShardTask]) -> tuple[float, float]:
    """Mean and std of the energy per atom, from the shard indices only."""
    n = s = ss = 0.0
    for t in tasks:
        cols = ShardReader(Path(t.dataset), t.info).meta.index
        at = cols["n_atoms"].astype(np.float64)
        ok = np.isfinite(cols["energy"]) & (at > 0)
        e = cols["energy"][ok] / at[ok]
        n, s, ss = n + e.size, s + e.sum(), ss + (e * e).sum()
    if n == 0:
        return 0.0, 1.0
    mean = s / n
    return mean, math.sqrt(max(ss / n - mean * mean, 0.0)) or 1.0


def _filter_task(task: ShardTask, run: str, spec: OutSpec, text: str, epa: tuple[float, float]) -> dict[str, int]:
    where = compile_where(text)
    v = ShardView(task)
    w = sink(run, OUT, spec)
    kept = 0
    for i in range(v.n):
        r = v.record(i)
        vals = derived.values(r)
        vals["e_per_atom_z"] = (vals["e_per_atom"] - epa[0]) / epa[1]
        if where.evaluate(vals):
            v.copy_to(w, i)
            kept += 1
    v.close()
    return {"read": v.n, "kept": kept}


def filter_dataset(src: str | os.PathLike[str], out: str | os.PathLike[str], where: str,
                   engine: Engine | None = None, shard_bytes: int = 128 * 2**20,
                   overwrite: bool = False) -> dict[str, Any]:
    """Keep the records of ``src`` for which ``where`` is true; write them to ``out``."""
    compile_where(where)  # a bad expression fails before anything is read or made
    engine = engine or Engine(progress=False)
    tasks, (m,) = plan([src])
    if m.schema != "molecular":
        raise DataError(f"{src}: data filter needs a molecular dataset, not {m.schema!r}")
    spec = OutSpec(str(out), m.schema, m.compression, shard_bytes)
    prepare_outputs({OUT: spec}, overwrite, [src])
    epa = _epa_moments(tasks) if "e_per_atom_z" in compile_where(where).names else (0.0, 1.0)
    run = new_run()
    try:
        res = engine.map(_filter_task, tasks, run, spec, where, epa, label="filter")
    except BaseException:
        engine.abort(run, {OUT: spec})
        raise
    lin = lineage("filter", [src], [m], {"where": where, "e_per_atom_mean": epa[0], "e_per_atom_std": epa[1]})
    (man,) = commit(engine, run, {OUT: spec}, lin, "filter").values()
    read = sum(r["read"] for r in res)
    return {"input": str(src), "output": str(out), "read": read, "kept": man.records,
            "dropped": read - man.records, "shards": len(man.shards), "where": where}


def _merge_task(task: ShardTask, run: str, spec: OutSpec, prefixes: list[str] | None) -> int:
    v = ShardView(task)
    w = sink(run, OUT, spec)
    if v.schema != spec.schema:
        raise DataError(f"{task.dataset}: cannot merge a {v.schema!r} dataset into a {spec.schema!r} one")
    for i in range(v.n):
        if prefixes is None:
            v.copy_to(w, i)
        else:
            r = v.record(i)
            r["key"] = prefixes[task.input_no] + r["key"]
            w.write(r)
    v.close()
    return v.n


def merge_datasets(inputs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str],
                   engine: Engine | None = None, shard_bytes: int = 128 * 2**20,
                   compression: str | None = None, prefix_keys: bool = False,
                   overwrite: bool = False) -> dict[str, Any]:
    """Concatenate ``inputs`` into one re-sharded dataset at ``out``; keys must be distinct
    across inputs unless ``prefix_keys`` (then key ``k`` of input ``i`` becomes ``<i>:k``)."""
    if len(inputs) < 1:
        raise DataError("data merge needs at least one input dataset")
    engine = engine or Engine(progress=False)
    tasks, manifests = plan(inputs)
    schemas = {m.schema for m in manifests}
    if len(schemas) > 1:
        raise DataError(f"cannot merge datasets of different schemas: {sorted(schemas)}")
    comp = compression or manifests[0].compression
    spec = OutSpec(str(out), manifests[0].schema, comp, shard_bytes)
    prepare_outputs({OUT: spec}, overwrite, inputs)
    prefixes = [f"{i}:" for i in range(len(inputs))] if prefix_keys else None
    run = new_run()
    try:
        engine.map(_merge_task, tasks, run, spec, prefixes, label="merge")
    except BaseException:
        engine.abort(run, {OUT: spec})
        raise
    lin = lineage("merge", inputs, manifests, {"prefix_keys": prefix_keys, "compression": comp,
                                                 "shard_bytes": shard_bytes})
    (man,) = commit(engine, run, {OUT: spec}, lin, "merge", check_keys=not prefix_keys and len(inputs) > 1).values()
    return {"inputs": [str(i) for i in inputs], "output": str(out), "records": man.records,
            "shards": len(man.shards), "bytes": man.bytes}
