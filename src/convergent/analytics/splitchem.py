"""A split's leakage check by chemistry: one identity per molecule, never in two splits.

A dataset's molecule ids may not follow its chemistry (a tool that numbers frames gives
every frame its own "molecule"), and a split by those ids then puts one molecule's frames
on both sides while its id-based check passes. Before writing, :func:`check_chemistry`
computes the chemical identity (:func:`~convergent.data.identity.chemical_id`: formula and
bonded structure) of each distinct molecule **once**, from its first record in the
dataset (a small Dask stage: one RDKit call per molecule, not per record or shard; an id
``data pack`` derived from the same formula is taken as it is), and refuses an assignment
that puts one identity in two splits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from convergent.analytics import derived
from convergent.analytics.engine import Engine, ShardTask, ShardView
from convergent.core.errors import DataError
from convergent.data.identity import chemical_id


@dataclass(frozen=True)
class ChemRows:
    """Records ``rows`` (shard-local) of one shard, to identify. Not a ShardTask, so the
    engine runs it on any worker: the RDKit work spreads over the pool even where every
    molecule's first record sits in one shard (a few records are read straight from it)."""

    task: ShardTask
    rows: list[int]


def _chem_task(item: ChemRows) -> list[str]:
    """Chemical identity of the records of ``item`` ('' where none is determined)."""
    task, rows = item.task, item.rows
    v = ShardView(task)
    try:
        out = []
        for i in rows:
            rec = v.record(i)
            mid = v.molecule_ids[i] or ""
            if re.fullmatch(re.escape(derived.formula(rec["numbers"])) + r"-[0-9a-f]{10}", mid):
                out.append(mid)
                continue
            periodic = rec.get("cell") is not None and bool(np.any(rec.get("pbc", False)))
            out.append(chemical_id(rec["numbers"], rec["positions"], periodic=periodic) or "")
        return out
    finally:
        v.close()


def identities(engine: Engine, tasks: list[ShardTask], keys: list[np.ndarray],
               first: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(distinct molecule keys, where each first stands in the shards' keys concatenated,
    their chemical identities): ``keys[i]`` / ``first[i]`` are shard ``i``'s molecule keys
    and the global index of each one's first record there."""
    allk = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
    allf = np.concatenate(first) if first else np.zeros(0, np.int64)
    uk, pick = np.unique(allk, return_index=True)
    where = allf[pick]
    starts = np.array([t.start for t in tasks], np.int64)
    shard = np.searchsorted(starts, where, side="right") - 1
    # chunks of about equal size, 4 per worker, never across shards
    size = max(1, -(-len(uk) // (4 * max(1, engine.workers))))
    items, owners = [], []
    for s in np.unique(shard).tolist():
        mine = np.flatnonzero(shard == s)
        for c in range(0, len(mine), size):
            part = mine[c:c + size]
            items.append(ChemRows(tasks[s], [int(x) for x in where[part] - starts[s]]))
            owners.append(part)
    res = engine.map(_chem_task, items, label="split: chemistry")
    chem = [""] * len(uk)
    for part, got in zip(owners, res, strict=True):
        for j, c in zip(part.tolist(), got, strict=True):
            chem[j] = c
    return uk, pick, chem


def check_chemistry(src: Any, mode: str, uk: np.ndarray, chem: list[str], group_of_key: np.ndarray,
                    split_g: np.ndarray) -> dict[str, Any]:
    """Refuse (DataError, nothing written yet) when one identity's molecules were assigned
    to two splits; else the counts for the leakage report. ``group_of_key``: the group
    number of each of ``uk``; ``split_g``: each group's split (-1: unused)."""
    splits: dict[str, set[int]] = {}
    for c, sp in zip(chem, split_g[group_of_key].tolist(), strict=True):
        if c and sp >= 0:
            splits.setdefault(c, set()).add(sp)
    both = sorted(c for c, sp in splits.items() if len(sp) > 1)
    if both:
        raise DataError(
            f"{src}: split --by {mode} would put {len(both)} chemical "
            f"{'identity' if len(both) == 1 else 'identities'} in two splits (molecules with "
            f"other ids but the same formula and bonds, e.g. "
            f"{', '.join(c.rsplit('-', 1)[0] for c in both[:3])}); nothing written",
            hint="the dataset's molecule ids do not follow its chemistry: pack it again with "
                 "`convergent data pack` (ids by chemistry), or split --by composition")
    return {"chemical_ids_in_two_splits": 0, "chemical_ids_checked": sum(bool(c) for c in chem),
            "chemical_ids_undetermined": sum(not c for c in chem)}
