"""Batched prediction with an ensemble of surrogates: energies, forces, uncertainty.

Units: energies eV, forces eV/Å. The uncertainty of a structure is the spread of the
ensemble (sample std over models): ``energy_std`` (eV, and per atom) and ``force_std``
(mean over atoms of the norm of the per-atom force std, eV/Å). A single model gives NaN
uncertainty.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convergent.core.errors import InputError
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.core.xyzfile import is_xyz, read_frames
from convergent.data.reader import open_dataset
from convergent.models.batching import atoms_to_record, batches_by_atom_budget, collate_records
from convergent.models.io import check_elements


@dataclass
class PredictionResult:
    """Per-structure predictions (arrays of length S, one entry per structure).

    ``energy_pred`` ensemble mean (eV); ``energy_true`` label or NaN; ``energy_std``
    ensemble std (eV, NaN for one model); ``force_std`` mean per-atom force spread
    (eV/Å); ``force_mae`` per structure (eV/Å, NaN without labels); ``n_atoms``;
    ``force_mae_total`` over all labelled atoms; ``seconds_per_structure`` wall time of
    the whole prediction divided by S.
    """

    keys: list[str]
    molecule_ids: list[str]
    n_atoms: np.ndarray
    energy_pred: np.ndarray
    energy_true: np.ndarray
    energy_std: np.ndarray
    force_std: np.ndarray
    force_mae: np.ndarray
    n_models: int
    seconds: float
    indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # largest per-atom force spread of each structure (eV/Å, NaN for one model)
    force_std_max: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # per atom, structures in order (filled only with ``keep_atoms``): atomic numbers,
    # ensemble-mean predicted forces and reference forces (eV/Å; NaN rows without labels)
    numbers: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    forces_pred: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    forces_true: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))
    # the per-element baseline of each structure, ``Σ ref[Z]`` (eV) with the first model's
    # element reference energies: its least-squares fit on its own training data
    baseline_pred: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def seconds_per_structure(self) -> float:
        return self.seconds / max(1, len(self.keys))

    @property
    def energy_mae(self) -> float:
        """Mean |E_pred - E_true| over labelled structures (eV); NaN if none."""
        ok = np.isfinite(self.energy_true)
        return float(np.abs(self.energy_pred[ok] - self.energy_true[ok]).mean()) if ok.any() else float("nan")

    @property
    def force_mae_total(self) -> float:
        """Force MAE over all labelled atoms and components (eV/Å); NaN if none."""
        ok = np.isfinite(self.force_mae)
        if not ok.any():
            return float("nan")
        w = self.n_atoms[ok]
        return float((self.force_mae[ok] * w).sum() / w.sum())

    @property
    def baseline_energy_mae(self) -> float:
        """Mean |baseline - E_true| over the labelled structures (eV); NaN if none."""
        ok = np.isfinite(self.energy_true) & np.isfinite(self.baseline_pred)
        if len(self.baseline_pred) != len(self) or not ok.any():
            return float("nan")
        return float(np.abs(self.baseline_pred[ok] - self.energy_true[ok]).mean())

    def summary(self) -> dict[str, Any]:
        model, base = self.energy_mae, self.baseline_energy_mae
        return {
            "structures": len(self),
            "models": self.n_models,
            "energy_mae_eV": model,
            "baseline_energy_mae_eV": base,
            "baseline_over_model": base / model if model > 0 else float("nan"),
            "force_mae_eV_per_A": self.force_mae_total,
            "mean_energy_std_eV": float(np.nanmean(self.energy_std)) if self.n_models > 1 else float("nan"),
            "mean_force_std_eV_per_A": float(np.nanmean(self.force_std)) if self.n_models > 1 else float("nan"),
            "seconds_per_structure": self.seconds_per_structure,
        }

    def rows(self) -> Iterable[dict[str, Any]]:
        for s in range(len(self)):
            yield {
                "key": self.keys[s],
                "molecule_id": self.molecule_ids[s],
                "n_atoms": int(self.n_atoms[s]),
                "energy_pred": float(self.energy_pred[s]),
                "baseline_pred": _num(self.baseline_pred[s]) if len(self.baseline_pred) else None,
                "energy_true": _num(self.energy_true[s]),
                "energy_std": _num(self.energy_std[s]),
                "force_std": _num(self.force_std[s]),
                "force_mae": _num(self.force_mae[s]),
            }

    def save_jsonl(self, path: str | Path) -> Path:
        """Write one JSON object per structure (atomically)."""
        text = "".join(dumps_json(r) + "\n" for r in self.rows())
        atomic_write_text(path, text)
        return Path(path)


def _num(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def load_ensemble(model_dirs: str | Path | Sequence[str | Path], device: str = "cpu",
                  quantize: str = "none") -> list[torch.nn.Module]:
    """Load one or several saved models (see :func:`convergent.models.io.load_model`), plain
    or INT8 (``quantize``, :func:`convergent.compress.qcheckpoint.load_surrogate`)."""
    from convergent.compress.qcheckpoint import load_surrogate

    dirs = [model_dirs] if isinstance(model_dirs, str | Path) else list(model_dirs)
    if not dirs:
        raise InputError("no model given", hint="pass --model DIR (repeat it for an ensemble)")
    return [load_surrogate(d, device, quantize) for d in dirs]


def predict_records(
    models: Sequence[torch.nn.Module],
    records: Sequence[Mapping[str, Any]],
    batch_atoms: int = 2048,
    device: str = "cpu",
    indices: Sequence[int] | None = None,
    keep_atoms: bool = False,
    source: str = "structure",
) -> PredictionResult:
    """Predict energies/forces of in-memory ``records`` with every model (atom-budget
    batches). ``source`` names them in errors: ``<source> #<index> (key <key>)``."""
    n_atoms = [len(r["numbers"]) for r in records]
    keys = [str(r.get("key", i)) for i, r in enumerate(records)]
    mids = [str(r.get("molecule_id", "") or "") for r in records]
    pos = list(indices) if indices is not None else list(range(len(records)))
    return _predict(models, lambda idx: [records[i] for i in idx], n_atoms, keys, mids,
                    batch_atoms, device, indices, keep_atoms,
                    where=lambda i: f"{source} #{pos[i]} (key {keys[i]})")


