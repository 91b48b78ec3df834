"""``nci2k_dft``: PySCF B3LYP/6-31G* labels on a small-molecule subset of nci2k, the
transfer bench's DFT set (bench/models/transfer.py).

Structures: nci2k structures (conformers and xTB-MD frames, bench/models/nci2k.py; their
geometries as they are) of at most ``max_atoms`` atoms. ``max_atoms`` is the cut that
``measure`` chose: B3LYP's cost grows steeply with size, so it times single points
(energy + forces, one core) across atom counts, fits ``seconds = a * atoms**b`` and takes
the largest cut whose selection is predicted to label within ``budget_s`` on ``workers``
Dask workers. Selection (:func:`select`, seeded): the structures under the cut grouped by
Murcko scaffold (an acyclic compound is its own group), dealt round-robin over the groups
(then over each group's compounds), so no scaffold dominates; the split
(:func:`split`): fold ``test_fold`` of the 5-fold scaffold-grouped split of nci2k
(:func:`bench.models.nci2k.group_folds`) is the test set — held-out scaffolds.

Labelled by convergent's simulation campaign (:func:`convergent.sim.campaign.run_campaign`)
on a Dask LocalCluster of ``workers`` single-threaded workers, reading the selection as an
extxyz (``rattle`` with sigma 0 = the structures as they are). The campaign resumes from
the keys its dataset holds, so a killed build continues and a re-run skips what is done.
Work files live under ``bench/data/nci2k_dft_v1/`` (git-ignored); when every structure is
labelled (or quarantined) the set is written as ONE extxyz plus ``settings.json`` into the
tracked ``bench/datasets/nci2k_dft_v1/``. Energies eV, forces eV/Å.

    nice -n 19 .venv/bin/python -m bench.models.nci2k_dft measure   # writes measure.json
    nice -n 19 .venv/bin/python -m bench.models.nci2k_dft build     # resumable
    .venv/bin/python -m bench.models.nci2k_dft status
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.paths import REPO
from bench.models.molbench import DATA, write_extxyz
from bench.models.nci2k import group_folds, scaffold_group

ROOT = DATA / "nci2k_dft_v1"  # work files (git-ignored)
DATASET = REPO / "bench" / "datasets" / "nci2k_dft_v1"  # the committed set
MEASURE_SIZES = (5, 8, 10, 12, 14, 16)


@dataclass(frozen=True)
class DftSettings:
    """Everything that determines the set (a change needs a new ``ROOT``/``DATASET``)."""

    method: str = "B3LYP"
    basis: str = "6-31G*"
    density_fit: bool = True  # RI-J/K, PySCF's default auxiliary basis for 6-31G*
    max_atoms: int = 14  # the cut `measure` chose (bench/data/nci2k_dft_v1/measure.json)
    n_structures: int = 390  # -> 311 training structures, 79 held-out-scaffold tests
    n_folds: int = 5
    test_fold: int = 0
    seed: int = 0
    workers: int = 2
    budget_s: float = 3600.0  # wall seconds the cut is chosen for

    def describe(self) -> str:
        return (f"PySCF {self.method}/{self.basis} (density fitting: {self.density_fit}) "
                f"energies and forces of {self.n_structures} nci2k structures (GFN2-xTB "
                f"conformers and MD frames, geometries as they are) of <= {self.max_atoms} atoms, "
                "spread round-robin over Murcko scaffolds; test = held-out scaffolds (fold "
                f"{self.test_fold} of the {self.n_folds}-fold scaffold split, seed {self.seed})")


def sim_config(settings: DftSettings, source: Path, n: int) -> Any:
    """The campaign's config: the source structures as they are, B3LYP on PySCF."""
    from convergent.sim.config import SimulateConfig

    return SimulateConfig(source=str(source), elements=[], min_atoms=1, max_atoms=200,
                          sampler="rattle", rattle_sigma=0.0, distort_fraction=0.0,
                          dimer_fraction=0.0, frames=n, calculator="dft",
                          method=settings.method, basis=settings.basis,
                          density_fit=settings.density_fit, chunk_size=1, timeout_s=1800.0,
                          retries=1, seed=settings.seed, flush_every_s=30.0)


# ------------------------------------------------------------------ selection and split


def _round_robin(queues: list[list[Any]]) -> list[Any]:
    out, k = [], 0
    while any(k < len(q) for q in queues):
        out += [q[k] for q in queues if k < len(q)]
        k += 1
    return out


