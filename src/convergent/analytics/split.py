"""`data split`: random, by molecule, by Bemis–Murcko scaffold or by composition.

Two Dask stages. **group** (one task per shard): each record's group key — the record
itself (random), its ``molecule_id``, its molecule's Murcko scaffold (RDKit; from
``meta.smiles`` when the record carries one, else from the geometry with
``rdDetermineBonds``; an acyclic molecule has no scaffold and is its own group
``acyclic:<molecule_id>``), or its formula. **write** (one task per shard): each record
into its split's per-worker sink. Between them the driver assigns whole groups to splits
(seeded shuffle, then greedy fill to the requested fractions or record counts), so no
group is in two splits; the leakage check reads it back from what was written.
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
    sink,
)
from convergent.data.index import strings
from convergent.data.reader import ShardReader
from convergent.errors import DataError, InputError
from convergent.fsutil import atomic_write_text

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


_SCAFFOLDS: dict[str, str] = {}


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


def _group_task(task: ShardTask, mode: str) -> dict[str, Any]:
    """Group key codes of a shard's records: {"keys": unique keys, "codes": int32[n]}."""
    if mode == "molecule":
        rd = ShardReader(Path(task.dataset), task.info)
        keys = strings(rd.meta.index, "molecule_id")
        keys = [k or f"record:{r}" for k, r in zip(keys, strings(rd.meta.index, "key"), strict=True)]
    else:
        v = ShardView(task)
        keys = []
        first: dict[str, tuple[int, str]] = {}
        for i in range(v.n):
            if mode == "scaffold":
                mid = v.molecule_ids[i] or f"record:{v.keys[i]}"
                if mid not in first:  # a molecule's scaffold: from its first record
                    first[mid] = (task.start + i, scaffold_of(v.record(i)))
                keys.append(mid)
            else:
                keys.append(derived.formula(v.record(i)["numbers"]))
        v.close()
    uniq, codes = np.unique(np.asarray(keys, dtype=object).astype(str), return_inverse=True) if keys else (
        np.zeros(0, str), np.zeros(0, np.int64))
    mols = first if mode == "scaffold" else {}
    return {"keys": uniq.tolist(), "codes": codes.astype(np.int32), "molecules": mols}


def _write_task(task: ShardTask, run: str, specs: dict[str, OutSpec], names: list[str],
                where: np.ndarray, groups: np.ndarray) -> dict[str, list[int]]:
    v = ShardView(task)
    ws = {}
    wrote: dict[str, set[int]] = {n: set() for n in names}
    for i in range(v.n):
        s = int(where[i])
        if s < 0:
            continue
        name = names[s]
        if name not in ws:
            ws[name] = sink(run, name, specs[name])
        v.copy_to(ws[name], i)
        wrote[name].add(int(groups[i]))
    v.close()
    return {n: sorted(g) for n, g in wrote.items()}