def _predict(
    models: Sequence[torch.nn.Module],
    fetch: Any,
    n_atoms_list: Sequence[int],
    keys: list[str],
    mids: list[str],
    batch_atoms: int,
    device: str,
    indices: Sequence[int] | None,
    keep_atoms: bool = False,
    where: Callable[[int], str] = lambda i: f"structure {i}",
) -> PredictionResult:
    """Core loop: ``fetch(positions) -> records``; only one batch is in memory at a time.
    ``keep_atoms`` also keeps every atom's number and predicted/reference forces. A
    structure with an element a model was not trained on raises InputError naming it
    and ``where(position)``."""
    t0 = time.perf_counter()
    s = len(n_atoms_list)
    n_atoms = np.asarray(n_atoms_list, dtype=np.int64)
    e_all = np.full((len(models), s), np.nan)
    f_std = np.full(s, np.nan)
    f_std_max = np.full(s, np.nan)
    f_mae = np.full(s, np.nan)
    e_true = np.full(s, np.nan)
    e_base = np.full(s, np.nan)
    ref = element_reference(models[0])
    per_atom_rows: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * s
    for idx in batches_by_atom_budget(n_atoms, batch_atoms):
        recs = fetch(idx)
        for k, i in enumerate(idx):
            check_elements(models, recs[k]["numbers"], where(i))
        batch = collate_records(recs).to(device)
        e_all[:, idx], fa = _batch_predict(models, batch)  # fa: [M, Ntot, 3]
        seg = batch.batch.cpu().numpy()
        counts = np.bincount(seg, minlength=len(idx))
        if len(models) > 1:
            per_atom = np.linalg.norm(fa.std(0, ddof=1), axis=1)
            f_std[idx] = np.bincount(seg, weights=per_atom, minlength=len(idx)) / counts
            mx = np.zeros(len(idx))
            np.maximum.at(mx, seg, per_atom)
            f_std_max[idx] = mx
        for k, i in enumerate(idx):
            if ref is not None:
                e_base[i] = float(ref[np.asarray(recs[k]["numbers"], np.int64)].sum())
            ev = recs[k].get("energy")
            if ev is not None and np.isfinite(float(ev)):
                e_true[i] = float(ev)
        if batch.forces is not None:
            err = np.abs(fa.mean(0) - batch.forces.cpu().double().numpy()).mean(1)
            f_mae[idx] = np.bincount(seg, weights=err, minlength=len(idx)) / counts
        if keep_atoms:
            _keep_atoms(per_atom_rows, idx, batch, fa.mean(0), counts)
    e_std = e_all.std(0, ddof=1) if len(models) > 1 else np.full(s, np.nan)
    return PredictionResult(
        keys=keys,
        molecule_ids=mids,
        n_atoms=n_atoms,
        energy_pred=e_all.mean(0),
        energy_true=e_true,
        energy_std=e_std,
        force_std=f_std,
        force_mae=f_mae,
        n_models=len(models),
        seconds=time.perf_counter() - t0,
        indices=np.asarray(indices if indices is not None else np.arange(s), np.int64),
        force_std_max=f_std_max,
        baseline_pred=e_base,
        **(_stack_atoms(per_atom_rows) if keep_atoms else {}),
    )


