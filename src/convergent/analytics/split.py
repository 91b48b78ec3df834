"""`data split`: random, by molecule, by Bemis–Murcko scaffold or by composition.

Two Dask stages over the input shards, each a few Dask tasks of many shards (see
``Engine.map``'s ``batch``: by molecule the group stage is one task per worker, the write
stage one long task per worker and a tail of single shards). **group**:
each record's group key — the record itself (random: no stage), its molecule
(``molecule_id``, or the record itself when it has none; read from the shard index
alone), its molecule's Murcko scaffold (RDKit; from ``meta.smiles`` when the record
carries one, else from the geometry with ``rdDetermineBonds``; an acyclic molecule has no
scaffold and is its own group ``acyclic:<molecule_id>``), or its formula. Keys travel as
xxh3-64 hashes (:mod:`.groupkeys`), so the driver joins and counts them with numpy.
**write**: each record into its split's per-worker sink. Between them the driver assigns
whole groups to splits (seeded order, then a greedy fill to the requested fractions or
record counts; a vectorised cut of the same order past 20,000 groups), so no group is in
two splits. The leakage check is derived from what the write tasks appended: each task
copies its records split by split, and returns per split how many it appended and their
distinct groups and molecules (hashed, from the very index fields each record is written
with); the driver unions them, intersects the splits' hash arrays and checks the counts
against the committed manifests (no second pass over the written shards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from convergent.analytics import derived, splitchem
from convergent.analytics import groupkeys as gk
from convergent.analytics.batching import BALANCED, EVEN
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
from convergent.core.errors import DataError, InputError
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.data.indexscan import IndexScan

MODES = ("random", "molecule", "scaffold", "composition")
REPORT = "split.json"


def parse_sizes(text: str) -> dict[str, float | None]:
    """``"train=0.8,val=0.1,test=0.1"`` (fractions), ``"val=500,test=500,train=rest"``
    (record counts, one ``rest``) -> {name: size or None for rest}."""
    out: dict[str, float | None] = {}
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        name, eq, val = part.partition("=")
        name = name.strip()
        if not eq or not name or not name.replace("_", "").replace("-", "").isalnum():
            raise InputError(f"--splits {text!r}: {part!r} is not NAME=SIZE", hint="e.g. --splits train=0.8,val=0.1,test=0.1")
        if name in out:
            raise InputError(f"--splits {text!r}: split {name!r} named twice")
        if val.strip() == "rest":
            out[name] = None
            continue
        try:
            x = float(val)
        except ValueError:
            raise InputError(f"--splits {text!r}: size {val!r} of {name!r} is not a number or 'rest'") from None
        if not x >= 0 or x == float("inf"):
            raise InputError(f"--splits {text!r}: size of {name!r} must be >= 0")
        out[name] = x
    if len(out) < 2:
        raise InputError(f"--splits {text!r}: give at least two splits", hint="e.g. --splits train=0.9,val=0.1")
    if sum(v is None for v in out.values()) > 1:
        raise InputError(f"--splits {text!r}: at most one split can be 'rest'")
    return out


def _targets(sizes: dict[str, float | None], total: int) -> dict[str, int]:
    given = {k: v for k, v in sizes.items() if v is not None}
    fractions = all(v <= 1 for v in given.values()) and sum(given.values()) <= 1 + 1e-9 and any(
        v < 1 for v in given.values())
    t = {k: (round(v * total) if fractions else int(v)) for k, v in given.items()}
    rest = [k for k, v in sizes.items() if v is None]
    if rest:
        t[rest[0]] = max(0, total - sum(t.values()))
    elif fractions and given and abs(sum(given.values()) - 1) < 1e-9:
        last = list(sizes)[-1]
        t[last] = total - sum(v for k, v in t.items() if k != last)
    if sum(t.values()) > total:
        raise InputError(f"split sizes {t} ask for {sum(t.values())} records; the dataset has {total}")
    return {k: t[k] for k in sizes}


def scaffold_of(rec: dict[str, Any]) -> str:
    """Murcko scaffold SMILES of a record's molecule ('' when acyclic or undeterminable)."""
    from rdkit import Chem, RDLogger
    from rdkit.Chem.Scaffolds import MurckoScaffold

    RDLogger.DisableLog("rdApp.*")
    smi = (rec.get("meta") or {}).get("smiles")
    mol = Chem.MolFromSmiles(smi) if isinstance(smi, str) and smi else None
    if mol is None:
        from rdkit.Chem import rdDetermineBonds

        xyz = f"{len(rec['numbers'])}\n\n" + "".join(
            f"{derived.symbol(int(z))} {x:.6f} {y:.6f} {w:.6f}\n"
            for z, (x, y, w) in zip(rec["numbers"], rec["positions"], strict=True))
        mol = Chem.MolFromXYZBlock(xyz)
        if mol is None:
            return ""
        try:
            rdDetermineBonds.DetermineBonds(mol, charge=int(rec["charge"]))
        except Exception:  # bond orders undeterminable: connectivity is enough for rings
            try:
                rdDetermineBonds.DetermineConnectivity(mol)
            except Exception:
                return ""
    try:
        core = MurckoScaffold.GetScaffoldForMol(mol)
        return Chem.MolToSmiles(core) if core.GetNumAtoms() else ""
    except Exception:
        return ""


