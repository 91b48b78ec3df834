"""Shared helpers of the molecular benchmarks: xTB/DFT datasets, split, a small trainer.

Used by bench/models/accuracy.py, bench/models/cost.py and bench/models/transfer.py (results are
written with bench/lib/harness.py). Datasets are cached as extxyz under bench/data/
(git-ignored). Energies eV, forces eV/Å.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.paths import DATA, child_env, module_argv


def closed_shell_g2(max_atoms: int = 12, min_atoms: int = 3) -> list[str]:
    """G2 molecules of H/C/N/O/F with an even electron count and <= max_atoms atoms."""
    from ase.collections import g2

    out = []
    for n in g2.names:
        a = g2[n]
        if not (min_atoms <= len(a) <= max_atoms) or not set(a.get_chemical_symbols()) <= set("HCNOF"):
            continue
        if sum(a.numbers) % 2 or n in ("CH2_s3B1d", "CH2_s1A1d", "O3"):
            continue
        out.append(n)
    return sorted(out)


def conformers(name: str, n: int, seed: int) -> list[Any]:
    """``n`` rattled copies of a G2 molecule (Gaussian displacements 0.02-0.12 Å)."""
    from ase.collections import g2

    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        a = g2[name].copy()
        a.positions += rng.normal(0, rng.uniform(0.02, 0.12), a.positions.shape)
        a.info["molecule_id"] = name
        a.info["key"] = f"{name}-{k}"
        out.append(a)
    return out


def xtb_label(atoms: Any) -> tuple[float, np.ndarray, float]:
    """GFN2-xTB energy (eV), forces (eV/Å) and wall seconds via tblite's ASE calculator."""
    from tblite.ase import TBLite

    a = atoms.copy()
    a.calc = TBLite(method="GFN2-xTB", verbosity=0)
    t = time.perf_counter()
    e = a.get_potential_energy()
    f = a.get_forces()
    return float(e), np.asarray(f), time.perf_counter() - t


def dft_label(atoms: Any, xc: str = "b3lyp", basis: str = "6-31g*") -> tuple[float, np.ndarray, float]:
    """PySCF RKS energy (eV) and forces (eV/Å), wall seconds (one thread unless set)."""
    from pyscf import dft, gto, lib

    lib.num_threads(int(os.environ.get("BENCH_DFT_THREADS", "1")))
    hartree, bohr = 27.211386245988, 0.529177210903
    t = time.perf_counter()
    mol = gto.M(
        atom=[(s, p) for s, p in zip(atoms.get_chemical_symbols(), atoms.positions, strict=True)],
        basis=basis, unit="Angstrom", verbose=0,
    )
    mf = dft.RKS(mol)
    mf.xc = xc
    mf.conv_tol = 1e-9
    e = mf.kernel()
    if not mf.converged:
        raise RuntimeError("SCF did not converge")
    g = mf.nuc_grad_method().kernel()
    return float(e * hartree), -np.asarray(g) * hartree / bohr, time.perf_counter() - t


