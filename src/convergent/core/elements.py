"""Element symbols and Hill formulas of atomic numbers (ASE's table), for every layer."""

from __future__ import annotations

import numpy as np
from ase.data import chemical_symbols, covalent_radii

__all__ = ["covalent_bonds", "formula", "symbol"]


def symbol(z: int) -> str:
    """The element symbol of atomic number ``z`` (``Z<z>`` outside the table)."""
    return chemical_symbols[z] if 0 <= z < len(chemical_symbols) else f"Z{z}"


def formula(numbers: np.ndarray) -> str:
    """Hill-ordered formula (C, H first when there is carbon, then alphabetical), e.g. ``CH4O``."""
    zs, counts = np.unique(np.asarray(numbers, dtype=np.int64), return_counts=True)
    d = {symbol(int(z)): int(c) for z, c in zip(zs, counts, strict=True)}
    order = [s for s in ("C", "H") if s in d and "C" in d]
    order += sorted(k for k in d if k not in order)
    return "".join(f"{s}{d[s] if d[s] > 1 else ''}" for s in order)


def covalent_bonds(numbers: np.ndarray, positions: np.ndarray, scale: float = 1.2) -> np.ndarray:
    """Pairs (i < j) bonded in this geometry: closer than ``scale`` x the sum of their
    covalent radii (ase.data.covalent_radii). Shape (n_bonds, 2)."""
    r = covalent_radii[np.asarray(numbers)]
    d = np.linalg.norm(positions[:, None] - positions[None], axis=-1)
    i, j = np.triu_indices(len(numbers), k=1)
    keep = d[i, j] < scale * (r[i] + r[j])
    return np.stack([i[keep], j[keep]], axis=1)
