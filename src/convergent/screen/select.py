"""Pick the most uncertain candidates for the next simulations (active learning)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.data.reader import open_dataset
from convergent.screen.predict import PredictionResult, read_structures


def uncertainty(result: PredictionResult, by: str = "force_std") -> np.ndarray:
    """Per-structure uncertainty: ``force_std`` (eV/Å) or ``energy_std`` per atom (eV)."""
    if by == "force_std":
        return result.force_std
    if by == "energy_std":
        return result.energy_std / np.maximum(result.n_atoms, 1)
    raise ValueError(f"unknown uncertainty {by!r} (energy_std | force_std)")


def select_uncertain(
    result: PredictionResult, k: int, by: str = "force_std", max_per_molecule: int = 0
) -> list[int]:
    """Positions (into ``result``) of the ``k`` most uncertain structures, most first.

    NaN uncertainties (single model) are never picked. ``max_per_molecule > 0`` limits
    picks per molecule id so one floppy molecule cannot take the whole budget. Ties
    are broken by position (stable).
    """
    u = uncertainty(result, by)
    order = np.argsort(-np.nan_to_num(u, nan=-np.inf), kind="stable")
    picked: list[int] = []
    per_mol: Counter[str] = Counter()
    for i in order.tolist():
        if len(picked) >= k or not np.isfinite(u[i]):
            break
        mid = result.molecule_ids[i]
        if max_per_molecule > 0 and per_mol[mid] >= max_per_molecule:
            continue
        per_mol[mid] += 1
        picked.append(i)
    return picked


def write_selection(
    result: PredictionResult,
    picked: Sequence[int],
    records: Sequence[Mapping[str, Any]] | None,
    out_dir: str | Path,
    by: str = "force_std",
) -> dict[str, Path]:
    """Write ``selected.json`` (keys, indices, uncertainties) and, given the picked
    structures' records (``records[k]`` is the record of ``picked[k]``), ``selected.extxyz``
    (structures to simulate next). Returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    u = uncertainty(result, by)
    items = [
        {
            "key": result.keys[i],
            "index": int(result.indices[i]) if len(result.indices) else int(i),
            "molecule_id": result.molecule_ids[i],
            "uncertainty": float(u[i]),
            "energy_pred": float(result.energy_pred[i]),
        }
        for i in picked
    ]
    paths = {"json": out / "selected.json"}
    atomic_write_text(paths["json"], dumps_json({"by": by, "selected": items}, indent=2))
    if records is not None:
        import io

        import ase.io
        from ase import Atoms

        frames = []
        for i, r in zip(picked, records, strict=True):
            pbc = r.get("pbc")
            pbc = np.zeros(3, bool) if pbc is None else np.asarray(pbc, bool)
            a = Atoms(numbers=r["numbers"], positions=r["positions"],
                      cell=r.get("cell") if pbc.any() else None, pbc=pbc)
            a.info["key"] = result.keys[i]
            a.info["molecule_id"] = result.molecule_ids[i]
            frames.append(a)
        buf = io.StringIO()
        ase.io.write(buf, frames, format="extxyz")
        paths["extxyz"] = out / "selected.extxyz"
        atomic_write_text(paths["extxyz"], buf.getvalue())
    return paths


def fetch_records(dataset: str | Path, indices: Sequence[int]) -> list[dict[str, Any]]:
    """Records at dataset ``indices`` (a dataset directory or an ASE-readable file)."""
    p = Path(dataset)
    if p.is_dir():
        ds = open_dataset(p)
        return [ds[int(i)] for i in indices]
    recs = read_structures(p)
    return [recs[int(i)] for i in indices]