@dataclass
class ShardGroups:
    """One input shard's group keys (xxh3-64 hashes, see :mod:`.groupkeys`).

    ``keys``: the shard's distinct keys, sorted; ``codes``: each record's position in
    ``keys``. Molecule and scaffold modes: ``first``, the global index of each key's
    first record in the shard. Scaffold mode: ``keys`` are molecules, and per molecule
    ``scaffold`` (hash of the Murcko scaffold
    SMILES of that record, or of ``acyclic:<molecule>``) and ``acyclic``.
    """

    keys: np.ndarray
    codes: np.ndarray
    first: np.ndarray | None = None
    scaffold: np.ndarray | None = None
    acyclic: np.ndarray | None = None


def _group_task(task: ShardTask, mode: str) -> ShardGroups:
    if mode == "molecule":  # from the index alone, in pieces, no Python step per record
        with IndexScan(Path(task.dataset), task.info) as sc:
            h = np.concatenate([gk.molecule_keys(sc, a, min(a + gk.ROWS, sc.count))
                                for a in range(0, sc.count, gk.ROWS)] or [np.zeros(0, np.uint64)])
        keys, first, codes = np.unique(h, return_index=True, return_inverse=True)
        return ShardGroups(keys, codes.ravel().astype(np.int32), first=first.astype(np.int64) + task.start)
    v = ShardView(task)
    try:
        if mode == "composition":
            strs = [derived.formula(v.record(i)["numbers"]) for i in range(v.n)]
        else:
            strs = [gk.molecule_key(m, k) for m, k in zip(v.molecule_ids, v.keys, strict=True)]
        keys, first, codes = np.unique(gk.hash_list(strs), return_index=True, return_inverse=True)
        out = ShardGroups(keys, codes.ravel().astype(np.int32))
        if mode == "scaffold":  # a molecule's scaffold: from its first record
            scafs = [scaffold_of(v.record(i)) for i in first.tolist()]
            out.first = first.astype(np.int64) + task.start
            out.acyclic = np.array([not x for x in scafs], bool)
            out.scaffold = gk.hash_list([x or f"acyclic:{strs[i]}" for x, i in zip(scafs, first.tolist(), strict=True)])
        return out
    finally:
        v.close()


@dataclass
class Written:
    """What one write task appended to each split (lists indexed like the split names):
    record counts, distinct group numbers and distinct molecules (hashed
    :func:`.groupkeys.molecule_key`, sorted)."""

    records: list[int]
    groups: list[np.ndarray]
    molecules: list[np.ndarray]


