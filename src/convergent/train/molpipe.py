"""Pipeline parallelism for the molecular surrogate (needs ``model.forces: direct``).

**Stages.** The attention layers are cut into contiguous slices; stage 0 also owns the
element embedding and the radial features, the last stage the energy and force heads
(and the reference-energy buffers). Parameter names are those of the full model, so
checkpoints and the exported model do not depend on the strategy.

**Fixed shapes.** ``torch.distributed.pipelining`` (torch 2.13) infers each stage's
input/output tensor metadata once — on the first micro-batch of the first
``step``/``eval`` — and allocates its receive buffers from it; every later micro-batch,
in training and in validation, must have the same shapes and dtypes. Micro-batches are
therefore padded to a fixed :class:`Budget`: ``atoms`` slots (the last one a dummy
atom), one molecule slot per atom slot (the last one a dummy molecule) and ``edges``
edge slots. Padding atoms (Z=0) belong to the dummy molecule and have no edges; padding
edges join the dummy atom to itself with a zero envelope. Real atoms never see padding,
and padded entries are cut from energies and forces before the loss, so padding changes
nothing.

**What travels.** Between stages only the atom features ``h`` [atoms, state width] and the
micro-batch index int64[1]. The edge geometry (neighbour list, radial basis, envelope,
vectors) is parameter-free and every rank holds the step's data (the global batch plan
depends on the seed alone), so each rank computes it once per micro-batch in its
:class:`Feed` instead of receiving it.

The stages' tensor metadata is given up front (:func:`stage_io`), so torch does not
infer it at run time.

**Loss.** A global batch is split into ``parallel.microbatches`` parts by atom count;
each part's loss is its sum over molecules/atoms divided by the global counts, exactly
as in the other strategies (:func:`convergent.train.moldata.loss_from_predictions`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from convergent.core.errors import ConfigError
from convergent.models.batching import AtomsBatch, batches_by_atom_budget
from convergent.models.molecular import EdgeGeometry, MolecularTransformer, RadialBasis
from convergent.train.moldata import loss_from_predictions
from convergent.train.taskapi import split_evenly, stage_layers


@dataclass(frozen=True)
class Budget:
    """Padded sizes of one pipeline micro-batch: ``atoms`` slots (incl. one dummy) and
    ``edges`` slots; at most ``atoms - 1`` real atoms and molecules."""

    atoms: int
    edges: int

    @classmethod
    def plan(
        cls, global_atoms: int, max_atoms: int, n_micro: int, max_neighbors: int | None
    ) -> Budget:
        """Sizes that fit any part of a global batch of ``global_atoms`` atoms split into
        ``n_micro`` parts (:func:`split_evenly` puts at most average + largest molecule in
        a part); a molecule has at most ``max_atoms`` atoms and each atom at most
        ``max_neighbors`` neighbours (None: ``max_atoms - 1``, true without cells)."""
        real = min(math.ceil(global_atoms / n_micro) + max_atoms, max(global_atoms, max_atoms))
        k = max_neighbors if max_neighbors is not None else max(max_atoms - 1, 1)
        return cls(atoms=real + 1, edges=max(real * k, 1))


@dataclass
class Padded:
    """One padded micro-batch: atomic numbers ``z`` [atoms], molecule slot ``mol``
    [atoms], padded edge geometry, and the unpadded batch (None: all padding)."""

    z: torch.Tensor
    mol: torch.Tensor
    geom: EdgeGeometry
    batch: AtomsBatch | None


def select_molecules(batch: AtomsBatch, idx: list[int]) -> AtomsBatch:
    """The molecules ``idx`` of ``batch`` (in that order) as a new batch."""
    dev = batch.numbers.device
    sel = torch.tensor(idx, dtype=torch.int64, device=dev)
    starts = torch.cumsum(batch.n_atoms, 0) - batch.n_atoms
    atoms = torch.cat(
        [torch.arange(int(starts[i]), int(starts[i] + batch.n_atoms[i]), device=dev) for i in idx]
    )
    n_atoms = batch.n_atoms[sel]
    return AtomsBatch(
        numbers=batch.numbers[atoms],
        positions=batch.positions[atoms],
        batch=torch.repeat_interleave(torch.arange(len(idx), device=dev), n_atoms),
        n_molecules=len(idx),
        n_atoms=n_atoms,
        energy=None if batch.energy is None else batch.energy[sel],
        forces=None if batch.forces is None else batch.forces[atoms],
        cell=None if batch.cell is None else batch.cell[sel],
        pbc=None if batch.pbc is None else batch.pbc[sel],
        keys=[batch.keys[i] for i in idx] if batch.keys else [],
        molecule_ids=[batch.molecule_ids[i] for i in idx] if batch.molecule_ids else [],
    )


class Feed:
    """This rank's padded micro-batches of the current schedule call(s), by index."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.items: list[Padded] = []
        self.geometry: MolecularTransformer | None = None  # a local stage (edges + rbf)

    def __getitem__(self, idx: torch.Tensor) -> Padded:
        return self.items[int(idx.reshape(-1)[0])]

    def load(self, batch: AtomsBatch, groups: list[list[int]]) -> None:
        """Pad the molecule groups ``groups`` of ``batch`` (one micro-batch each)."""
        with torch.no_grad():
            self.items = [self._pad(select_molecules(batch, g) if g else None, batch) for g in groups]

    def _pad(self, sub: AtomsBatch | None, like: AtomsBatch) -> Padded:
        model = self.geometry
        assert model is not None, "Feed.geometry is set by the first stage module"
        na, ne = self.budget.atoms, self.budget.edges
        dev, dtype = like.positions.device, like.positions.dtype
        z = torch.zeros(na, dtype=torch.int64, device=dev)
        mol = torch.full((na,), na - 1, dtype=torch.int64, device=dev)
        pos = torch.zeros(na, 3, dtype=dtype, device=dev)
        index = torch.full((2, ne), na - 1, dtype=torch.int64, device=dev)
        shifts = torch.zeros(ne, 3, dtype=dtype, device=dev)
        n = e = 0
        rows = None
        if sub is not None:
            n = sub.num_atoms
            if n > na - 1:
                raise RuntimeError(  # Budget.plan bounds every part: this is a bug
                    f"pipeline micro-batch of {n} atoms exceeds its padded budget {na - 1}"
                )
            edge_index, sh, rows = model._edges(sub)
            e = edge_index.shape[1]
            if e > ne:
                raise ConfigError(
                    f"pipeline micro-batch has {e} edges, above its padded budget {ne}",
                    hint="set model.max_neighbors (periodic structures need it for pipeline)",
                )
            z[:n], mol[:n], pos[:n] = sub.numbers, sub.batch, sub.positions
            index[:, :e], shifts[:e] = edge_index, sh.to(dtype)
        g = model.edge_geometry(pos, index, shifts, rows)
        g.env = g.env * (torch.arange(ne, device=dev) < e).to(g.env.dtype)  # padding: 0
        return Padded(z, mol, g, sub)