def write_extxyz(path: Path, frames: list[Any]) -> None:
    import ase.io

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.extxyz")  # per process: concurrent builders never share it
    ase.io.write(tmp, frames, format="extxyz")
    os.replace(tmp, path)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records (dicts) from an extxyz written by the labelling functions here."""
    import ase.io

    recs = []
    for a in ase.io.read(path, index=":"):
        recs.append({
            "key": a.info["key"],
            "molecule_id": a.info["molecule_id"],
            "numbers": np.asarray(a.numbers, np.int64),
            "positions": np.asarray(a.positions, np.float64),
            "energy": float(a.info["energy_eV"]),
            "forces": np.asarray(a.arrays["forces_eVA"], np.float64),
            "label_seconds": float(a.info.get("label_seconds", np.nan)),
        })
    return recs


def label_frames(frames: list[Any], method: str) -> list[Any]:
    out = []
    for a in frames:
        try:
            e, f, s = xtb_label(a) if method == "xtb" else dft_label(a)
        except Exception as exc:  # noqa: BLE001 - a failed SCF drops the structure
            print(f"skip {a.info['key']}: {exc}", file=sys.stderr)
            continue
        b = a.copy()
        b.info["energy_eV"] = e
        b.arrays["forces_eVA"] = f
        b.info["label_seconds"] = s
        out.append(b)
    return out


def xtb_dataset(n_conf: int = 25, seed: int = 0) -> list[dict[str, Any]]:
    """The cached GFN2-xTB dataset (built on first use)."""
    path = DATA / f"xtb_g2_{n_conf}_{seed}.extxyz"
    if not path.exists():
        frames = []
        for i, name in enumerate(closed_shell_g2()):
            frames += conformers(name, n_conf, seed * 1000 + i)
        write_extxyz(path, label_frames(frames, "xtb"))
    return read_records(path)


def nci_small(max_atoms: int = 20, min_atoms: int = 3, elements: Iterable[str] = "CNOF",
              radicals: bool = True) -> list[str]:
    """Canonical SMILES (stereo dropped, deduplicated) of the NCI compounds shipped with
    RDKit that are neutral, one fragment, H + ``elements`` only, with min..max atoms incl.
    H (``radicals=False`` also drops those with unpaired electrons)."""
    from rdkit import Chem, RDLogger
    from rdkit.Chem import Descriptors

    from convergent.sim.smiles import nci_smiles_path, read_smiles_file

    RDLogger.DisableLog("rdApp.*")
    allowed = set(elements)
    out = set()
    for entry in read_smiles_file(nci_smiles_path()):
        m = Chem.MolFromSmiles(entry.smiles)
        if m is None or len(Chem.GetMolFrags(m)) > 1 or any(a.GetFormalCharge() for a in m.GetAtoms()):
            continue
        if not {a.GetSymbol() for a in m.GetAtoms()} <= allowed:
            continue
        if not radicals and Descriptors.NumRadicalElectrons(m):
            continue
        if min_atoms <= Chem.AddHs(m).GetNumAtoms() <= max_atoms:
            out.add(Chem.MolToSmiles(m, isomericSmiles=False))
    return sorted(out)


def smiles_conformers(smiles: str, n: int, seed: int) -> list[Any]:
    """``n`` structures of one compound: each an ETKDGv3 embedding (its own seed, so
    torsions differ) relaxed with MMFF94, then rattled (Gaussian, sigma 0.02-0.08 Å)."""
    from ase import Atoms

    from convergent.sim.smiles import embed_smiles

    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        numbers, pos, _, _ = embed_smiles(smiles, seed * 100 + k)
        a = Atoms(numbers=numbers, positions=pos + rng.normal(0, rng.uniform(0.02, 0.08), pos.shape))
        a.info["molecule_id"] = smiles
        a.info["key"] = f"{smiles}-{k}"
        out.append(a)
    return out


def xtb_nci_dataset(max_atoms: int = 20, n_conf: int = 8, seed: int = 0) -> list[dict[str, Any]]:
    """The cached GFN2-xTB dataset of small NCI compounds (built on first use: ~4 min on 2
    busy cores with ``OMP_NUM_THREADS=1``, far longer without it on a loaded machine, where
    tblite's OpenMP threads spin; resumable by chunks of compounds)."""
    path = DATA / f"xtb_nci_{max_atoms}_{n_conf}_{seed}.extxyz"
    if not path.exists():
        import ase.io

        # resumable: compounds are embedded and labelled in chunks, each kept as its own
        # file, so an interrupted build picks up at the first missing chunk
        parts = path.with_suffix(".parts")
        smiles = nci_small(max_atoms)
        chunks = [smiles[k:k + NCI_CHUNK] for k in range(0, len(smiles), NCI_CHUNK)]
        files = []
        for c, chunk in enumerate(chunks):
            part = parts / f"{c:04d}.extxyz"
            files.append(part)
            if part.exists():
                continue
            frames = []
            for j, smi in enumerate(chunk):
                try:
                    frames += smiles_conformers(smi, n_conf, seed * 100003 + c * NCI_CHUNK + j)
                except ValueError as exc:  # an embedding RDKit cannot make drops the compound
                    print(f"skip {smi}: {exc}", file=sys.stderr)
            write_extxyz(part, label_frames(frames, "xtb"))
            print(f"xtb_nci: chunk {c + 1}/{len(chunks)} labelled", file=sys.stderr, flush=True)
        write_extxyz(path, [a for f in files for a in ase.io.read(f, index=":")])
    return read_records(path)


NCI_CHUNK = 32  # compounds per resumable labelling chunk of xtb_nci_dataset


def molecule_split(records: list[dict[str, Any]], test_fraction: float = 0.2, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices (train, test) with no molecule on both sides."""
    mols = sorted({r["molecule_id"] for r in records})
    rng = np.random.default_rng(seed)
    rng.shuffle(mols)
    test = set(mols[: max(1, round(test_fraction * len(mols)))])
    tr = [i for i, r in enumerate(records) if r["molecule_id"] not in test]
    te = [i for i, r in enumerate(records) if r["molecule_id"] in test]
    return tr, te


def molecule_folds(records: list[dict[str, Any]], n_folds: int, fold: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices (train, test) of fold ``fold`` of a molecule-wise ``n_folds``-fold split:
    molecules shuffled with ``seed`` and dealt into folds, so every molecule is tested once."""
    if not 0 <= fold < n_folds:
        raise ValueError(f"fold {fold} outside 0..{n_folds - 1}")
    mols = sorted({r["molecule_id"] for r in records})
    rng = np.random.default_rng(seed)
    rng.shuffle(mols)
    test = set(np.array_split(np.asarray(mols, dtype=object), n_folds)[fold].tolist())
    tr = [i for i, r in enumerate(records) if r["molecule_id"] not in test]
    te = [i for i, r in enumerate(records) if r["molecule_id"] in test]
    return tr, te


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "label-dft":
    import ase.io

    os.environ["OMP_NUM_THREADS"] = "1"
    todo, w, k, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    frames = ase.io.read(todo, index=":")[w::k]
    write_extxyz(out, label_frames(frames, "dft"))
    sys.exit(0)

if __name__ == "__main__":
    t = time.perf_counter()
    recs = xtb_dataset()
    print(len(recs), "xTB records in", round(time.perf_counter() - t, 1), "s")


def dft_dataset(max_atoms: int = 7, n_conf: int = 3, seed: int = 1, workers: int = 4,
                no_fluorine: bool = True) -> list[dict[str, Any]]:
    """The cached B3LYP/6-31G* dataset: small G2 molecules, rattled (built on first use,
    labelled by ``workers`` processes, each writing its own part file so work survives)."""
    import subprocess

    tag = f"dft_g2_{max_atoms}_{n_conf}_{seed}{'_noF' if no_fluorine else ''}"
    path = DATA / f"{tag}.extxyz"
    if not path.exists():
        names = [n for n in closed_shell_g2(max_atoms=max_atoms) if not (no_fluorine and "F" in n)]
        frames = []
        for i, name in enumerate(names):
            frames += conformers(name, n_conf, seed * 1000 + i)
        todo = DATA / f"{tag}.todo.extxyz"
        write_extxyz(todo, frames)
        parts = [DATA / f"{tag}.part{w}.extxyz" for w in range(workers)]
        procs = [subprocess.Popen([*module_argv(__spec__.name), "label-dft", str(todo), str(w), str(workers), str(parts[w])],
                                  env=child_env())
                 for w in range(workers) if not parts[w].exists()]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError("DFT labelling worker failed")
        import ase.io

        done = [a for part in parts for a in ase.io.read(part, index=":")]
        order = {a.info["key"]: i for i, a in enumerate(frames)}
        done.sort(key=lambda a: order[a.info["key"]])
        write_extxyz(path, done)
    return read_records(path)


# -- the benches' view of a trained model ---------------------------------------------


class OurPotential:
    """A trained convergent model (any ``model.kind``) behind the benches' (predict,
    parameters) interface."""

    name = "ours"

    def __init__(self, model: Any) -> None:
        self.model = model

    def parameters(self) -> Any:
        return [p for p in self.model.parameters() if p.requires_grad]

    def train(self, flag: bool = True) -> None:
        self.model.train(flag)

    def predict(self, batch: Any, training: bool) -> tuple[Any, Any]:
        from convergent.models.molecular import energy_and_forces

        return energy_and_forces(self.model, batch, training)


def evaluate(pot: Any, records: list[dict[str, Any]], batch_atoms: int = 1024,
             autocast: Any = None) -> dict[str, float]:
    """Energy MAE (eV/molecule, and per atom) and force MAE (eV/Å) over ``records``.

    The energy error is also split by molecule (records sharing ``molecule_id``):
    ``energy_mae_molecule_offset`` is the MAE of each molecule's mean signed error (how
    far off the model is for that compound as a whole), ``energy_mae_within_molecule``
    the MAE left after removing it (conformational error)."""
    import contextlib

    import torch

    from convergent.models.batching import batches_by_atom_budget, collate_records
    from convergent.models.losses import error_sums, metrics_from_sums

    pot.train(False)
    model = getattr(pot, "model", None)
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    ds, mol, sums = [], [], {}
    t = time.perf_counter()
    for idx in batches_by_atom_budget([len(r["numbers"]) for r in records], batch_atoms):
        b = collate_records([records[i] for i in idx]).to(device)
        ctx = (torch.autocast(device.type, dtype=autocast) if autocast is not None
               else contextlib.nullcontext())
        with ctx:
            e, f = pot.predict(b, training=False)
        for k, v in error_sums(e, f, b).items():
            sums[k] = sums.get(k, 0.0) + float(v)
        ds += (e.double() - b.energy).tolist()
        mol += [records[i].get("molecule_id", i) for i in idx]
    ds_arr, mol_arr = np.asarray(ds), np.asarray(mol, dtype=object)
    offset = np.zeros_like(ds_arr)
    for m in set(mol):
        sel = mol_arr == m
        offset[sel] = ds_arr[sel].mean()
    m = metrics_from_sums(sums, 0.0)
    return {"energy_mae": m["energy_mae"], "energy_mae_per_atom": m["energy_mae_per_atom"],
            "energy_mae_molecule_offset": float(np.abs(offset).mean()),
            "energy_mae_within_molecule": float(np.abs(ds_arr - offset).mean()),
            "force_mae": m["force_mae"], "seconds_per_structure": (time.perf_counter() - t) / len(records)}
