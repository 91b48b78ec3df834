"""Molecular task internals: dataset access, batch plan, sum-form loss, export.

Kept apart from :mod:`convergent.train.tasks` so the LM path never imports the
molecular model or the dataset store.

Loss: :mod:`convergent.models.losses` (``error_sums`` / ``loss_from_sums``), its sums
over a rank's micro-batch divided by the *global* molecule and atom counts of the step,
so the rank shares add up to the global-batch loss exactly.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from convergent.core.elements import symbol
from convergent.core.errors import ConfigError, DataError
from convergent.data.cache import ShardCache
from convergent.data.reader import open_dataset
from convergent.models.batching import batches_by_atom_budget
from convergent.models.io import load_model, save_model
from convergent.models.losses import error_sums, loss_from_sums
from convergent.models.molecular import build_model, energy_and_forces, fit_reference_energies
from convergent.train.molcolumns import ColumnStore
from convergent.train.taskapi import MicroBatch

if TYPE_CHECKING:
    from convergent.config import ConvergentConfig
    from convergent.data.config import DataConfig
    from convergent.models.config import ModelConfig


class MoleculeSource:
    """Labelled records (records with a finite energy) of one or more dataset directories,
    read in that order, cached.

    With ``data.cache_dir`` set (``data_cfg``), shard data is read through the node-local
    cache tier (:class:`convergent.data.cache.ShardCache`, budget ``data.cache_bytes``):
    each shard is copied once per node, checksum-verified, and read from the copy. The
    records and their order are the same either way, so losses do not change.
    ``order="key"`` sorts the records by key (a dataset filled in arrival order, as
    learn's labels are, then gives the same plan in every run); ``bootstrap_seed``
    resamples them with replacement (seeded), keeping for each element the draw missed
    its first record, so a model trained on the resample knows every element.
    """

    def __init__(self, path: str | Path, data_cfg: DataConfig | None = None, extra: Sequence[str | Path] = (),
                 order: str = "stored", bootstrap_seed: int | None = None) -> None:
        self.path = Path(path)
        paths = [self.path, *(Path(p) for p in extra)]
        for p in paths:
            if not p.exists():
                raise DataError(f"dataset not found: {p}", hint="set train.dataset")
        self.cache = None
        if data_cfg is not None and data_cfg.cache_dir:
            self.cache = ShardCache(
                Path(data_cfg.cache_dir).expanduser(), budget_bytes=data_cfg.cache_bytes
            )
        self.parts = [open_dataset(p, self.cache) for p in paths]
        self.ds = self.parts[0]
        part, row, counts = [], [], []
        for k, ds in enumerate(self.parts):
            n_atoms = np.asarray(ds.column("n_atoms"), dtype=np.int64)
            try:
                ok = np.isfinite(np.asarray(ds.column("energy"), dtype=np.float64))
            except DataError:
                ok = np.ones(len(n_atoms), bool)
            rows = np.nonzero(ok)[0]
            part.append(np.full(len(rows), k))
            row.append(rows)
            counts.append(n_atoms[rows])
        self._part, self._row = np.concatenate(part), np.concatenate(row)
        n_atoms = np.concatenate(counts)
        if len(self._row) == 0:
            raise DataError(f"{self.path}: no labelled records (every energy is missing)")
        pick = np.arange(len(self._row))
        if order == "key":
            keys = np.array([k for ds, r in zip(self.parts, row, strict=True)
                             for k in np.asarray(ds.keys(), dtype=object)[r]], dtype=object)
            pick = np.argsort(keys, kind="stable")
        if bootstrap_seed is not None:
            pick = self._bootstrap(pick, bootstrap_seed)
        self._part, self._row = self._part[pick], self._row[pick]
        self.atom_counts = [int(n) for n in n_atoms[pick]]
        self._cache: dict[int, dict[str, Any]] = {}
        self._columns: Any = None

    def _bootstrap(self, pick: np.ndarray, seed: int) -> np.ndarray:
        """A seeded resample of ``pick`` with replacement (sorted), plus the first record
        of ``pick`` holding each element the draw missed."""
        j = np.sort(np.random.default_rng(seed).integers(0, len(pick), len(pick)))
        elements = [set(np.asarray(self._read(int(i))["numbers"]).tolist()) for i in pick]
        have = set().union(*(elements[k] for k in np.unique(j)))
        extra = []
        for k, i in enumerate(pick):
            if elements[k] - have:
                extra.append(i)
                have |= elements[k]
        return np.concatenate([pick[j], np.asarray(extra, dtype=pick.dtype)])

    def _read(self, i: int) -> dict[str, Any]:
        """Record at position ``i`` of the unsorted concatenation."""
        return self.parts[int(self._part[i])][int(self._row[i])]

    def __len__(self) -> int:
        return len(self._row)

    def record(self, i: int) -> dict[str, Any]:
        rec = self._cache.get(i)
        if rec is None:
            rec = self.read(i)
            self._cache[i] = rec
        return rec

    def records(self, idx: list[int]) -> list[dict[str, Any]]:
        return [self.record(i) for i in idx]

    def read(self, i: int) -> dict[str, Any]:
        """Record ``i`` read from the store (not cached)."""
        return self.parts[int(self._part[i])][int(self._row[i])]

    def batch(self, idx: list[int]) -> Any:
        """The AtomsBatch of records ``idx`` (columnar gather, :mod:`.molcolumns`)."""
        if self._columns is None:
            self._columns = ColumnStore(self)
        return self._columns.batch(idx)


def build(cfg: ConvergentConfig, source: MoleculeSource) -> nn.Module:
    """The surrogate of ``model.kind`` (molecular or MACE) with element reference energies
    fitted on the training set, or warm-started from ``train.init_from`` (its references
    refitted as ``train.init_reference`` says), with ``train.freeze``'s parameters frozen.
    It records every element of the records it fitted on."""
    recs = [source.record(i) for i in range(min(len(source), 5000))]
    t = cfg.train
    mode = t.init_reference if t.init_from else "refit"
    warm = _warm_model(cfg, recs) if t.init_from else None
    model = new_model(cfg.model, recs, warm)
    if warm is not None:
        model.load_state_dict(warm.state_dict())
        model.trained_elements = warm.trained_elements
    if mode != "keep":
        ref = fit_reference_energies(recs, per_element=t.reference_fit == "per_element")
        if mode == "offsets":  # the network was trained in the warm model's units
            ref.scale, ref.shift = float(model.scale), float(model.shift)
        model.set_reference(ref)
    seen = {int(z) for r in recs for z in r["numbers"]}
    model.trained_elements = tuple(sorted(seen | set(model.trained_elements or ())))
    for name, p in model.named_parameters():
        p.requires_grad_(not any(fnmatch.fnmatch(name, pat) for pat in t.freeze))
    return model


def new_model(model_cfg: ModelConfig, records: list[dict[str, Any]], warm: nn.Module | None = None) -> nn.Module:
    """A freshly initialised network of ``model_cfg.kind`` for training data ``records``:
    MACE's element table and neighbour normalisation come from them (from ``warm``, the
    model it will be warm-started from, when given); the molecular model needs neither."""
    if model_cfg.kind in ("schnet", "painn"):
        from convergent.models.schnetpack import SpkModel

        return SpkModel(model_cfg)
    if model_cfg.kind != "mace":
        return build_model(model_cfg)
    from convergent.models.mace import MaceModel, build_mace

    if warm is None:
        return build_mace(model_cfg, records)
    assert isinstance(warm, MaceModel)
    return MaceModel(model_cfg, warm.elements, float(warm.avg_num_neighbors))


def _warm_model(cfg: ConvergentConfig, records: list[dict[str, Any]]) -> nn.Module:
    """The model of ``train.init_from``, refused (ConfigError) when it is another kind or,
    for MACE, lacks an element of the data (MACE's element table is fixed when built)."""
    warm, warm_cfg = load_model(cfg.train.init_from, "cpu")
    where = f"train.init_from={cfg.train.init_from}"
    if warm_cfg.kind != cfg.model.kind:
        raise ConfigError(f"{where} is a model.kind={warm_cfg.kind} model, not {cfg.model.kind}",
                          hint=f"set model.kind={warm_cfg.kind} or warm-start from a {cfg.model.kind} model")
    if cfg.model.kind == "mace":
        seen = {int(z) for r in records for z in r["numbers"]}
        missing = sorted(seen - set(warm.elements))
        if missing:
            names = ", ".join(symbol(z) for z in missing)
            raise ConfigError(f"{where}: the data holds {names}, not in this MACE model's element "
                              f"table ({', '.join(symbol(z) for z in warm.elements)})",
                              hint="MACE's elements are fixed when it is first trained; "
                                   "train it from scratch on data with every element")
    return warm


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


def export(model: nn.Module, cfg: ConvergentConfig, directory: Path) -> None:
    save_model(
        model,
        cfg.model,
        directory,
        extra={"dataset": cfg.train.dataset, "steps": cfg.train.steps},
    )