class MolecularStage(MolecularTransformer):
    """One pipeline stage of a :class:`MolecularTransformer` (see the module doc).

    Forward: stage 0 takes the micro-batch index, later stages ``(h, index)``; every
    stage but the last returns ``(h, index)``, the last ``(energies float64[atoms],
    forces [atoms, 3])`` over padded slots (eV, eV/Å).
    """

    def __init__(
        self, full: MolecularTransformer, layers: range, first: bool, last: bool, feed: Feed
    ) -> None:
        nn.Module.__init__(self)  # only this stage's parts, named as in the full model
        cfg = full.cfg
        self.cfg, self.keep_fp32, self.last_neighbors = cfg, list(full.keep_fp32), None
        self.first, self.last = first, last
        self.rbf = RadialBasis(cfg.num_rbf, cfg.cutoff)  # buffers only, not saved
        if first:
            self.embedding = copy.deepcopy(full.embedding)
        self.layers = nn.ModuleDict({str(i): copy.deepcopy(full.layers[i]) for i in layers})
        self.force_head = None
        if last:
            self.energy_head = copy.deepcopy(full.energy_head)
            self.force_head = copy.deepcopy(full.force_head)
            for name in ("atomref", "scale", "shift"):
                self.register_buffer(name, getattr(full, name).detach().clone())
        self._feed = [feed]  # a list: not a sub-module
        if feed.geometry is None:
            feed.geometry = self

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        if self.first:
            (idx,) = inputs
            item = self._feed[0][idx]
            h = self.initial_state(item.z)
        else:
            h, idx = inputs
            item = self._feed[0][idx]
        for name, layer in self.layers.items():
            h = self.run_layer(f"layers.{name}", layer, h, item.geom)
        if not self.last:
            return h, idx
        atom_e = self.atom_energies(h, item.z, item.geom)
        energy = torch.zeros(atom_e.shape[0], dtype=torch.float64, device=atom_e.device)
        return energy.index_add(0, item.mol, atom_e), self.direct_forces(h, item.geom, item.z)