_NONE = np.zeros(0, np.uint64)
_NO_GROUPS = np.zeros(0, np.int32)  # the dtype of the group numbers the write tasks get


def _write_task(task: ShardTask, run: str, specs: dict[str, OutSpec], names: list[str],
                where: np.ndarray, groups: np.ndarray | None) -> Written:
    """Copy each record into its split's sink, split by split (each sink gets its records
    in shard order, as before); per split, what was appended (see :class:`Written`)."""
    out = Written([0] * len(names), [_NO_GROUPS] * len(names), [_NONE] * len(names))
    v = ShardView(task)
    try:
        for s, n in enumerate(names):
            rows = np.flatnonzero(where == s)
            if not rows.size:
                continue
            w = sink(run, n, specs[n])
            idx = rows.tolist()
            for i in idx:
                v.copy_to(w, i)
            out.records[s] = len(idx)
            out.molecules[s] = gk.distinct_molecules(v.molecule_ids, v.keys, idx)
            if groups is not None:
                out.groups[s] = np.unique(groups[rows])
    finally:
        v.close()
    return out


GREEDY_MAX_GROUPS = 20_000  # above: each group is small against the targets, cut vectorised


def _assign(sizes: np.ndarray, targets: list[int], rng: np.random.Generator) -> np.ndarray:
    """Split number per group (-1: unused), in a seeded order of the groups.

    Up to :data:`GREEDY_MAX_GROUPS` groups: each group in turn to the split with the
    largest unfilled share that it does not overflow (else the largest unfilled share),
    until every split is full. With more groups (then each is small against the targets)
    the same order is cut at the cumulative targets: a group goes to the split whose
    interval holds its midpoint, so each split is within one group's size of its target.
    """
    order = rng.permutation(len(sizes))
    if len(sizes) <= GREEDY_MAX_GROUPS:
        return _greedy(sizes, targets, order)
    s = sizes[order].astype(np.float64)
    mid = np.cumsum(s) - s / 2
    split = np.searchsorted(np.cumsum(targets), mid, side="right")
    out = np.full(len(sizes), -1, np.int64)
    out[order] = np.where(split < len(targets), split, -1)
    return out


def _greedy(sizes: np.ndarray, targets: list[int], order: np.ndarray) -> np.ndarray:
    out = np.full(len(sizes), -1, np.int64)
    t = [int(x) for x in targets]
    filled = [0] * len(t)
    sz = sizes.tolist()
    ks = range(len(t))
    for g in order.tolist():
        room = [t[k] - filled[k] for k in ks]
        if max(room) <= 0:
            break
        share = [room[k] / max(t[k], 1) if t[k] > 0 else -np.inf for k in ks]
        fits = [k for k in ks if t[k] > 0 and room[k] >= sz[g]]
        s = max(fits or ks, key=lambda k: (share[k], -k))  # the first of equal shares
        out[g] = s
        filled[s] += sz[g]
    return out


def _records_split(split_g: np.ndarray, group_all: np.ndarray) -> np.ndarray:
    """Split number of each record (-1: unused): its group's."""
    return split_g[group_all].astype(np.int8)


