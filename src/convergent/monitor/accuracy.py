"""Held-out accuracy as a chemist reads it: model vs the per-element linear baseline.

:class:`HeldoutPredictions` is the record the demo's screen stage writes to
``screen/predictions.json`` and the report reads back (nothing else is needed to rebuild the
report). Energies in eV, forces in eV/Å; per-atom arrays are flat, structures in order.
The per-element references are the baseline's (fitted on the training split), so
``(E - Σ ref[Z]) / n`` is the energy per atom the composition alone does not explain.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convergent.core.elements import formula, symbol
from convergent.core.errors import RunDirError
from convergent.core.fsutil import atomic_write_text, dumps_json


def _floats(xs: Any) -> list[float | None]:
    return [float(x) if x is not None and math.isfinite(float(x)) else None for x in xs]


def _array(xs: Any) -> np.ndarray:
    return np.asarray([np.nan if x is None else x for x in xs], dtype=np.float64)


@dataclass
class AccuracySummary:
    """Held-out MAEs of the model and the baseline (eV, eV/atom, eV/Å) and their ratio."""

    structures: int
    energy_mae: float | None
    energy_mae_per_atom: float | None
    baseline_energy_mae: float | None
    baseline_energy_mae_per_atom: float | None
    baseline_over_model: float | None  # > 1: the model beats the baseline by that factor
    force_mae: float | None


@dataclass
class HeldoutPredictions:
    """What the screen stage predicted on the held-out molecules, with the baseline's."""

    n_atoms: list[int]
    energy_true: list[float | None]
    energy_pred: list[float | None]
    reference: str = "reference"  # the labelling method (GFN2-xTB, B3LYP, ...)
    keys: list[str] = field(default_factory=list)
    molecule_ids: list[str] = field(default_factory=list)
    baseline_pred: list[float | None] = field(default_factory=list)
    baseline_refs: dict[str, float] = field(default_factory=dict)  # atomic number -> eV
    baseline_structures: int = 0  # training structures the baseline was fitted on
    numbers: list[int] = field(default_factory=list)  # per atom
    forces_true: list[list[float | None]] = field(default_factory=list)  # per atom, eV/Å
    forces_pred: list[list[float | None]] = field(default_factory=list)
    force_mae: float | None = None  # over every labelled force component
    seconds_per_structure: float | None = None

    # -- arrays ------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        n = np.asarray(self.n_atoms, dtype=np.float64)
        out = {"n": n, "true": _array(self.energy_true), "pred": _array(self.energy_pred),
               "base": _array(self.baseline_pred) if self.baseline_pred else np.full(len(n), np.nan)}
        return out

    def atom_slices(self) -> list[slice]:
        """Each structure's slice of the per-atom arrays (empty when none were kept)."""
        if len(self.numbers) != sum(self.n_atoms):
            return []
        ends = np.cumsum(self.n_atoms).tolist()
        return [slice(e - k, e) for e, k in zip(ends, self.n_atoms, strict=True)]

    def reference_sums(self) -> np.ndarray | None:
        """``Σ ref[Z]`` per structure from the baseline's references (None without them)."""
        sl = self.atom_slices()
        if not self.baseline_refs or not sl:
            return None
        refs = {int(k): v for k, v in self.baseline_refs.items()}
        z = np.asarray(self.numbers, dtype=np.int64)
        return np.asarray([sum(refs.get(int(k), np.nan) for k in z[s]) for s in sl])

    def summary(self) -> AccuracySummary:
        a = self.arrays()
        ok = np.isfinite(a["true"]) & np.isfinite(a["pred"])
        okb = ok & np.isfinite(a["base"])

        def mae(x: np.ndarray, m: np.ndarray, per_atom: bool) -> float | None:
            if not m.any():
                return None
            err = np.abs(x[m] - a["true"][m]) / (a["n"][m] if per_atom else 1.0)
            return float(err.mean())

        e, b = mae(a["pred"], ok, False), mae(a["base"], okb, False)
        return AccuracySummary(
            structures=len(self.n_atoms), energy_mae=e,
            energy_mae_per_atom=mae(a["pred"], ok, True), baseline_energy_mae=b,
            baseline_energy_mae_per_atom=mae(a["base"], okb, True),
            baseline_over_model=b / e if b is not None and e else None,
            force_mae=self.force_mae)

    # -- JSON --------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("energy_true", "energy_pred", "baseline_pred"):
            d[k] = _floats(d[k])
        for k in ("forces_true", "forces_pred"):
            d[k] = [_floats(row) for row in d[k]]
        d["baseline_refs"] = {str(k): v for k, v in self.baseline_refs.items()}
        return {**asdict(self.summary()), **d}  # the summary on top, for readers of numbers

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "predictions") -> HeldoutPredictions:
        """Read a record; files written before the baseline existed lack its fields."""
        names = set(cls.__dataclass_fields__)
        try:
            return cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as exc:
            raise RunDirError(f"{source}: not a predictions record ({exc})") from None

    def save(self, path: Path) -> None:
        atomic_write_text(path, dumps_json(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> HeldoutPredictions | None:
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise RunDirError(f"{path}: unreadable predictions ({exc})") from None
        if not isinstance(d, dict):
            raise RunDirError(f"{path}: not a predictions record (a JSON object is expected)")
        return cls.from_json(d, str(path))


@dataclass
class ElementError:
    """Errors attributed to one element: its atoms' force MAE, and the energy MAE (eV/atom)
    of the held-out structures that contain it, for the model and the baseline."""

    element: str
    atoms: int
    force_mae: float | None
    structures: int
    energy_mae_per_atom: float | None
    baseline_energy_mae_per_atom: float | None


def element_errors(p: HeldoutPredictions) -> list[ElementError]:
    sl = p.atom_slices()
    if not sl:
        return []
    a = p.arrays()
    z = np.asarray(p.numbers, dtype=np.int64)
    ft, fp = forces_array(p.forces_true), forces_array(p.forces_pred)
    err_e = np.abs(a["pred"] - a["true"]) / a["n"]
    err_b = np.abs(a["base"] - a["true"]) / a["n"]
    out = []
    for el in np.unique(z).tolist():
        atoms = z == el
        ferr = np.abs(fp[atoms] - ft[atoms]) if len(ft) == len(z) and len(fp) == len(z) else np.zeros(0)
        ferr = ferr[np.isfinite(ferr)]
        has = np.asarray([(z[s] == el).any() for s in sl])
        e, b = err_e[has & np.isfinite(err_e)], err_b[has & np.isfinite(err_b)]
        out.append(ElementError(symbol(el), int(atoms.sum()), float(ferr.mean()) if ferr.size else None,
                                int(has.sum()), float(e.mean()) if e.size else None,
                                float(b.mean()) if b.size else None))
    return out


def forces_array(rows: list[list[float | None]]) -> np.ndarray:
    return np.asarray([[np.nan if x is None else x for x in r] for r in rows], dtype=np.float64).reshape(-1, 3)


@dataclass
class Outlier:
    """One held-out structure with a large model energy error."""

    key: str
    molecule_id: str
    formula: str
    n_atoms: int
    error: float  # model - reference (eV)
    baseline_error: float | None  # baseline - reference (eV)
    force_mae: float | None  # eV/Å over this structure's components


def outliers(p: HeldoutPredictions, k: int = 8) -> list[Outlier]:
    """The ``k`` structures with the largest |model energy error|, largest first, at most
    one per molecule (the frames of one molecule tend to share their error)."""
    a = p.arrays()
    err = a["pred"] - a["true"]
    size = np.where(np.isfinite(err), np.abs(err), -1.0)
    order, seen = [], set()
    for i in np.argsort(-size, kind="stable").tolist():
        mol = p.molecule_ids[i] if i < len(p.molecule_ids) and p.molecule_ids[i] else i
        if size[i] < 0 or len(order) == k:
            break
        if mol not in seen:
            seen.add(mol)
            order.append(i)
    sl = p.atom_slices()
    ft, fp = forces_array(p.forces_true), forces_array(p.forces_pred)
    have_f = bool(sl) and len(ft) == len(fp) == sum(p.n_atoms)
    out = []
    for i in order:
        key = p.keys[i] if i < len(p.keys) else str(i)
        form = formula(np.asarray(p.numbers)[sl[i]]) if sl else "?"
        fm = float(np.nanmean(np.abs(fp[sl[i]] - ft[sl[i]]))) if have_f else None
        be = float(a["base"][i] - a["true"][i]) if np.isfinite(a["base"][i]) else None
        mol = p.molecule_ids[i] if i < len(p.molecule_ids) else ""
        out.append(Outlier(key, mol, form, int(a["n"][i]), float(err[i]), be,
                           fm if fm is not None and math.isfinite(fm) else None))
    return out