def stage_module(full: nn.Module, stage: int, n_stages: int, feed: Feed) -> MolecularStage:
    """Stage ``stage`` of ``n_stages``: its share of the layers (at least one each)."""
    if not isinstance(full, MolecularTransformer) or full.force_head is None:
        raise ConfigError(
            "parallel.strategy=pipeline needs model.forces=direct for the molecular model"
        )
    layers = stage_layers(len(full.layers), stage, n_stages)
    return MolecularStage(full, layers, stage == 0, stage == n_stages - 1, feed)


def stage_io(
    budget: Budget, width: int, first: bool, last: bool, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Example (inputs, outputs) of a stage, given to ``PipelineStage`` so its tensor
    metadata is static: no runtime inference (which would run a later stage's forward
    on uninitialised tensors, micro-batch index included). ``width`` is the per-atom
    state width (``ModelConfig.state_width``)."""
    idx = torch.zeros(1, dtype=torch.int64, device=device)
    h = torch.zeros(budget.atoms, width, device=device, requires_grad=True)
    inputs = (idx,) if first else (h, idx)
    if not last:
        return inputs, (h, idx)
    energy = torch.zeros(budget.atoms, dtype=torch.float64, device=device, requires_grad=True)
    forces = torch.zeros(budget.atoms, 3, device=device, requires_grad=True)
    return inputs, (energy, forces)


def micro_groups(
    batch: AtomsBatch, n_micro: int, budget: Budget, training: bool
) -> list[list[int]]:
    """Molecule groups of ``batch``, a multiple of ``n_micro`` of them: a training batch
    is split into exactly ``n_micro`` parts by atom count (as the other strategies split
    theirs); a validation batch is packed by the atom budget, empty groups pad the end."""
    counts = batch.n_atoms.tolist()
    if training:
        return split_evenly(counts, n_micro)
    groups = batches_by_atom_budget(counts, budget.atoms - 1)
    groups += [[] for _ in range(-len(groups) % n_micro)]
    return groups


def padded_loss(
    output: tuple[torch.Tensor, torch.Tensor], item: Padded, norm: dict[str, float],
    force_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, sum statistics) of one padded micro-batch, padding cut off."""
    energy, forces = output
    if item.batch is None:  # an all-padding micro-batch: contributes nothing
        return (energy.sum() * 0.0).float(), {}
    b = item.batch
    loss, stats = loss_from_predictions(
        energy[: b.n_molecules], forces[: b.num_atoms], b, norm, 1, force_weight
    )
    return loss, {k: float(v) for k, v in stats.items()}
