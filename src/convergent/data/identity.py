"""Molecule identity from the chemistry of a frame, not from where it sits in a file.

:func:`chemical_id` is the Hill formula plus a hash of the canonical SMILES of the bonded
structure: connectivity from interatomic distances and covalent radii (RDKit's
``rdDetermineBonds.DetermineConnectivity``), no bond orders and no stereo, so every
conformer, rattle or trajectory frame of one molecule gets one id, and two molecules with
the same formula but other bonds (isomers) get two. What it cannot bond (a periodic cell,
an empty frame) has no chemical id (None).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from convergent.core.elements import formula, symbol


def connectivity_smiles(numbers: Any, positions: Any) -> str | None:
    """Canonical SMILES of the bonded structure (explicit H, single bonds), or None."""
    from rdkit import Chem, RDLogger
    from rdkit.Chem import rdDetermineBonds

    z = np.asarray(numbers, np.int64).ravel()
    pos = np.asarray(positions, np.float64).reshape(-1, 3)
    if len(z) == 0 or len(z) != len(pos):
        return None
    block = f"{len(z)}\n\n" + "\n".join(
        f"{symbol(int(a))} {x:.6f} {y:.6f} {w:.6f}" for a, (x, y, w) in zip(z, pos, strict=True))
    RDLogger.DisableLog("rdApp.*")
    try:
        mol = Chem.MolFromXYZBlock(block)
        if mol is None:
            return None
        rdDetermineBonds.DetermineConnectivity(mol, useHueckel=False)
        return Chem.MolToSmiles(mol, canonical=True, allHsExplicit=True)
    except (RuntimeError, ValueError):
        return None
    finally:
        RDLogger.EnableLog("rdApp.*")


def chemical_id(numbers: Any, positions: Any, periodic: bool = False) -> str | None:
    """``<Hill formula>-<10 hex digits of the connectivity SMILES' xxh3>``, or None when
    the frame is periodic or its bonds cannot be determined."""
    if periodic:
        return None
    smiles = connectivity_smiles(numbers, positions)
    if smiles is None:
        return None
    return f"{formula(np.asarray(numbers))}-{xxhash.xxh3_64_hexdigest(smiles.encode())[:10]}"