def select(records: list[dict[str, Any]], max_atoms: int, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` records of at most ``max_atoms`` atoms, spread over scaffold groups: each
    group's compounds and each compound's structures in a seeded order, compounds
    interleaved within a group, then groups (seeded order) interleaved. Returned sorted by
    key; the same inputs give the same records."""
    rng = np.random.default_rng(seed)
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in sorted(records, key=lambda r: r["key"]):
        if len(r["numbers"]) <= max_atoms:
            groups.setdefault(scaffold_group(r), {}).setdefault(r["molecule_id"], []).append(r)
    queues = []
    for g in sorted(groups):
        comps = []
        for c in sorted(groups[g]):
            recs = groups[g][c]
            comps.append([recs[i] for i in rng.permutation(len(recs))])
        queues.append(_round_robin([comps[i] for i in rng.permutation(len(comps))]))
    picked = _round_robin([queues[i] for i in rng.permutation(len(queues))])[:n]
    return sorted(picked, key=lambda r: r["key"])


def split(records: list[dict[str, Any]], settings: DftSettings) -> tuple[list[int], list[int]]:
    """(train, test) indices: the test set is fold ``test_fold`` of the scaffold-grouped
    split, so no scaffold group is on both sides."""
    return group_folds(records, scaffold_group, settings.n_folds, settings.test_fold, settings.seed)


# ------------------------------------------------------------------------- measuring


def _nci2k_records() -> list[dict[str, Any]]:
    from bench.models.nci2k import load

    return load(build_missing=False)


def fit_cost(atoms: list[int], seconds: list[float]) -> dict[str, float]:
    """Least squares of log(seconds) on log(atoms): ``seconds = a * atoms ** b``."""
    b, loga = np.polyfit(np.log(atoms), np.log(seconds), 1)
    return {"a": float(np.exp(loga)), "b": float(b)}


def predict_s(cost: dict[str, float], n_atoms: list[int]) -> float:
    return float(sum(cost["a"] * n ** cost["b"] for n in n_atoms))


def choose_cut(records: list[dict[str, Any]], cost: dict[str, float],
               settings: DftSettings) -> tuple[int, list[dict[str, Any]]]:
    """The largest cut whose selection has ``n_structures`` records and a predicted wall
    time (summed single points / workers) within ``budget_s``; with each cut's prediction."""
    rows, best = [], None
    for cut in range(5, 31):
        sel = select(records, cut, settings.n_structures, settings.seed)
        wall = predict_s(cost, [len(r["numbers"]) for r in sel]) / settings.workers
        ok = len(sel) == settings.n_structures and wall <= settings.budget_s
        rows.append({"max_atoms": cut, "structures": len(sel), "predicted_wall_s": round(wall, 1),
                     "fits": ok})
        if ok:
            best = cut
    if best is None:
        raise SystemExit("error: no atom cut fits the budget")
    return best, rows


def measure(settings: DftSettings = DftSettings(), sizes: tuple[int, ...] = MEASURE_SIZES,
            per_size: int = 2, root: Path = ROOT) -> dict[str, Any]:
    """Time B3LYP single points (energy + forces, one thread) of ``per_size`` nci2k
    conformers at each atom count, fit the cost curve and choose the cut; writes
    ``root/measure.json``."""
    from convergent.core.fsutil import atomic_write_text
    from convergent.sim.calculators import CalcSpec, Labeller

    recs = _nci2k_records()
    spec = CalcSpec.from_simulate(sim_config(settings, Path("x.extxyz"), 1))
    lab, rows = Labeller(spec), []
    for size in sizes:
        pool = [r for r in recs if len(r["numbers"]) == size and r["kind"] == "conformer"]
        comps = sorted({r["molecule_id"] for r in pool})
        for comp in comps[:per_size]:
            r = next(x for x in pool if x["molecule_id"] == comp)
            c0 = time.process_time()
            _, _, wall = lab.label(r["numbers"], r["positions"])
            cpu = time.process_time() - c0
            rows.append({"atoms": size, "key": r["key"], "smiles": comp, "cpu_s": round(cpu, 2),
                         "wall_s": round(wall, 2), "load1": os.getloadavg()[0]})
            print(f"measure: {size} atoms {comp}: {cpu:.1f} CPU s, {wall:.1f} s wall",
                  file=sys.stderr, flush=True)
    cost = fit_cost([r["atoms"] for r in rows], [r["cpu_s"] for r in rows])
    cut, cuts = choose_cut(recs, cost, settings)
    out = {"level": spec.level, "threads": 1, "provenance": spec.provenance(),
           "what": "CPU seconds (and wall) of one energy+forces single point (Labeller.label), "
                   "one thread; the fit is on CPU seconds (the machine was shared)",
           "measurements": rows, "fit": {**cost, "model": "seconds = a * atoms ** b"},
           "budget_s": settings.budget_s, "workers": settings.workers,
           "n_structures": settings.n_structures, "cuts": cuts, "chosen_max_atoms": cut}
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / "measure.json", json.dumps(out, indent=1))
    return out


# ---------------------------------------------------------------------------- building


def selection(settings: DftSettings, records: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The selected nci2k records, each with ``split`` ('train' | 'test')."""
    sel = select(records if records is not None else _nci2k_records(), settings.max_atoms,
                 settings.n_structures, settings.seed)
    _, te = split(sel, settings)
    test = set(te)
    return [{**r, "split": "test" if i in test else "train"} for i, r in enumerate(sel)]


def _write_source(path: Path, sel: list[dict[str, Any]]) -> None:
    """The selection as the campaign's source extxyz (xTB energy kept for reference)."""
    from ase import Atoms

    frames = []
    for r in sel:
        a = Atoms(numbers=r["numbers"], positions=r["positions"])
        a.info.update(nci2k_key=r["key"], cid=r["cid"], smiles=r["molecule_id"],
                      scaffold=r["scaffold"] or "-", kind=r["kind"], conformer=r["conformer"],
                      split=r["split"], xtb_energy_eV=r["energy"], charge=0, multiplicity=1)
        frames.append(a)
    write_extxyz(path, frames)


def _prepare(settings: DftSettings, root: Path) -> Path:
    """Write (once) the settings, the selection's keys and the source extxyz; refuse a
    root made with other settings or whose selection differs from this one."""
    from convergent.core.fsutil import atomic_write_text

    root.mkdir(parents=True, exist_ok=True)
    sp, kp, src = root / "settings.json", root / "selection.json", root / "source.extxyz"
    want = json.loads(json.dumps(asdict(settings)))
    if sp.is_file() and json.loads(sp.read_text()) != want:
        raise SystemExit(f"error: {root} was built with other settings ({sp}); use another root")
    if not src.is_file():
        sel = selection(settings)
        keys = {"keys": [r["key"] for r in sel], "split": [r["split"] for r in sel]}
        atomic_write_text(sp, json.dumps(want, indent=1))
        atomic_write_text(kp, json.dumps(keys, indent=1))
        _write_source(src, sel)  # written once: the campaign fingerprints its bytes
    return src


def _progress(total: int, done0: int, t0: float) -> Any:
    """An ``on_task`` callback printing labelled / total with a rate-based ETA."""
    def on_task(task: Any, result: Any, summary: Any) -> None:
        now = summary.done + summary.quarantined
        rate = now / max(time.time() - t0, 1e-9)
        left = total - done0 - now
        eta = left / rate if rate > 0 else float("nan")
        print(f"nci2k_dft: {done0 + now}/{total} labelled or quarantined "
              f"({summary.quarantined} quarantined this run), {time.time() - t0:.0f} s, "
              f"ETA {eta / 60:.0f} min", file=sys.stderr, flush=True)
    return on_task


def build(settings: DftSettings = DftSettings(), root: Path = ROOT, dataset: Path = DATASET) -> dict[str, Any]:
    """Label (or resume) the selection on a LocalCluster of ``workers`` single-threaded
    Dask workers; when every structure is labelled or quarantined, export the set."""
    from convergent.cluster.config import ClusterConfig
    from convergent.core.fsutil import atomic_write_text
    from convergent.sim.campaign import run_campaign

    src = _prepare(settings, root)
    total = settings.n_structures
    done0 = sum(_counts(root).values())
    t0 = time.time()
    atomic_write_text(root / "run.json", json.dumps({"started": t0, "done_at_start": done0}))
    summary = run_campaign(sim_config(settings, src, total),
                           ClusterConfig(n_workers=settings.workers, threads_per_worker=1),
                           root / "labels", progress=False, on_task=_progress(total, done0, t0))
    line = {"time": time.time(), **{k: v for k, v in summary.to_dict().items()
                                    if isinstance(v, (int, float))}}
    with (root / "build.jsonl").open("a") as fh:
        fh.write(json.dumps(line) + "\n")
    out = {"summary": summary.line(), **status(settings, root)}
    if out["complete"]:
        out["exported"] = str(export(settings, root, dataset))
    return out


def _counts(root: Path) -> dict[str, int]:
    """Records committed and frames quarantined so far in ``root/labels``."""
    from convergent.sim.resume import existing_keys

    labels = root / "labels"
    done = existing_keys(labels) if labels.is_dir() else set()
    q = labels / "quarantine.jsonl"
    bad = {json.loads(x)["key"] for x in q.read_text().splitlines() if x.strip()} if q.is_file() else set()
    return {"labelled": len(done), "quarantined": len(bad - done)}


def status(settings: DftSettings = DftSettings(), root: Path = ROOT) -> dict[str, Any]:
    """How far the labelling is, with an ETA from this run's rate (run.json)."""
    c = _counts(root)
    n = sum(c.values())
    out: dict[str, Any] = {"total": settings.n_structures, **c,
                           "complete": n >= settings.n_structures,
                           "exported": (DATASET / "settings.json").is_file()}
    rp = root / "run.json"
    if rp.is_file() and not out["complete"]:
        run = json.loads(rp.read_text())
        rate = (n - run["done_at_start"]) / max(time.time() - run["started"], 1.0)
        if rate > 0:
            out["eta_min"] = round((settings.n_structures - n) / rate / 60, 1)
    return out


# ----------------------------------------------------------------- export and reading


def _labelled(root: Path) -> list[Any]:
    """The labelled structures as ASE Atoms (source info + DFT energy, forces, seconds)."""
    import ase.io

    from convergent.data.reader import open_dataset

    src = ase.io.read(root / "source.extxyz", index=":")
    ds = open_dataset(root / "labels")
    out = []
    try:
        for r in ds:
            a = src[int(r["molecule_id"].rsplit("-", 1)[1])].copy()
            if not np.allclose(a.positions, r["positions"], atol=1e-8):
                raise SystemExit(f"error: {r['key']}: positions differ from the source")
            info = {k: a.info[k] for k in ("nci2k_key", "cid", "smiles", "scaffold", "kind",
                                           "conformer", "split", "xtb_energy_eV")}
            a.info.clear()
            a.info.update(info, dft_energy_eV=float(r["energy"]),
                          label_seconds=round(float((r.get("meta") or {}).get("wall_s", np.nan)), 3))
            a.arrays["dft_forces_eVA"] = np.asarray(r["forces"], np.float64)
            out.append(a)
    finally:
        ds.close()
    return sorted(out, key=lambda a: a.info["nci2k_key"])


def _versions() -> dict[str, str]:
    from importlib import metadata

    from bench.lib.harness import git_state

    out = {"commit": str(git_state()["commit"])}
    for name in ("pyscf", "numpy", "scipy", "ase", "rdkit", "tblite", "dask", "distributed"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def export(settings: DftSettings = DftSettings(), root: Path = ROOT, dataset: Path = DATASET) -> Path:
    """The labelled set as ONE extxyz plus ``settings.json`` in ``dataset``."""
    from convergent.core.fsutil import atomic_write_text
    from convergent.sim.calculators import CalcSpec

    frames = _labelled(root)
    name = dataset / f"{dataset.name}.extxyz"
    write_extxyz(name, frames)
    q = root / "labels" / "quarantine.jsonl"
    quarantined = [json.loads(x) for x in q.read_text().splitlines() if x.strip()] if q.is_file() else []
    test = [a for a in frames if a.info["split"] == "test"]
    train = [a for a in frames if a.info["split"] == "train"]
    bj = root / "build.jsonl"
    lines = [json.loads(x) for x in bj.read_text().splitlines()] if bj.is_file() else []
    meas = root / "measure.json"
    spec = CalcSpec.from_simulate(sim_config(settings, root / "source.extxyz", 1))
    out = {"description": settings.describe(), "settings": asdict(settings),
           "calculator": spec.provenance(), "pyscf_defaults": _pyscf_defaults(settings, frames),
           "file": name.name, "structures": len(frames), "train_structures": len(train),
           "test_structures": len(test),
           "test_scaffold_groups": sorted({scaffold_group(_rec(a)) for a in test}),
           "train_scaffold_groups": len({scaffold_group(_rec(a)) for a in train}),
           "atoms": {"min": min(len(a) for a in frames), "max": max(len(a) for a in frames),
                     "mean": round(float(np.mean([len(a) for a in frames])), 2)},
           "quarantined": [{k: e[k] for k in ("key", "reason") if k in e} for e in quarantined],
           "labelling": _labelling(frames, lines),
           "cost_measurement": json.loads(meas.read_text()) if meas.is_file() else None,
           "source": "bench/data/nci2k_v1 (bench/models/nci2k.py), GFN2-xTB geometries",
           "versions": _versions(),
           "rebuild": "nice -n 19 .venv/bin/python -m bench.models.nci2k_dft build"}
    atomic_write_text(dataset / "settings.json", json.dumps(out, indent=1))
    return name


def _labelling(frames: list[Any], lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per single point (the worker's wall clock, from each record) by atom count,
    and the campaign runs that finished (an interrupted run writes no line)."""
    secs = np.array([a.info["label_seconds"] for a in frames], float)
    by_n: dict[int, list[float]] = {}
    for a, t in zip(frames, secs, strict=True):
        by_n.setdefault(len(a), []).append(float(t))
    return {"single_point_s_sum": round(float(np.nansum(secs)), 1),
            "single_point_s_median_by_atoms": {str(n): round(float(np.median(v)), 2)
                                               for n, v in sorted(by_n.items())},
            "campaign_runs_finished": len(lines),
            "campaign_wall_s_finished_runs": round(sum(x.get("wall_s", 0.0) for x in lines), 1),
            "note": "single-point seconds are wall seconds on a shared 2-core machine (the build "
                    "ran at nice 19 beside other work), so they exceed the one-core CPU "
                    "measurement"}


def _pyscf_defaults(settings: DftSettings, frames: list[Any]) -> dict[str, Any]:
    """What PySCF chose where the calculator left the default: grid level, initial guess,
    and the auxiliary basis of density fitting per element (``auxbasis`` None)."""
    from pyscf import df, dft, gto

    symbols = sorted({s for a in frames for s in a.get_chemical_symbols()})
    aux = {}
    for el in symbols:
        mol = gto.M(atom=f"{el} 0 0 0", basis=settings.basis, spin=gto.charge(el) % 2, verbose=0)
        aux[el] = str(df.make_auxbasis(mol)[el])
    mf = dft.RKS(gto.M(atom="H 0 0 0; H 0 0 0.74", basis=settings.basis, verbose=0))
    return {"grids_level": mf.grids.level, "init_guess": mf.init_guess, "auxbasis": aux,
            "restricted": "RKS (every structure is neutral closed-shell)"}


def _rec(a: Any) -> dict[str, Any]:
    scaffold = "" if a.info["scaffold"] == "-" else a.info["scaffold"]
    return {"scaffold": scaffold, "molecule_id": a.info["smiles"]}


def load_dft(dataset: Path = DATASET) -> list[dict[str, Any]]:
    """The committed set as records (``energy``/``forces`` DFT; ``xtb_energy``, ``split``,
    ``scaffold``, ``molecule_id`` = canonical SMILES, ``key`` = the nci2k key)."""
    import ase.io

    recs = []
    for a in ase.io.read(dataset / f"{dataset.name}.extxyz", index=":"):
        recs.append({**_rec(a), "key": a.info["nci2k_key"], "cid": a.info["cid"],
                     "kind": a.info["kind"], "split": a.info["split"],
                     "numbers": np.asarray(a.numbers, np.int64),
                     "positions": np.asarray(a.positions, np.float64),
                     "energy": float(a.info["dft_energy_eV"]),
                     "forces": np.asarray(a.arrays["dft_forces_eVA"], np.float64),
                     "xtb_energy": float(a.info["xtb_energy_eV"])})
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("measure", "build", "status"))
    args = ap.parse_args()
    if args.action == "measure":
        res = measure()
        print(json.dumps({k: res[k] for k in ("fit", "cuts", "chosen_max_atoms")}))
    elif args.action == "build":
        print(json.dumps(build()))
    else:
        print(json.dumps(status()))


if __name__ == "__main__":
    main()
