"""The per-element linear baseline: ``E ≈ Σ_atoms ref[Z]``, fitted by least squares.

The floor any learned potential must clear: a model no better than this has learned the
composition, not the geometry. Fitted on the training split only; predictions for a
structure holding an element the training split never saw are NaN (no guess). Energies
in eV.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convergent.core.errors import InputError
from convergent.models.molecular import fit_reference_energies


@dataclass(frozen=True)
class ElementBaseline:
    """Per-element energies (eV per atom, keyed by atomic number) and the fit's size."""

    energies: dict[int, float]
    structures: int  # training structures the fit saw

    def predict(self, numbers: Iterable[Sequence[int] | np.ndarray]) -> np.ndarray:
        """``Σ ref[Z]`` per structure (eV); NaN where an element was not in the fit."""
        out = []
        for z in numbers:
            zs = np.asarray(z, dtype=np.int64).tolist()
            out.append(sum(self.energies[k] for k in zs) if all(k in self.energies for k in zs)
                       else float("nan"))
        return np.asarray(out, dtype=np.float64)


def fit_element_baseline(numbers: Sequence[Sequence[int] | np.ndarray],
                         energies: Sequence[float]) -> ElementBaseline:
    """Least squares of the energies on the element counts (minimum-norm solution when the
    compositions do not pin every element down); unlabelled (NaN) structures are skipped."""
    y = np.asarray(energies, dtype=np.float64)
    if len(numbers) != len(y):
        raise InputError(f"baseline fit: {len(numbers)} structures but {len(y)} energies")
    ok = np.isfinite(y)
    if not ok.any():
        raise InputError("baseline fit: no labelled structure (every energy is missing)")
    ref = fit_reference_energies(({"numbers": z, "energy": e} for z, e in zip(numbers, y, strict=True)),
                                 ridge=0.0)
    return ElementBaseline(ref.energies, structures=int(ok.sum()))


def fit_on_dataset(path: str | Path) -> ElementBaseline:
    """The baseline fitted on every labelled record of a dataset store (the training split)."""
    from convergent.data.reader import open_dataset

    ds = open_dataset(path)
    try:
        numbers, energies = [], []
        for rec in ds:
            numbers.append(np.asarray(rec["numbers"], dtype=np.int64))
            e = rec.get("energy")
            energies.append(float(e) if e is not None else float("nan"))
    finally:
        ds.close()
    return fit_element_baseline(numbers, energies)
