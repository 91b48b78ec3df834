"""Molecular task internals: dataset access, batch plan, sum-form loss, export.

Kept apart from :mod:`convergent.train.tasks` so the LM path never imports the
molecular model or the dataset store.

Loss (mirrors :func:`convergent.models.losses.energy_force_loss`)::

    loss = mean_molecules((ΔE / n_atoms)^2) + force_weight * mean_components(ΔF^2)

computed from sums over a rank's micro-batch divided by the *global* molecule and
atom counts of the step, so the rank shares add up to the global-batch loss exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from convergent.data.cache import ShardCache
from convergent.data.reader import open_dataset
from convergent.errors import DataError
from convergent.models.batching import batches_by_atom_budget
from convergent.models.io import save_model
from convergent.models.molecular import build_model, energy_and_forces, fit_reference_energies
from convergent.train.molcolumns import ColumnStore
from convergent.train.taskapi import MicroBatch

STAT_KEYS = ["e_sq", "f_sq", "e_abs", "e_abs_pa", "f_abs", "molecules", "atoms"]


class MoleculeSource:
    """Labelled records of a dataset directory (records with a finite energy), cached.

    With ``data.cache_dir`` set (``data_cfg``), shard data is read through the node-local
    cache tier (:class:`convergent.data.cache.ShardCache`, budget ``data.cache_bytes``):
    each shard is copied once per node, checksum-verified, and read from the copy. The
    records and their order are the same either way, so losses do not change.
    """

    def __init__(self, path: str | Path, data_cfg: Any = None) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise DataError(f"dataset not found: {self.path}", hint="set train.dataset")
        self.cache = None
        if data_cfg is not None and data_cfg.cache_dir:
            self.cache = ShardCache(
                Path(data_cfg.cache_dir).expanduser(), budget_bytes=data_cfg.cache_bytes
            )
        self.ds = open_dataset(self.path, self.cache)
        n_atoms = np.asarray(self.ds.column("n_atoms"), dtype=np.int64)
        try:
            energy = np.asarray(self.ds.column("energy"), dtype=np.float64)
            ok = np.isfinite(energy)
        except DataError:
            ok = np.ones(len(n_atoms), bool)
        self.index = np.nonzero(ok)[0]
        if len(self.index) == 0:
            raise DataError(f"{self.path}: no labelled records (every energy is missing)")
        self.atom_counts = [int(n) for n in n_atoms[self.index]]
        self._cache: dict[int, dict[str, Any]] = {}
        self._columns: Any = None

    def __len__(self) -> int:
        return len(self.index)

    def record(self, i: int) -> dict[str, Any]:
        rec = self._cache.get(i)
        if rec is None:
            rec = self.ds[int(self.index[i])]
            self._cache[i] = rec
        return rec

    def records(self, idx: list[int]) -> list[dict[str, Any]]:
        return [self.record(i) for i in idx]

    def read(self, i: int) -> dict[str, Any]:
        """Record ``i`` read from the store (not cached)."""
        return self.ds[int(self.index[i])]

    def batch(self, idx: list[int]) -> Any:
        """The AtomsBatch of records ``idx`` (columnar gather, :mod:`.molcolumns`)."""
        if self._columns is None:
            self._columns = ColumnStore(self)
        return self._columns.batch(idx)


def build(cfg: Any, source: MoleculeSource) -> nn.Module:
    """The molecular model with element reference energies fitted on the training set."""
    model = build_model(cfg.model)
    n = min(len(source), 5000)
    ref = fit_reference_energies(source.record(i) for i in range(n))
    model.set_reference(ref)
    return model


def plan_epoch(
    atom_counts: list[int], budget: int, parts: int, seed: int | None
) -> list[list[int]]:
    """Global batches of one epoch by atom budget (seeded shuffle); each has >= ``parts``
    molecules (a short tail batch is dropped)."""
    batches = batches_by_atom_budget(atom_counts, budget, shuffle_seed=seed)
    return [b for b in batches if len(b) >= parts]


def micro_batch(source: MoleculeSource, idx: list[int], norm: dict[str, float]) -> MicroBatch:
    batch = source.batch(idx)
    return MicroBatch(batch, len(idx), batch.num_atoms, norm)


def loss(
    model: nn.Module, mb: MicroBatch, dp_world: int, force_weight: float, training: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scaled loss, sum statistics) of one micro-batch (see the module doc)."""
    energy, forces = energy_and_forces(model, mb.data, training=training)
    return loss_from_predictions(energy, forces, mb.data, mb.norm, dp_world, force_weight)


def loss_from_predictions(
    energy: torch.Tensor,
    forces: torch.Tensor,
    batch: Any,
    norm: dict[str, float],
    dp_world: int,
    force_weight: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scaled loss, sum statistics) of predicted ``energy`` [B] eV and ``forces``
    [N, 3] eV/Å against the labels of ``batch``, over the global counts ``norm``."""
    de = energy.to(torch.float64) - batch.energy.to(torch.float64)
    n = batch.n_atoms.to(torch.float64)
    de_pa = de / n
    e_sq = (de_pa * de_pa).sum()
    stats = {
        "e_abs": de.detach().abs().sum(),
        "e_abs_pa": de_pa.detach().abs().sum(),
        "molecules": torch.tensor(float(batch.n_molecules)),
        "atoms": torch.tensor(float(batch.num_atoms)),
    }
    loss_t = e_sq / norm["molecules"]
    stats["e_sq"] = e_sq.detach()
    if batch.forces is not None:
        df = forces.float() - batch.forces.float()
        f_sq = (df * df).sum()
        stats["f_sq"] = f_sq.detach().double()
        stats["f_abs"] = df.detach().abs().sum().double()
        if force_weight > 0:
            loss_t = loss_t + force_weight * f_sq.double() / (3.0 * norm["atoms"])
    else:
        stats["f_sq"] = torch.zeros((), dtype=torch.float64)
        stats["f_abs"] = torch.zeros((), dtype=torch.float64)
    return (loss_t * dp_world).to(torch.float32), stats


def finalize(sums: dict[str, float], force_weight: float) -> dict[str, float]:
    mol = max(sums.get("molecules", 0.0), 1.0)
    comps = max(3.0 * sums.get("atoms", 0.0), 1.0)
    e_term = sums.get("e_sq", 0.0) / mol
    f_term = sums.get("f_sq", 0.0) / comps
    return {
        "loss": e_term + force_weight * f_term,
        "energy_mae": sums.get("e_abs", 0.0) / mol,
        "energy_mae_per_atom": sums.get("e_abs_pa", 0.0) / mol,
        "force_mae": sums.get("f_abs", 0.0) / comps,
    }


def export(model: nn.Module, cfg: Any, directory: Path) -> None:
    save_model(
        model,
        cfg.model,
        directory,
        extra={"dataset": cfg.train.dataset, "steps": cfg.train.steps},
    )
