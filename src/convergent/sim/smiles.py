"""SMILES sources: ``SMILES [name]`` files, RDKit ETKDGv3 embedding + MMFF94 relaxation.

An invalid SMILES raises :class:`~convergent.core.errors.InputError` naming the file and line,
or, with ``on_bad_input="quarantine"``, becomes an
:class:`~convergent.sim.molecules.InputRejection` and is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convergent.core.errors import InputError
from convergent.sim.molecules import InputRejection, Molecule, safe_id, stable_int


@dataclass(frozen=True)
class SmilesEntry:
    """One SMILES with its name and where it was read (file:line)."""

    smiles: str
    name: str
    where: str


def read_smiles_file(path: str | Path) -> list[SmilesEntry]:
    """Read ``SMILES [name]`` lines; '#' comments, blank lines and a 'SMILES' header skipped."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"SMILES file not found: {p}", hint="pass an existing file")
    entries = []
    with p.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            parts = text.split()
            if lineno == 1 and parts[0].lower() in ("smiles", "smi"):
                continue
            name = parts[1] if len(parts) > 1 else f"{p.stem}-{lineno}"
            entries.append(SmilesEntry(parts[0], name, f"{p}:{lineno}"))
    return entries


def nci_smiles_path() -> Path:
    """The NCI SMILES file shipped inside the RDKit wheel (``RDConfig.RDDataDir``)."""
    from rdkit import RDConfig

    return Path(RDConfig.RDDataDir) / "NCI" / "first_5K.smi"


def embed_smiles(
    smiles: str,
    seed: int = 0,
    where: str = "<smiles>",
    mmff: bool = True,
    max_iters: int = 500,
):
    """Embed one SMILES with RDKit ETKDGv3 (seeded) and relax it with MMFF94.

    Returns ``(numbers, positions Å, charge, multiplicity)``. Raises ValueError with a
    reason for an invalid SMILES or a failed embedding.
    """
    from rdkit import Chem, RDLogger
    from rdkit.Chem import AllChem, Descriptors

    RDLogger.DisableLog("rdApp.*")
    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        raise ValueError(f"invalid SMILES {smiles!r}")
    mol = Chem.AddHs(mol)
    params = AllChem.ETKDGv3()
    params.randomSeed = int(seed) & 0x7FFFFFFF
    if AllChem.EmbedMolecule(mol, params) != 0:
        params.useRandomCoords = True
        if AllChem.EmbedMolecule(mol, params) != 0:
            raise ValueError(f"RDKit ETKDGv3 could not embed {smiles!r}")
    if mmff and AllChem.MMFFHasAllMoleculeParams(mol):
        AllChem.MMFFOptimizeMolecule(mol, maxIters=max_iters)
    numbers = np.array([a.GetAtomicNum() for a in mol.GetAtoms()], dtype=np.int64)
    positions = np.asarray(mol.GetConformer().GetPositions(), dtype=np.float64)
    charge = int(Chem.GetFormalCharge(mol))
    radicals = int(Descriptors.NumRadicalElectrons(mol))
    return numbers, positions, charge, radicals + 1


def smiles_counts(smiles: str) -> tuple[int, set[str]] | None:
    """Atom count (with hydrogens) and element set of a SMILES without embedding it."""
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")
    mol = Chem.MolFromSmiles(smiles)
    if mol is None:
        return None
    mol = Chem.AddHs(mol)
    return mol.GetNumAtoms(), {a.GetSymbol() for a in mol.GetAtoms()}


def smiles_molecules(
    entries: Sequence[SmilesEntry],
    seed: int = 0,
    elements: Sequence[str] = (),
    min_atoms: int = 1,
    max_atoms: int = 10**9,
    max_molecules: int | None = None,
    on_bad_input: str = "error",
    prefix: str = "smi",
) -> tuple[list[Molecule], list[InputRejection]]:
    """Embed SMILES entries that pass the filters (checked before the costly embedding).

    An invalid SMILES raises :class:`InputError` (``file:line``) unless ``on_bad_input`` is
    ``"quarantine"``, in which case it is returned as an :class:`InputRejection`.
    """
    mols: list[Molecule] = []
    rejected: list[InputRejection] = []
    for entry in entries:
        if max_molecules is not None and len(mols) >= max_molecules:
            break
        counts = smiles_counts(entry.smiles)
        try:
            if counts is None:
                raise ValueError(f"invalid SMILES {entry.smiles!r}")
            n, elems = counts
            if not (min_atoms <= n <= max_atoms) or (elements and not elems <= set(elements)):
                continue
            # Seed per molecule so the geometry does not depend on the rest of the file.
            mol_seed = stable_int(seed, entry.smiles)
            numbers, positions, charge, mult = embed_smiles(entry.smiles, mol_seed, entry.where)
        except ValueError as exc:
            if on_bad_input == "quarantine":
                rejected.append(InputRejection(entry.where, str(exc)))
                continue
            raise InputError(
                f"{entry.where}: {exc}",
                hint="fix or remove that line, or set simulate.on_bad_input=quarantine",
            ) from None
        mols.append(
            Molecule(
                molecule_id=safe_id(f"{prefix}-{entry.name}"),
                numbers=numbers,
                positions=positions,
                charge=charge,
                multiplicity=mult,
                origin=entry.where,
                info={"smiles": entry.smiles},
            )
        )
    return mols, rejected