def _assign(sizes: np.ndarray, targets: list[int], rng: np.random.Generator) -> np.ndarray:
    """Split number per group (-1: unused): seeded order, each group to the split with the
    largest unfilled share that it does not overflow (else the largest unfilled share)."""
    out = np.full(len(sizes), -1, np.int64)
    filled = np.zeros(len(targets), np.int64)
    t = np.asarray(targets, np.int64)
    for g in rng.permutation(len(sizes)):
        room = t - filled
        if room.max() <= 0:
            break
        share = np.where(t > 0, room / np.maximum(t, 1), -np.inf)
        fits = (room >= sizes[g]) & (t > 0)
        cand = np.flatnonzero(fits)
        s = int(cand[np.argmax(share[cand])]) if cand.size else int(np.argmax(share))
        out[g] = s
        filled[s] += sizes[g]
    return out


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
            group_all = np.arange(m.records)
            gkeys: list[str] = []
            molmap: dict[str, str] = {}
        else:
            res = engine.map(_group_task, tasks, mode, label=f"split: group by {mode}")
            molmap = {}
            if mode == "scaffold":  # molecule -> scaffold of its first record in the dataset
                best: dict[str, tuple[int, str]] = {}
                for r in res:
                    for mol, (g, sc) in r["molecules"].items():
                        if mol not in best or g < best[mol][0]:
                            best[mol] = (g, sc)
                molmap = {mol: sc or f"acyclic:{mol}" for mol, (_, sc) in best.items()}
                for r in res:
                    r["keys"] = [molmap[k] for k in r["keys"]]
            gkeys = sorted({k for r in res for k in r["keys"]})
            gid = {k: i for i, k in enumerate(gkeys)}
            group_all = np.concatenate([np.asarray([gid[k] for k in r["keys"]], np.int64)[r["codes"]]
                                        if len(r["codes"]) else np.zeros(0, np.int64) for r in res])
            sizes_g = np.bincount(group_all, minlength=len(gkeys))
            split_g = _assign(sizes_g, tlist, rng)
            where_all = split_g[group_all].astype(np.int8)
        per = [(where_all[t.start: t.start + t.info.records], group_all[t.start: t.start + t.info.records])
               for t in tasks]
        written = engine.map(_write_task, tasks, run, specs, names, label="split: write", per_task=per)
    except BaseException:
        engine.abort(run, specs)
        raise
    lin = lineage("split", [src], [m], {"by": mode, "splits": sizes, "seed": seed})
    mans = commit(engine, run, specs, lin, "split")
    report = {"input": str(src), "output": str(out), "by": mode, "seed": seed,
              "requested": targets, "records": {n: mans[n].records for n in names},
              "groups": len(gkeys) if mode != "random" else m.records,
              "leakage": leakage(out, names, mode, written, molmap, engine)}
    atomic_write_text(Path(out) / REPORT, json.dumps(report, indent=1) + "\n")
    return report


def _molecules_task(task: ShardTask) -> list[str]:
    """The distinct molecule ids of one written shard (from its index)."""
    from convergent.data import format as fmt

    rd = ShardReader(Path(task.dataset), task.info)
    col = "molecule_id" if fmt.SCHEMA_NAMES[rd.meta.schema] == "molecular" else "key"
    return sorted(set(strings(rd.meta.index, col)))


def leakage(out: str | os.PathLike[str], names: list[str], mode: str,
            written: list[dict[str, list[int]]], molmap: dict[str, str],
            engine: Engine | None = None) -> dict[str, Any]:
    """Groups, molecules and scaffolds found in more than one split, from what was written
    (write tasks' group lists, and the output datasets' molecule ids read back by one task
    per written shard)."""
    groups: dict[str, set[int]] = {n: set() for n in names}
    for w in written:
        for n, g in w.items():
            groups[n].update(g)
    mols: dict[str, set[str]] = {n: set() for n in names}
    tasks, _ = plan([Path(out) / n for n in names])
    for t, ids in zip(tasks, (engine or Engine(progress=False)).map(
            _molecules_task, tasks, label="split: leakage check"), strict=True):
        mols[names[t.input_no]].update(ids)
    rep: dict[str, Any] = {}

    def overlap(sets: dict[str, set]) -> int:
        seen: dict[Any, str] = {}
        bad = set()
        for n, s in sets.items():
            for x in s:
                if x in seen and seen[x] != n:
                    bad.add(x)
                seen.setdefault(x, n)
        return len(bad)

    rep["molecules_in_two_splits"] = overlap(mols)
    if mode != "random":
        rep[f"{mode}_groups_in_two_splits"] = overlap(groups)
    if mode == "scaffold":
        sc = {n: {molmap.get(x, "") for x in s} - {""} for n, s in mols.items()}
        sc = {n: {x for x in s if not x.startswith("acyclic:")} for n, s in sc.items()}
        rep["scaffolds_in_two_splits"] = overlap(sc)
    key = {"random": None, "molecule": "molecules_in_two_splits", "scaffold": "scaffolds_in_two_splits",
           "composition": "composition_groups_in_two_splits"}[mode]
    rep["ok"] = True if key is None else rep[key] == 0 and rep.get(f"{mode}_groups_in_two_splits", 0) == 0
    return rep
