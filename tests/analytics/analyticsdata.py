"""Record generators of the analytics tests (a uniquely named module, importable by Dask
worker processes): distinct random molecules, planted duplicates, ring molecules."""

from __future__ import annotations

import numpy as np


def _rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    return q * np.sign(np.diag(r))


def distinct_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` structures that are pairwise far apart (random geometries of 3..9 atoms in a
    few compositions, each atom displaced by ~0.3 Å between structures)."""
    rng = np.random.default_rng(seed)
    comps = [np.array([6, 1, 1, 1]), np.array([8, 1, 1]), np.array([6, 6, 1, 1, 1, 1, 8]),
             np.array([7, 1, 1, 1]), np.array([6, 7, 8, 1, 1, 1, 1, 1, 1])]
    out = []
    for i in range(n):
        z = comps[i % len(comps)]
        pos = rng.normal(scale=1.2, size=(len(z), 3))
        out.append({
            "key": f"d{i}", "molecule_id": f"mol{i % 11}", "numbers": z.astype(np.int64), "positions": pos,
            "energy": float(rng.normal(-10 * len(z), 1.0)), "forces": rng.normal(scale=2.0, size=(len(z), 3)),
            "charge": 0, "multiplicity": 1,
            "meta": {"sampler": "md" if i % 3 else "opt", "round": i % 2, "source": f"g2:{i % 5}"},
        })
    return out


def plant_duplicates(base: list[dict], seed: int = 1) -> tuple[list[dict], dict[str, tuple[str, str]]]:
    """``base`` plus exact copies (new key) and near copies (rotated, translated, atoms
    permuted, positions jittered by 1e-4 Å); returns (records, {dup key: (reason, of)})."""
    rng = np.random.default_rng(seed)
    recs = list(base)
    planted = {}
    for k, b in enumerate(base[::7]):
        c = dict(b, key=f"exact{k}")
        c["forces"] = b["forces"] + 0.5  # a different label does not make it a new structure
        recs.append(c)
        planted[c["key"]] = ("exact", b["key"])
    for k, b in enumerate(base[3::9]):
        perm = rng.permutation(len(b["numbers"]))
        pos = (b["positions"] @ _rotation(rng).T + rng.normal(size=3))[perm]
        pos = pos + rng.uniform(-1e-4, 1e-4, pos.shape)
        c = dict(b, key=f"near{k}", numbers=b["numbers"][perm], positions=pos, forces=b["forces"][perm])
        recs.append(c)
        planted[c["key"]] = ("near", b["key"])
    return recs, planted  # copies after their originals: the original is the one kept


RING_SMILES = {
    "benzene": "c1ccccc1", "toluene": "Cc1ccccc1", "phenol": "Oc1ccccc1", "pyridine": "c1ccncc1",
    "cyclohexane": "C1CCCCC1", "methylcyclohexane": "CC1CCCCC1", "furan": "c1ccoc1",
    "methylfuran": "Cc1ccoc1", "naphthalene": "c1ccc2ccccc2c1", "ethanol": "CCO", "propane": "CCC",
}


def ring_records(frames: int = 4, seed: int = 0, with_smiles: bool = False) -> list[dict]:
    """Frames of RDKit-embedded molecules (several share a scaffold); no SMILES in meta
    unless ``with_smiles`` (the scaffold then comes from the geometry)."""
    from rdkit import Chem
    from rdkit.Chem import AllChem

    rng = np.random.default_rng(seed)
    out = []
    for name, smi in RING_SMILES.items():
        mol = Chem.AddHs(Chem.MolFromSmiles(smi))
        AllChem.EmbedMolecule(mol, randomSeed=7)
        base = mol.GetConformer().GetPositions()
        z = np.array([a.GetAtomicNum() for a in mol.GetAtoms()], np.int64)
        for f in range(frames):
            pos = base + rng.normal(scale=0.02, size=base.shape)
            out.append({"key": f"{name}-{f}", "molecule_id": name, "numbers": z, "positions": pos,
                        "energy": float(-5.0 * len(z) + rng.normal()), "forces": rng.normal(size=(len(z), 3)),
                        "meta": {"smiles": smi} if with_smiles else {"sampler": "md"}})
    return out


def shard_records_plus(task, one: int, extra: int) -> tuple[int, int]:
    """A trivial per-shard task (Engine.map tests): (shard number, records + one + extra)."""
    return task.shard_no, task.info.records + one + extra