def element_reference(model: torch.nn.Module) -> np.ndarray | None:
    """The model's per-element reference energies indexed by Z (eV), None if it has none."""
    ref = getattr(getattr(model, "module", model), "atomref", None)
    if not isinstance(ref, torch.Tensor) or not bool((ref != 0).any()):
        return None
    return ref.detach().cpu().double().numpy()


def _batch_predict(models: Sequence[torch.nn.Module], batch: Any) -> tuple[np.ndarray, np.ndarray]:
    """Each model's energies [M, B] and forces [M, Ntot, 3] (autograd) of one batch."""
    energies, forces = [], []
    for model in models:
        with torch.enable_grad():
            pos = batch.positions.detach().clone().requires_grad_(True)
            e = model(batch.with_positions(pos))
            (g,) = torch.autograd.grad(e.sum(), pos)
        energies.append(e.detach().cpu().numpy())
        forces.append((-g).detach().cpu().double().numpy())
    return np.stack(energies), np.stack(forces)


def _keep_atoms(rows: list[Any], idx: Sequence[int], batch: Any, f_pred: np.ndarray,
                counts: np.ndarray) -> None:
    """Store each structure's (numbers, predicted forces, reference forces) in ``rows``."""
    z = batch.numbers.cpu().numpy()
    f_true = (batch.forces.cpu().double().numpy() if batch.forces is not None
              else np.full(f_pred.shape, np.nan))
    start = np.concatenate([[0], np.cumsum(counts)])
    for k, i in enumerate(idx):
        a, b = start[k], start[k + 1]
        rows[i] = (z[a:b], f_pred[a:b], f_true[a:b])


def _stack_atoms(rows: list[Any]) -> dict[str, np.ndarray]:
    """The per-atom fields of PredictionResult from per-structure rows (structure order)."""
    if not rows:
        return {}
    return {"numbers": np.concatenate([r[0] for r in rows]).astype(np.int64),
            "forces_pred": np.concatenate([r[1] for r in rows]),
            "forces_true": np.concatenate([r[2] for r in rows])}


def read_structures(path: str | Path) -> list[dict[str, Any]]:
    """Records from a dataset directory (convergent.data store) or an ASE-readable file."""
    p = Path(path)
    if p.is_dir():
        ds = open_dataset(p)
        return [ds[i] for i in range(len(ds))]
    if not p.is_file():
        raise InputError(f"{p}: no such dataset directory or structure file",
                         hint="pass a dataset written by 'convergent data' or an .extxyz file")
    if is_xyz(p):  # located errors: FILE:LINE
        frames = [atoms for _, atoms in read_frames(p)]
    else:
        import ase.io

        try:
            frames = ase.io.read(str(p), index=":")
        except Exception as exc:  # ASE raises many types for malformed files
            raise InputError(f"{p}: cannot read structures ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())})") from None
        frames = frames if isinstance(frames, list) else [frames]
    recs = []
    for i, a in enumerate(frames):
        rec = atoms_to_record(a, key=str(a.info.get("key", f"{p.stem}-{i}")))
        recs.append(rec)
    return recs


def predict_dataset(
    model_dirs: str | Path | Sequence[str | Path],
    dataset_path: str | Path,
    batch_atoms: int = 2048,
    device: str = "cpu",
    indices: Sequence[int] | None = None,
    quantize: str = "none",
    keep_atoms: bool = False,
) -> PredictionResult:
    """Predict every structure of a dataset directory or structure file.

    ``model_dirs``: one saved model or several (ensemble -> uncertainty). ``indices``
    restricts to a subset of the dataset (e.g. the validation split). ``keep_atoms`` keeps
    per-atom numbers and forces (for parity plots and errors per element).
    """
    models = load_ensemble(model_dirs, device, quantize)
    p = Path(dataset_path)
    if p.is_dir():  # stream from the dataset store: one batch of records in memory
        ds = open_dataset(p)
        idx = np.arange(len(ds)) if indices is None else np.asarray(indices, np.int64)
        counts = np.asarray(ds.column("n_atoms"), np.int64)[idx]
        all_keys, all_mids = ds.keys(), ds.molecule_ids()
        keys = [all_keys[i] for i in idx]
        mids = [all_mids[i] for i in idx]
        return _predict(models, lambda pos: [ds[int(idx[j])] for j in pos], counts.tolist(),
                        keys, mids, batch_atoms, device, idx, keep_atoms,
                        where=lambda j: f"{p} record #{int(idx[j])} (key {keys[j]})")
    records = read_structures(p)
    sel = list(range(len(records))) if indices is None else [int(i) for i in indices]
    return predict_records(models, [records[i] for i in sel], batch_atoms, device, sel, keep_atoms,
                           source=f"{p} frame")
