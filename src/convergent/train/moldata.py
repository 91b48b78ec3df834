"""Molecular task internals: dataset access, batch plan, sum-form loss, export.

Kept apart from :mod:`convergent.train.tasks` so the LM path never imports the
molecular model or the dataset store.

Loss: :mod:`convergent.models.losses` (``error_sums`` / ``loss_from_sums``), its sums
over a rank's micro-batch divided by the *global* molecule and atom counts of the step,
so the rank shares add up to the global-batch loss exactly.
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
from convergent.models.losses import error_sums, loss_from_sums
from convergent.models.molecular import build_model, energy_and_forces, fit_reference_energies
from convergent.train.molcolumns import ColumnStore
from convergent.train.taskapi import MicroBatch


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
    sums = error_sums(energy, forces, batch)
    loss = loss_from_sums(sums, norm["molecules"], norm["atoms"], force_weight, dp_world)
    stats = {k: v.detach() for k, v in sums.items()}
    stats["f_sq"] = stats["f_sq"].double()
    return loss, stats


def export(model: nn.Module, cfg: Any, directory: Path) -> None:
    save_model(
        model,
        cfg.model,
        directory,
        extra={"dataset": cfg.train.dataset, "steps": cfg.train.steps},
    )
