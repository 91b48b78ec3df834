"""The molecular surrogate: a Transformer over atoms with edge-wise (neighbour) attention.

Energy in eV, forces in eV/Å, distances in Å.

Architecture (read top to bottom in ten minutes):

* ``embedding``: element embedding ``h_i = E[Z_i]`` (``hidden`` wide).
* ``rbf``: Gaussian radial basis of the distance ``r_ij`` on ``[0, cutoff]``.
* ``layers``: L pre-norm Transformer blocks. Atom ``i`` attends to its neighbours ``j``
  only (the edges of the cutoff graph from :func:`~convergent.models.atoms.neighbor_list`):
  ``s_ij = <q_i, k_j> / sqrt(d) + b(r_ij)`` per head (distance bias), weights
  ``a_ij = silu(s_ij) φ(r_ij)`` with the cosine cutoff ``φ`` (``attention_weights: silu``,
  the default: an unnormalised gate, so the message is a sum over neighbours as in
  SchNet-style convolutions and torchmd-net's equivariant transformer), or with
  ``attention_weights: softmax`` ``a_ij = φ(r_ij) exp(s_ij) / (1 + Σ_j' φ(r_ij') exp(s_ij'))``
  (a weighted mean; the 1 is a zero-score sink slot, so weights fade smoothly as atoms
  cross the cutoff), message
  ``Σ_j a_ij v_j ⊙ f_v(r_ij)``, then an MLP. Only distances enter, so the energy is invariant to rotation, translation and
  permutation; cost is O(N·k) for k neighbours per atom. The edges come sorted by centre
  (CSR: the neighbour list's ``row_ptr``), so the message step
  (:mod:`convergent.models.edge_kernel`, ``model.edge_kernel``) reduces over contiguous
  segments with torch ops or in one fused Triton kernel.
* ``energy_head``: per-atom MLP (LayerNorm first only with ``head_norm``) -> per-atom energy ``ε_i · scale + shift + ref[Z_i]``,
  summed per molecule with ``index_add_`` (fp32 for the network part, fp64 for the sum and
  the element reference energies, which are large in eV).
* ``repulsion`` (default ``zbl``): the ZBL screened-nuclear pair repulsion, enveloped to
  zero at the sum of covalent radii, added to the per-atom energies
  (:mod:`convergent.models.repulsion`): a physical short range where no data go.
* forces ``F = -dE/dpositions`` by autograd (:func:`energy_and_forces`), or with
  ``model.forces: direct`` from a force head on the final atom features
  (:mod:`convergent.models.direct_forces`: no double backward, not conservative).

With ``model.vectors: true`` each atom also carries vector features and the blocks are
:class:`~convergent.models.vector_attention.VectorAttentionBlock` (same attention
weights; messages along bond directions, so bond angles enter; energy still invariant).

``attention="topk"`` scores every atom pair of a structure and keeps the ``topk`` best
per atom (the O(N²) recipe this model improves on); ``attention="dense"`` attends over
every pair. Both drop the cutoff envelope and exist for comparison (bench/model_scaling).

Under bf16/fp16 autocast, sub-modules whose names match ``keep_fp32`` (fnmatch patterns,
default ``["energy_head"]``) run with autocast disabled on fp32 inputs.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from convergent.models.atoms import all_pairs, neighbor_list
from convergent.models.batching import AtomsBatch
from convergent.models.config import ModelConfig
from convergent.models.direct_forces import DirectForceHead
from convergent.models.edge_attention import EdgeAttentionBlock, EdgeGeometry
from convergent.models.repulsion import zbl_atom_energies, zbl_forces
from convergent.models.segments import Segments
from convergent.models.vector_attention import VectorAttentionBlock


class RadialBasis(nn.Module):
    """Gaussian radial basis on [0, cutoff] Å: ``exp(-γ (r - μ_k)²)``, k = 1..num_rbf."""

    def __init__(self, num_rbf: int, cutoff: float) -> None:
        super().__init__()
        centers = torch.linspace(0.0, cutoff, num_rbf)
        self.register_buffer("centers", centers, persistent=False)
        width = cutoff / max(1, num_rbf - 1)
        self.gamma = 0.5 / (width * width)

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        return torch.exp(-self.gamma * (r.unsqueeze(-1) - self.centers) ** 2)


def cosine_cutoff(r: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Smooth envelope ``0.5 (cos(π r / rc) + 1)`` for r < rc, else 0."""
    return torch.where(r < cutoff, 0.5 * (torch.cos(math.pi * r / cutoff) + 1.0), torch.zeros_like(r))


