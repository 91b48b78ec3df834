"""A starting structure (:class:`Molecule`), built from ASE atoms or ASE's G2/S22
collections, and filtered by elements and atom count; :func:`stable_int` seeds per molecule.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ase.data import chemical_symbols


@dataclass(frozen=True)
class Molecule:
    """One starting structure. ``positions`` in Å; ``molecule_id`` is stable and has no '/'."""

    molecule_id: str
    numbers: np.ndarray  # int64[N]
    positions: np.ndarray  # float64[N, 3], Å
    charge: int = 0
    multiplicity: int = 1
    origin: str = ""  # where it came from, e.g. 'g2:CH4', 'smiles.txt:12'
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n_atoms(self) -> int:
        return int(len(self.numbers))

    @property
    def symbols(self) -> list[str]:
        return [chemical_symbols[int(z)] for z in self.numbers]

    def to_atoms(self):  # -> ase.Atoms
        """A fresh ``ase.Atoms`` (no cell, no pbc); charge/multiplicity go to the calculator."""
        from ase import Atoms

        return Atoms(numbers=self.numbers, positions=self.positions.copy())


@dataclass(frozen=True)
class InputRejection:
    """A source entry that could not be turned into a molecule (quarantined, not fatal)."""

    where: str  # 'file:line'
    reason: str


def safe_id(text: str) -> str:
    """A molecule id usable inside record keys: no '/', no whitespace."""
    out = re.sub(r"[\s/\\]+", "_", text.strip())
    return out or "unnamed"


def _ok(mol: Molecule, elements: Sequence[str], min_atoms: int, max_atoms: int) -> bool:
    if not (min_atoms <= mol.n_atoms <= max_atoms):
        return False
    return not elements or set(mol.symbols) <= set(elements)


def filter_molecules(
    mols: Iterable[Molecule],
    elements: Sequence[str] = (),
    min_atoms: int = 1,
    max_atoms: int = 10**9,
    max_molecules: int | None = None,
) -> list[Molecule]:
    """Keep molecules made only of ``elements`` (empty: any) with an atom count in range."""
    out = [m for m in mols if _ok(m, elements, min_atoms, max_atoms)]
    return out if max_molecules is None else out[:max_molecules]


def _multiplicity_from_atoms(atoms) -> int:
    """2S+1 from ASE initial magnetic moments (sum of unpaired electrons), else parity."""
    uhf = int(round(abs(float(atoms.get_initial_magnetic_moments().sum()))))
    n_el = int(atoms.numbers.sum()) - int(round(float(atoms.get_initial_charges().sum())))
    if uhf == 0 and n_el % 2 == 1:
        uhf = 1
    return uhf + 1


def from_ase(atoms, molecule_id: str, origin: str, info: dict | None = None) -> Molecule:
    charge = int(round(float(atoms.get_initial_charges().sum())))
    extra = dict(info or {})
    if "charge" in extra:
        charge = int(extra["charge"])
    mult = _multiplicity_from_atoms(atoms)
    for name in ("multiplicity", "mult", "spin_multiplicity"):
        if name in extra:
            mult = int(extra[name])
    return Molecule(
        molecule_id=safe_id(molecule_id),
        numbers=np.asarray(atoms.numbers, dtype=np.int64).copy(),
        positions=np.asarray(atoms.positions, dtype=np.float64).copy(),
        charge=charge,
        multiplicity=mult,
        origin=origin,
    )


def g2_molecules() -> list[Molecule]:
    """All molecules and atoms of ASE's G2 collection (ids ``g2-<name>``)."""
    from ase.collections import g2

    return [from_ase(g2[name], f"g2-{name}", f"g2:{name}") for name in g2.names]


def s22_molecules() -> list[Molecule]:
    """The 22 dimers of ASE's S22 collection (ids ``s22-<name>``)."""
    from ase.collections import s22

    return [from_ase(s22[name], f"s22-{name}", f"s22:{name}") for name in s22.names]


def stable_int(*parts: object) -> int:
    """A 63-bit integer hash of ``parts`` that is the same in every process and run."""
    h = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & 0x7FFFFFFFFFFFFFFF
