"""SchNet and PaiNN (schnetpack's) as models of the loop: ``model.kind: schnet | painn``.

Energy in eV, forces in eV/Å, distances in Å.

:class:`SpkModel` wraps schnetpack's representation (``SchNet`` or ``PaiNN``, width
``model.hidden``, ``model.layers`` interactions, ``model.num_rbf`` Gaussians with a cosine
cutoff at ``model.cutoff``) and its ``Atomwise`` head behind the interface of the molecular
surrogate, as :mod:`convergent.models.mace` does for MACE: the one training loop
(train/fit.py), the loss, the exporter, the ASE calculator and screening use it unchanged.

* ``forward(batch, per_atom=False, with_forces=False)``: energies float64[B] (and per-atom
  float64[N]); ``with_forces`` gives ``(energies, None)``: forces are ``-dE/dpositions`` by
  autograd (:func:`~convergent.models.molecular.energy_and_forces`).
* per-atom energy = the network's output x ``scale`` + ``shift`` + ``atomref[Z]`` + the ZBL
  prior of ``model.repulsion`` — the molecular model's treatment (element references from
  :func:`~convergent.models.molecular.fit_reference_energies`, installed by
  :meth:`set_reference`).
* neighbours from :func:`convergent.models.atoms.neighbor_list` (schnetpack's ``idx_i`` =
  ``edge_index[0]``, ``idx_j`` = ``edge_index[1]``, ``Rij = R[j] - R[i] + offset``).

schnetpack is optional (``pip install 'convergent[schnetpack]'``); 2.0–2.1 import a
private name (``T_co``) that torch 2.13 removed from ``torch.utils.data.dataloader``:
:func:`import_schnetpack` defines that type variable there first when it is missing (a
``TypeVar``, read only by schnetpack's type annotations).
"""

from __future__ import annotations

import importlib
import importlib.util
import typing
from typing import Any

import torch
from torch import nn

from convergent.core.errors import NotAvailableError
from convergent.models.atoms import neighbor_list
from convergent.models.batching import AtomsBatch
from convergent.models.config import ModelConfig
from convergent.models.molecular import ReferenceEnergies, install_reference
from convergent.models.repulsion import zbl_atom_energies

KINDS = ("schnet", "painn")
INSTALL_HINT = "pip install 'convergent[schnetpack]' (schnetpack), or use model.kind=molecular"


def schnetpack_installed() -> bool:
    """Whether schnetpack can be found, without importing it (a cheap pre-launch check)."""
    try:
        return importlib.util.find_spec("schnetpack") is not None
    except (ImportError, ValueError):
        return False


def import_schnetpack() -> Any:
    """The ``schnetpack`` module; :class:`NotAvailableError` naming the extra when missing."""
    import torch.utils.data.dataloader as dl

    if not hasattr(dl, "T_co"):  # see the module doc
        dl.T_co = typing.TypeVar("T_co", covariant=True)  # type: ignore[attr-defined]
    try:
        return importlib.import_module("schnetpack")
    except ImportError as exc:
        raise NotAvailableError(f"model.kind=schnet/painn needs schnetpack ({exc})",
                                hint=INSTALL_HINT) from None


class SpkModel(nn.Module):
    """schnetpack's SchNet or PaiNN with an Atomwise head (see the module doc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.kind not in KINDS:
            raise ValueError(f"SpkModel builds {KINDS}, not kind={cfg.kind!r}")
        spk = import_schnetpack()
        self.cfg = cfg
        rbf = spk.nn.GaussianRBF(n_rbf=cfg.num_rbf, cutoff=cfg.cutoff)
        rep_cls = spk.representation.SchNet if cfg.kind == "schnet" else spk.representation.PaiNN
        rep = rep_cls(n_atom_basis=cfg.hidden, n_interactions=cfg.layers, radial_basis=rbf,
                      cutoff_fn=spk.nn.CosineCutoff(cfg.cutoff))
        self.net = spk.model.NeuralNetworkPotential(
            representation=rep, input_modules=[spk.atomistic.PairwiseDistances()],
            output_modules=[spk.atomistic.Atomwise(n_in=cfg.hidden, output_key="net_energy",
                                                   per_atom_output_key="atom_energy")],
            do_postprocessing=False)
        self.props = spk.properties
        self.register_buffer("atomref", torch.zeros(cfg.max_z + 1, dtype=torch.float64))
        self.register_buffer("scale", torch.tensor(1.0, dtype=torch.float64))
        self.register_buffer("shift", torch.tensor(0.0, dtype=torch.float64))
        self.trained_elements: tuple[int, ...] | None = None
        self.last_neighbors: Any = None

    @property
    def input_dtype(self) -> torch.dtype:
        """The floating type the network computes in (float32 unless converted)."""
        return next(self.net.parameters()).dtype

    def set_reference(self, ref: ReferenceEnergies) -> None:
        """Install fitted element reference energies (eV) and the per-atom scale/shift."""
        self.trained_elements = install_reference(ref, self.cfg.max_z, self.atomref,
                                                  self.scale, self.shift)

    def forward(self, batch: AtomsBatch, per_atom: bool = False, with_forces: bool = False) -> Any:
        """Energies float64[B] eV (and per-atom energies float64[N] if ``per_atom``);
        ``with_forces=True`` returns ``(energies, None)`` (forces by autograd)."""
        cfg, p, z = self.cfg, self.props, batch.numbers
        if z.numel() and (int(z.min()) < 1 or int(z.max()) > cfg.max_z):
            raise ValueError(f"atomic numbers must be in [1, {cfg.max_z}]")
        nl = neighbor_list(batch.positions.detach(), cfg.cutoff, batch.batch, batch.n_molecules,
                           batch.cell, batch.pbc, cfg.max_neighbors, cfg.neighbor_overflow)
        self.last_neighbors = nl
        pos = batch.positions.to(self.input_dtype)
        shifts = nl.shifts.to(pos.dtype)
        out = self.net({p.Z: z, p.R: pos, p.idx_m: batch.batch, p.n_atoms: batch.n_atoms,
                        p.idx_i: nl.edge_index[0], p.idx_j: nl.edge_index[1], p.offsets: shifts})
        atom_e = out["atom_energy"].squeeze(-1).double() * self.scale + self.shift + self.atomref[z]
        if cfg.repulsion == "zbl":
            src, dst = nl.edge_index[0], nl.edge_index[1]
            vec = pos[dst] - pos[src] + shifts
            r = torch.sqrt((vec * vec).sum(-1) + 1e-12)
            atom_e = atom_e + zbl_atom_energies(z, src, dst, r, cfg.repulsion_scale)
        energy = torch.zeros(batch.n_molecules, dtype=torch.float64, device=atom_e.device)
        energy = energy.index_add(0, batch.batch, atom_e)
        if with_forces:
            return energy, None
        return (energy, atom_e) if per_atom else energy


__all__ = ["INSTALL_HINT", "KINDS", "SpkModel", "import_schnetpack", "schnetpack_installed"]