class MolecularTransformer(nn.Module):
    """Energy model E(numbers, positions) in eV; see the module docstring."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.max_z + 1, cfg.hidden)
        self.rbf = RadialBasis(cfg.num_rbf, cfg.cutoff)
        block = VectorAttentionBlock if cfg.vectors else EdgeAttentionBlock
        self.layers = nn.ModuleList(
            block(cfg.hidden, cfg.heads, cfg.num_rbf, cfg.mlp_ratio, cfg.attention_weights)
            for _ in range(cfg.layers)
        )
        self.energy_head = nn.Sequential(  # index 0 stays a slot so weight names keep their place
            nn.LayerNorm(cfg.hidden) if cfg.head_norm else nn.Identity(),
            nn.Linear(cfg.hidden, cfg.hidden // 2),
            nn.SiLU(),
            nn.Linear(cfg.hidden // 2, 1),
        )
        # direct forces (eV/Å) = force_head(...) * scale; None: forces by autograd
        self.force_head = (
            DirectForceHead(cfg.hidden, cfg.num_rbf) if cfg.forces == "direct" else None
        )
        # Normalisation: per-atom energy = head * scale + shift + atomref[Z] (eV).
        self.register_buffer("atomref", torch.zeros(cfg.max_z + 1, dtype=torch.float64))
        self.register_buffer("scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("shift", torch.zeros((), dtype=torch.float32))
        self.keep_fp32: list[str] = list(cfg.keep_fp32)
        self.last_neighbors: Any = None  # NeighborList of the last forward (diagnostics)
        # atomic numbers of the training data (set_reference; models/io records it)
        self.trained_elements: tuple[int, ...] | None = None

    # -- precision ---------------------------------------------------------------------
    def set_keep_fp32(self, patterns: Iterable[str]) -> None:
        """Set the fnmatch patterns of sub-modules run in fp32 under autocast."""
        self.keep_fp32 = list(patterns)

    def _run(self, name: str, module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        dev = args[0].device.type
        if torch.is_autocast_enabled(dev) and any(fnmatch.fnmatch(name, p) for p in self.keep_fp32):
            with torch.autocast(device_type=dev, enabled=False):
                return module(*[a.float() if a.is_floating_point() else a for a in args])
        return module(*args)

    # -- reference energies ------------------------------------------------------------
    def set_reference(self, ref: ReferenceEnergies) -> None:
        """Install fitted element reference energies (eV) and the per-atom scale/shift."""
        self.trained_elements = install_reference(ref, self.cfg.max_z, self.atomref,
                                                  self.scale, self.shift)

    # -- forward -----------------------------------------------------------------------
    def _edges(self, batch: AtomsBatch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        cfg = self.cfg
        if cfg.attention == "neighbor":
            nl = neighbor_list(
                batch.positions, cfg.cutoff, batch.batch, batch.n_molecules, batch.cell,
                batch.pbc, cfg.max_neighbors, cfg.neighbor_overflow,
            )
            self.last_neighbors = nl
            return nl.edge_index, nl.shifts, None
        edge_index, shifts = all_pairs(batch.positions, batch.batch, batch.n_molecules, batch.cell, batch.pbc)
        rows = None
        if cfg.attention == "topk":
            counts = batch.n_atoms.tolist()
            r, start = [], 0
            for m in counts:
                per = max(m - 1, 0)
                r.append((start, m if per else 0, per))
                start += m * per
            rows = torch.tensor(r, dtype=torch.int64).reshape(-1, 3)
        return edge_index, shifts, rows

    def edge_geometry(
        self, pos: torch.Tensor, edge_index: torch.Tensor, shifts: torch.Tensor, rows: Any = None,
        row_ptr: torch.Tensor | None = None,
    ) -> EdgeGeometry:
        """Parameter-free edge features of positions ``pos`` [N, 3] Å (see EdgeGeometry).
        ``row_ptr``: the edges are sorted by centre with these bounds (the neighbour
        list's); without it the CSR grouping sorts them."""
        cfg = self.cfg
        src, dst = edge_index[0], edge_index[1]
        vec = pos[dst] - pos[src] + shifts.to(pos.dtype)
        r = torch.sqrt((vec * vec).sum(-1) + 1e-12)
        rbf = self._run("rbf", self.rbf, r)
        if cfg.attention == "neighbor":
            env = cosine_cutoff(r, cfg.cutoff)
        else:
            env = torch.ones_like(r)
        topk = (cfg.topk, rows) if rows is not None else None
        recv = send = None
        if rows is None and not cfg.vectors and cfg.edge_chunk == 0 and cfg.edge_kernel != "index":
            recv = Segments.build(src, pos.shape[0], row_ptr)
            send = Segments.build(dst, pos.shape[0])
        return EdgeGeometry(src, dst, vec, r, rbf, env, topk, recv, send, cfg.edge_kernel)

    def run_layer(self, name: str, layer: nn.Module, h: torch.Tensor, g: EdgeGeometry) -> torch.Tensor:
        """One attention block (``name`` = ``layers.<i>``), in fp32 if ``keep_fp32`` says so."""
        dev = h.device.type
        if torch.is_autocast_enabled(dev) and any(fnmatch.fnmatch(name, p) for p in self.keep_fp32):
            with torch.autocast(device_type=dev, enabled=False):
                return layer(h.float(), replace(g, rbf=g.rbf.float()), self.cfg.edge_chunk)
        return layer(h, g, self.cfg.edge_chunk)

    @property
    def state_width(self) -> int:
        """Width of the per-atom state between blocks (see ModelConfig.state_width)."""
        return self.cfg.state_width

    def initial_state(self, z: torch.Tensor) -> torch.Tensor:
        """Per-atom state before the first block: element embedding (and zero vectors)."""
        h = self._run("embedding", self.embedding, z)
        if self.cfg.vectors:
            h = torch.cat([h, h.new_zeros(h.shape[0], 3 * self.cfg.hidden)], dim=-1)
        return h

    def atom_energies(self, h: torch.Tensor, z: torch.Tensor,
                      g: EdgeGeometry | None = None) -> torch.Tensor:
        """Per-atom energies float64[N] eV from the final atom state (its scalars), plus
        each atom's share of the repulsive prior over the edges of ``g``."""
        eps = self._run("energy_head", self.energy_head, h[:, : self.cfg.hidden]).squeeze(-1)
        eps = eps.to(torch.promote_types(eps.dtype, torch.float32))
        atom_e = eps * self.scale + self.shift  # fp32, network part
        out = atom_e.double() + self.atomref[z]
        if g is not None and self.cfg.repulsion == "zbl":
            out = out + zbl_atom_energies(z, g.src, g.dst, g.r, self.cfg.repulsion_scale)
        return out

    def direct_forces(self, h: torch.Tensor, g: EdgeGeometry,
                      z: torch.Tensor | None = None) -> torch.Tensor:
        """Forces float32[N, 3] eV/Å of the direct force head (``model.forces: direct``),
        plus the repulsive prior's exact forces when ``z`` is given."""
        f = self._run("force_head", self.force_head, h[:, : self.cfg.hidden], g.src, g.dst, g.rbf, g.env, g.vec, g.r)
        f = f * self.scale  # the head computes in >= fp32
        if z is not None and self.cfg.repulsion == "zbl":
            f = f + zbl_forces(z, g.src, g.dst, g.vec, self.cfg.repulsion_scale).to(f.dtype)
        return f

    def forward(self, batch: AtomsBatch, per_atom: bool = False, with_forces: bool = False) -> Any:
        """Energies float64[B] eV (and per-atom energies float64[N] if ``per_atom``).

        ``with_forces=True`` returns ``(energies, forces)``: float32[N, 3] eV/Å from the
        direct force head, or None for autograd models (see :func:`energy_and_forces`).
        """
        cfg = self.cfg
        z = batch.numbers
        if z.numel() and (int(z.min()) < 1 or int(z.max()) > cfg.max_z):
            raise ValueError(f"atomic numbers must be in [1, {cfg.max_z}]")
        pos = batch.positions
        edge_index, shifts, rows = self._edges(batch)
        row_ptr = self.last_neighbors.row_ptr if cfg.attention == "neighbor" else None
        g = self.edge_geometry(pos, edge_index, shifts, rows, row_ptr)
        h = self.initial_state(z)
        for i, layer in enumerate(self.layers):
            h = self.run_layer(f"layers.{i}", layer, h, g)
        atom_e64 = self.atom_energies(h, z, g)
        energy = torch.zeros(batch.n_molecules, dtype=torch.float64, device=pos.device)
        energy = energy.index_add(0, batch.batch, atom_e64)
        if with_forces:
            return energy, (self.direct_forces(h, g, z) if self.force_head is not None else None)
        return (energy, atom_e64) if per_atom else energy


def build_model(cfg: ModelConfig | None = None) -> MolecularTransformer:
    """A freshly initialised :class:`MolecularTransformer` from ``cfg`` (defaults if None)."""
    cfg = cfg or ModelConfig()
    if cfg.kind != "molecular":
        raise ValueError(f"build_model builds the molecular model, not kind={cfg.kind!r}")
    return MolecularTransformer(cfg)


def energy_and_forces(
    model: nn.Module, batch: AtomsBatch, training: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Energies float64[B] (eV) and forces float32[N,3] (eV/Å) = -dE/dpositions.

    With ``training=True`` the graph is kept (``create_graph``) so a force loss can be
    back-propagated to the parameters; otherwise results are detached. Works under
    ``torch.no_grad()`` (gradients are enabled locally), not under ``inference_mode``.
    A model with a direct force head (``model.forces: direct``) returns its forces as
    predicted (no gradient with respect to positions, no double backward).
    """
    with torch.enable_grad():
        pos = batch.positions.detach().clone().requires_grad_(True)
        energy, forces = model(batch.with_positions(pos), with_forces=True)
        if forces is None:
            (grad,) = torch.autograd.grad(energy.sum(), pos, create_graph=training)
            forces = -grad
    if not training:
        return energy.detach(), forces.detach()
    return energy, forces


# -- element reference energies -------------------------------------------------------


@dataclass
class ReferenceEnergies:
    """Per-element reference energies (eV per atom), per-atom ``scale`` and ``shift`` (eV)."""

    energies: dict[int, float]
    scale: float = 1.0
    shift: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"energies": {str(k): v for k, v in self.energies.items()}, "scale": self.scale, "shift": self.shift}


def install_reference(ref: ReferenceEnergies, max_z: int, atomref: torch.Tensor,
                      scale: torch.Tensor, shift: torch.Tensor) -> tuple[int, ...]:
    """Write ``ref`` into a model's buffers (``atomref[Z]`` eV, per-atom ``scale`` and
    ``shift``; every surrogate kind holds these); the atomic numbers it covers."""
    values = torch.zeros_like(atomref)
    for z, e in ref.energies.items():
        if z > max_z:
            raise ValueError(f"element Z={z} above model.max_z={max_z}")
        values[z] = e
    atomref.copy_(values)
    scale.fill_(ref.scale)
    shift.fill_(ref.shift)
    return tuple(sorted(int(z) for z in ref.energies))


def fit_reference_energies(
    records: Iterable[Mapping[str, Any]], limit: int | None = None, ridge: float = 1e-6,
    per_element: bool = True,
) -> ReferenceEnergies:
    """Fit ``E ≈ Σ_atoms ref[Z]`` by (ridge-regularised; ``ridge=0``: plain) least squares
    over records; ``per_element=False`` fits one energy per atom shared by every element
    (``E ≈ n_atoms · μ``; the ablation of per-element references).

    Returns the per-element energies and a per-atom ``scale``: the RMS force (eV/Å·Å ->
    eV) when forces are present, else the std of the per-atom residual (floor 0.01 eV).
    ``limit`` caps the number of records read.
    """
    comps: list[dict[int, int]] = []
    energies: list[float] = []
    sq_force, n_force = 0.0, 0
    for i, rec in enumerate(records):
        if limit is not None and i >= limit:
            break
        e = rec.get("energy")
        if e is None or not math.isfinite(float(e)):
            continue
        z = np.asarray(rec["numbers"], dtype=np.int64)
        u, c = np.unique(z, return_counts=True)
        comps.append(dict(zip(u.tolist(), c.tolist(), strict=True)))
        energies.append(float(e))
        f = rec.get("forces")
        if f is not None and np.isfinite(np.asarray(f, dtype=np.float64)).all():
            f = np.asarray(f, dtype=np.float64)
            sq_force += float((f * f).sum())
            n_force += f.size
    if not energies:
        raise ValueError("no labelled records to fit reference energies")
    elements = sorted({z for c in comps for z in c})
    a = np.zeros((len(comps), len(elements)))
    col = {z: k for k, z in enumerate(elements)}
    for row, c in enumerate(comps):
        for z, cnt in c.items():
            a[row, col[z]] = cnt
    if not per_element:  # one column: the atom count; every element gets its coefficient
        a = a.sum(1, keepdims=True)
        col = dict.fromkeys(elements, 0)
    y = np.asarray(energies)
    n_atoms = a.sum(1)
    if ridge == 0:  # plain least squares (minimum-norm where compositions are collinear)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    else:  # ridge toward the mean energy per atom keeps collinear compositions well defined
        mu = float((y / n_atoms).mean())
        lam = ridge * max(1.0, float((a * a).sum() / len(y)))
        coef = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ (y - n_atoms * mu)) + mu
    resid = (y - a @ coef) / n_atoms
    if n_force:
        scale = math.sqrt(sq_force / n_force)
    else:
        scale = float(resid.std())
    return ReferenceEnergies(
        energies={z: float(coef[col[z]]) for z in elements}, scale=max(scale, 0.01), shift=0.0
    )


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__: Sequence[str] = (
    "EdgeGeometry",
    "MolecularTransformer",
    "ReferenceEnergies",
    "build_model",
    "count_parameters",
    "energy_and_forces",
    "fit_reference_energies",
)