@dataclass
class Scaffolds:
    """Molecule -> scaffold of its first record in the dataset (hashes, sorted by molecule)."""

    molecules: np.ndarray
    scaffold: np.ndarray
    acyclic: np.ndarray

    @classmethod
    def of(cls, res: list[ShardGroups]) -> Scaffolds:
        mol = np.concatenate([r.keys for r in res])
        first = np.concatenate([r.first for r in res])
        order = np.lexsort((first, mol))
        head = np.ones(len(order), bool)
        head[1:] = mol[order][1:] != mol[order][:-1]
        pick = order[head]
        return cls(mol[pick], np.concatenate([r.scaffold for r in res])[pick],
                   np.concatenate([r.acyclic for r in res])[pick])

    def lookup(self, mols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions of ``mols`` in :attr:`molecules` and whether each is there."""
        pos = np.searchsorted(self.molecules, mols).clip(max=max(len(self.molecules) - 1, 0))
        found = (self.molecules[pos] == mols) if len(self.molecules) else np.zeros(len(mols), bool)
        return pos, found


def _join(res: list[ShardGroups], mode: str
          ) -> tuple[np.ndarray, int, Scaffolds | None, list[np.ndarray]]:
    """Dataset-wide group number of every record (in task order), number of groups, the
    scaffolds (scaffold mode) and, per shard, the group number of each of its keys."""
    if not res:
        return np.zeros(0, np.int64), 0, None, []
    scaf = Scaffolds.of(res) if mode == "scaffold" else None
    keysets = [scaf.scaffold[scaf.lookup(r.keys)[0]] for r in res] if scaf else [r.keys for r in res]
    allk = np.concatenate(keysets) if keysets else np.zeros(0, np.uint64)
    gkeys, inv = np.unique(allk, return_inverse=True)
    parts = np.split(inv.ravel(), np.cumsum([len(k) for k in keysets])[:-1])
    group_all = np.concatenate([p[r.codes] for p, r in zip(parts, res, strict=True)] or [np.zeros(0, np.int64)])
    return group_all, len(gkeys), scaf, parts


def split_dataset(src: str | os.PathLike[str], out: str | os.PathLike[str], mode: str = "molecule",
                  sizes: dict[str, float | None] | str = "train=0.8,val=0.1,test=0.1", seed: int = 0,
                  engine: Engine | None = None, shard_bytes: int = 128 * 2**20,
                  overwrite: bool = False) -> dict[str, Any]:
    """Write ``out/<split>/`` datasets and ``out/split.json`` (sizes, leakage check)."""
    if mode not in MODES:
        raise InputError(f"--by {mode!r}: unknown split mode", hint=f"use one of: {', '.join(MODES)}")
    if isinstance(sizes, str):
        sizes = parse_sizes(sizes)
    engine = engine or Engine(progress=False)
    tasks, (m,) = plan([src])
    if m.schema != "molecular" and mode in ("scaffold", "composition"):
        raise DataError(f"{src}: split --by {mode} needs a molecular dataset")
    names = list(sizes)
    targets = _targets(sizes, m.records)
    specs = {n: OutSpec(str(Path(out) / n), m.schema, m.compression, shard_bytes) for n in names}
    if (Path(out) / REPORT).exists() and not overwrite:
        raise DataError(f"split already exists: {out}", hint="pass --overwrite to replace it")
    made = [Path(p) for p in [*(sp.path for sp in specs.values()), out] if not Path(p).exists()]
    prepare_outputs(specs, overwrite, [src])
    rng = np.random.default_rng(seed)
    tlist = [targets[n] for n in names]
    run = new_run()
    try:
        if mode == "random":
            perm = rng.permutation(m.records)
            where_all = np.full(m.records, -1, np.int8)
            cuts = np.cumsum([0, *tlist])
            for s in range(len(names)):
                where_all[perm[cuts[s]: cuts[s + 1]]] = s
            group_all, n_groups, scaf, chem = None, m.records, None, None
        else:
            # by molecule: from the index alone, a few ms per shard: one task per worker
            res = engine.map(_group_task, tasks, mode, label=f"split: group by {mode}",
                             batch=EVEN if mode == "molecule" else True)
            group_all, n_groups, scaf, group_of = _join(res, mode)
            split_g = _assign(np.bincount(group_all, minlength=n_groups), tlist, rng)
            where_all = _records_split(split_g, group_all)
            chem = _chemistry(engine, tasks, src, mode, res, split_g, group_of)
        # a molecule split's groups are the molecules the write tasks report anyway: no
        # group number per record travels to them (4 bytes a record through the scheduler)
        ship = group_all is not None and mode != "molecule"
        per = [(where_all[t.start: t.start + t.info.records],
                group_all[t.start: t.start + t.info.records].astype(np.int32) if ship else None)
               for t in tasks]
        # a write task's cost follows its records: one long run per worker and a short tail
        written = engine.map(_write_task, tasks, run, specs, names, label="split: write", per_task=per,
                             batch=BALANCED)
    except BaseException:
        engine.abort(run, specs)
        for d in made:  # the split directories this call created, left empty
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise
    lin = lineage("split", [src], [m], {"by": mode, "splits": sizes, "seed": seed})
    mans = commit(engine, run, specs, lin, "split")
    report = {"input": str(src), "output": str(out), "by": mode, "seed": seed,
              "requested": targets, "records": {n: mans[n].records for n in names},
              "groups": n_groups,
              "leakage": leakage(names, mode, written, scaf, {n: mans[n].records for n in names})}
    if chem is not None:
        report["leakage"] = {**report["leakage"], **chem}
    atomic_write_text(Path(out) / REPORT, dumps_json(report, indent=1) + "\n")
    return report


def _chemistry(engine: Engine, tasks: list[ShardTask], src: Any, mode: str,
               res: list[ShardGroups], split_g: np.ndarray,
               group_of: list[np.ndarray]) -> dict[str, Any] | None:
    """By molecule or scaffold: :func:`.splitchem.check_chemistry` of the assignment (one
    identity per distinct molecule, computed once), refusing one identity in two splits."""
    if mode not in ("molecule", "scaffold"):
        return None
    uk, pick, chem = splitchem.identities(engine, tasks, [r.keys for r in res],
                                          [r.first for r in res])
    allg = np.concatenate(group_of) if group_of else np.zeros(0, np.int64)
    return splitchem.check_chemistry(src, mode, uk, chem, allg[pick], split_g)


def leakage(names: list[str], mode: str, written: list[Written], scaffolds: Scaffolds | None = None,
            committed: dict[str, int] | None = None) -> dict[str, Any]:
    """Groups, molecules and scaffolds found in more than one split, from what the write
    tasks appended (:class:`Written`). ``committed``: records per split in the committed
    manifests, which must equal the records appended (DataError otherwise)."""
    if committed is not None:
        appended = {n: sum(w.records[s] for w in written) for s, n in enumerate(names)}
        if appended != committed:
            raise DataError(f"split: the write tasks appended {appended} records, the committed "
                            f"outputs hold {committed}")
    per = {n: np.unique(np.concatenate([w.molecules[s] for w in written] or [_NONE]))
           for s, n in enumerate(names)}
    rep: dict[str, Any] = {"molecules_in_two_splits": gk.in_two(list(per.values()))}
    if mode == "molecule":  # a group is a molecule (the same hashed key)
        rep["molecule_groups_in_two_splits"] = rep["molecules_in_two_splits"]
    elif mode != "random":
        groups = [np.unique(np.concatenate([w.groups[s] for w in written] or [_NO_GROUPS]))
                  for s in range(len(names))]
        rep[f"{mode}_groups_in_two_splits"] = gk.in_two(groups)
    if mode == "scaffold":
        sc = []
        for m in per.values() if scaffolds is not None else []:
            pos, found = scaffolds.lookup(m)
            ring = found & ~scaffolds.acyclic[pos] if len(scaffolds.molecules) else found
            sc.append(np.unique(scaffolds.scaffold[pos][ring]) if ring.any() else _NONE)
        rep["scaffolds_in_two_splits"] = gk.in_two(sc)
    key = {"random": None, "molecule": "molecules_in_two_splits", "scaffold": "scaffolds_in_two_splits",
           "composition": "composition_groups_in_two_splits"}[mode]
    rep["ok"] = True if key is None else rep[key] == 0 and rep.get(f"{mode}_groups_in_two_splits", 0) == 0
    return rep
