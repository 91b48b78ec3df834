"""MACE (mace-torch's ``ScaleShiftMACE``) as a model of the loop: ``model.kind: mace``.

Energy in eV, forces in eV/Å, distances in Å.

:class:`MaceModel` wraps MACE's own network behind the interface of the molecular
surrogate (:class:`~convergent.models.molecular.MolecularTransformer`), so the one
training loop, the loss, the exporter, the ASE calculator and screening use it unchanged:

* ``forward(batch, per_atom=False, with_forces=False)`` returns energies float64[B] (and
  per-atom energies float64[N]); ``with_forces`` returns ``(energies, None)``: forces are
  ``-dE/dpositions`` by autograd (:func:`~convergent.models.molecular.energy_and_forces`),
  so MACE is called with ``compute_force=False`` and never differentiates itself.
* per-atom energy = MACE's scaled interaction energy (``scale`` = the training set's RMS
  force, as MACE's ``rms_forces_scaling``) + ``atomref[Z]`` + the ZBL prior of
  ``model.repulsion`` (:mod:`convergent.models.repulsion`) — the molecular model's
  treatment: the element reference energies are our least-squares fit
  (:func:`~convergent.models.molecular.fit_reference_energies`), kept in float64 here
  (MACE's own E0 block is left at zero; in float32 it would round energies of hundreds of
  eV), and :meth:`set_reference` installs them as the molecular model's does.
* MACE's one-hot element table (``net.atomic_numbers``) and ``avg_num_neighbors`` (the
  mean neighbour count within ``r_max`` over the training set) are fixed when the model is
  built from data; both are in the state dict, so :func:`convergent.models.io.load_model`
  rebuilds the same network from a saved directory.

MACE's input dict is built from our :class:`~convergent.models.batching.AtomsBatch` with
neighbours from :func:`convergent.models.atoms.neighbor_list` (sender = ``edge_index[0]``,
receiver = ``edge_index[1]``, MACE's vector ``r_recv - r_send + shift``), as
every side of the molecular benches does. mace-torch is optional (``pip install 'convergent[mace]'``):
it is imported only when a MACE model is built (:func:`import_mace`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import logging
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from convergent.core.errors import NotAvailableError
from convergent.models.atoms import neighbor_list
from convergent.models.batching import AtomsBatch, batches_by_atom_budget, collate_records
from convergent.models.config import ModelConfig
from convergent.models.molecular import install_reference
from convergent.models.repulsion import zbl_atom_energies

INSTALL_HINT = "pip install 'convergent[mace]' (mace-torch), or use model.kind=molecular"
_TORCH_LOAD_KEY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def mace_installed() -> bool:
    """Whether mace-torch can be found, without importing it (a cheap pre-launch check)."""
    try:
        return importlib.util.find_spec("mace") is not None
    except (ImportError, ValueError):  # a blocked or half-removed package
        return False


def import_mace() -> tuple[Any, Any]:
    """``(mace.modules, e3nn.o3)``, imported quietly; :class:`NotAvailableError` naming the
    extra when mace-torch is missing.

    ``import mace`` prints a notice about CUDA-only kernels and sets
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` for the whole process (e3nn loads its constants
    with a plain ``torch.load``); the variable is put back as it was, so no later
    ``torch.load`` of this process unpickles arbitrary objects.
    """
    before = os.environ.get(_TORCH_LOAD_KEY)
    prev = logging.root.manager.disable
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            # mace first: it sets the variable e3nn's import needs
            modules = importlib.import_module("mace.modules")
            o3 = importlib.import_module("e3nn.o3")
    except ImportError as exc:
        raise NotAvailableError(
            f"model.kind=mace needs mace-torch, which is not installed ({exc})",
            hint=INSTALL_HINT,
        ) from None
    finally:
        logging.disable(prev)
        if before is None:
            os.environ.pop(_TORCH_LOAD_KEY, None)
        else:
            os.environ[_TORCH_LOAD_KEY] = before
    return modules, o3


def avg_num_neighbors(records: Iterable[Mapping[str, Any]], r_max: float,
                      batch_atoms: int = 4096) -> float:
    """Mean number of neighbours within ``r_max`` Å per atom over ``records`` (MACE's
    ``avg_num_neighbors``, which normalises its message sums)."""
    recs = list(records)
    edges = atoms = 0
    for idx in batches_by_atom_budget([len(r["numbers"]) for r in recs], batch_atoms):
        b = collate_records([recs[i] for i in idx])
        nl = neighbor_list(b.positions, r_max, b.batch, b.n_molecules, b.cell, b.pbc)
        edges += nl.num_edges
        atoms += b.num_atoms
    return edges / max(atoms, 1)


class MaceModel(nn.Module):
    """MACE's ``ScaleShiftMACE`` over the elements ``elements`` (see the module doc)."""

    def __init__(self, cfg: ModelConfig, elements: Sequence[int], avg_neighbors: float) -> None:
        super().__init__()
        modules, o3 = import_mace()
        m = cfg.mace
        zs = sorted({int(z) for z in elements})
        if not zs or zs[0] < 1 or zs[-1] > cfg.max_z:
            raise ValueError(f"MACE elements must be in [1, model.max_z={cfg.max_z}], got {zs}")
        self.cfg = cfg
        self.dtype = getattr(torch, m.dtype)
        with warnings.catch_warnings():  # e3nn scripts its kernels (torch.jit, deprecated)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings("ignore", "The TorchScript type system", UserWarning)
            net = modules.ScaleShiftMACE(
                r_max=m.r_max, num_bessel=m.num_radial_basis,
                num_polynomial_cutoff=m.num_polynomial_cutoff, max_ell=m.max_ell,
                interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
                interaction_cls_first=modules.interaction_classes["RealAgnosticInteractionBlock"],
                num_interactions=m.num_interactions, num_elements=len(zs),
                hidden_irreps=o3.Irreps(m.hidden_irreps), MLP_irreps=o3.Irreps(f"{m.readout_mlp}x0e"),
                atomic_energies=np.zeros(len(zs)),  # E0s: our float64 atomref (module doc)
                avg_num_neighbors=float(avg_neighbors), atomic_numbers=zs,
                correlation=m.correlation, gate=modules.gate_dict["silu"],
                radial_MLP=list(m.radial_mlp), radial_type="bessel",
                atomic_inter_scale=1.0, atomic_inter_shift=0.0,
            )
        self.net = net.to(self.dtype)
        self.register_buffer("atomref", torch.zeros(cfg.max_z + 1, dtype=torch.float64))
        self.register_buffer("avg_num_neighbors", torch.tensor(float(avg_neighbors), dtype=torch.float64))
        index = torch.full((cfg.max_z + 1,), -1, dtype=torch.int64)
        index[torch.tensor(zs)] = torch.arange(len(zs))
        self.register_buffer("element_index", index, persistent=False)
        self.last_neighbors: Any = None  # NeighborList of the last forward (diagnostics)
        # atomic numbers of the training data (set_reference; models/io records it)
        self.trained_elements: tuple[int, ...] | None = None

    @property
    def elements(self) -> tuple[int, ...]:
        """The atomic numbers of MACE's element table (fixed at build)."""
        return tuple(int(z) for z in self.net.atomic_numbers.tolist())

    @property
    def input_dtype(self) -> torch.dtype:
        """The floating type the network computes in (callers may collate positions in it)."""
        return self.dtype

    @property
    def scale(self) -> torch.Tensor:
        """Per-atom energy scale (eV) of MACE's interaction energy."""
        return self.net.scale_shift.scale

    @property
    def shift(self) -> torch.Tensor:
        """Per-atom energy shift (eV) of MACE's interaction energy."""
        return self.net.scale_shift.shift

    def set_reference(self, ref: Any) -> None:
        """Install fitted element reference energies (eV, a ``ReferenceEnergies``) and the
        per-atom scale/shift, as the molecular model does."""
        self.trained_elements = install_reference(ref, self.cfg.max_z, self.atomref,
                                                  self.scale, self.shift)

    def inputs(self, batch: AtomsBatch) -> dict[str, torch.Tensor]:
        """MACE's input dict of ``batch`` (positions in the network's dtype)."""
        cfg = self.cfg
        z = batch.numbers
        if z.numel() and (int(z.min()) < 1 or int(z.max()) > cfg.max_z):
            raise ValueError(f"atomic numbers must be in [1, {cfg.max_z}]")
        idx = self.element_index[z]
        if bool((idx < 0).any()):
            missing = sorted({int(v) for v in z[idx < 0].tolist()})
            raise ValueError(f"MACE: element(s) {missing} not in its element table {list(self.elements)}")
        # MACE sets requires_grad on the positions it is given: a tensor of its own, never
        # the caller's leaf (a view keeps the caller's gradient path, and module hooks such
        # as the FLOP counter's see no leaf inputs)
        pos = batch.positions.to(self.dtype)
        pos = pos.view_as(pos) if pos.requires_grad else pos.detach()
        nl = neighbor_list(batch.positions.detach(), cfg.mace.r_max, batch.batch, batch.n_molecules,
                           batch.cell, batch.pbc, cfg.max_neighbors, cfg.neighbor_overflow)
        self.last_neighbors = nl
        ptr = torch.zeros(batch.n_molecules + 1, dtype=torch.int64, device=z.device)
        ptr[1:] = torch.cumsum(batch.n_atoms.to(z.device), 0)
        cell = (batch.cell.to(self.dtype).reshape(-1, 3, 3) if batch.cell is not None
                else torch.zeros(batch.n_molecules, 3, 3, dtype=self.dtype, device=z.device))
        return {
            "positions": pos,
            "node_attrs": nn.functional.one_hot(idx, len(self.elements)).to(self.dtype),
            "edge_index": nl.edge_index,
            "shifts": nl.shifts.to(self.dtype),
            "unit_shifts": nl.cell_shifts.to(self.dtype),
            "batch": batch.batch,
            "ptr": ptr,
            "cell": cell,
        }

    def forward(self, batch: AtomsBatch, per_atom: bool = False, with_forces: bool = False) -> Any:
        """Energies float64[B] eV (and per-atom energies float64[N] if ``per_atom``);
        ``with_forces=True`` returns ``(energies, None)`` (forces by autograd)."""
        data = self.inputs(batch)
        out = self.net(data, training=self.training, compute_force=False)
        z = batch.numbers
        atom_e = out["node_energy"].to(torch.float64) + self.atomref[z]  # E0 = 0 in MACE
        if self.cfg.repulsion == "zbl":
            src, dst = data["edge_index"][0], data["edge_index"][1]
            pos = data["positions"]
            vec = pos[dst] - pos[src] + data["shifts"]
            r = torch.sqrt((vec * vec).sum(-1) + 1e-12)
            atom_e = atom_e + zbl_atom_energies(z, src, dst, r, self.cfg.repulsion_scale)
        energy = torch.zeros(batch.n_molecules, dtype=torch.float64, device=atom_e.device)
        energy = energy.index_add(0, batch.batch, atom_e)
        if with_forces:
            return energy, None
        return (energy, atom_e) if per_atom else energy


def build_mace(cfg: ModelConfig, records: Sequence[Mapping[str, Any]]) -> MaceModel:
    """A fresh :class:`MaceModel` for training data ``records``: its element table is their
    elements and ``avg_num_neighbors`` their mean neighbour count within ``r_max``."""
    elements = {int(z) for r in records for z in np.asarray(r["numbers"]).ravel()}
    return MaceModel(cfg, sorted(elements), avg_num_neighbors(records, cfg.mace.r_max))


def mace_from_state(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> MaceModel:
    """The :class:`MaceModel` a saved state dict belongs to (its element table and
    ``avg_num_neighbors`` are in it); load the weights with ``load_state_dict``."""
    zs = [int(z) for z in state["net.atomic_numbers"].tolist()]
    return MaceModel(cfg, zs, float(state["avg_num_neighbors"]))


__all__ = ["INSTALL_HINT", "MaceModel", "avg_num_neighbors", "build_mace", "import_mace",
           "mace_from_state", "mace_installed"]
