"""A physical short range: the ZBL repulsive pair prior added to the learned energy.

A network trained on near-equilibrium structures has no reason to rise where two atoms
come closer than any training pair, and molecules collapsed in MD (two H atoms of one
heavy atom fused at 0.5-0.7 Å). Like NequIP/Allegro's and MACE's ``ZBLBasis``, the energy
gets the Ziegler-Biersack-Littmark universal screened-nuclear repulsion

    E_ij = k_e Z_i Z_j / r · φ(r / a),   a = 0.46850 Å / (Z_i^0.23 + Z_j^0.23)
    φ(x) = 0.18175 e^{-3.19980 x} + 0.50986 e^{-0.94229 x} + 0.28022 e^{-0.40290 x}
           + 0.02817 e^{-0.20162 x}

(k_e = e²/4πε₀ = 14.399645 eV·Å), times a smooth polynomial envelope (p = 6, as MACE)
that reaches zero, with its first two derivatives, at ``scale`` × the sum of the two
atoms' covalent radii (ASE's table). With ``scale`` 1 (MACE's choice) a bonded pair at its
equilibrium length gets nothing: the prior acts only inside bonds, where no training data
go, and the network keeps everything it learned. The parameters (``model.repulsion``,
``model.repulsion_scale``) are part of the model config, hence of every checkpoint.
"""

from __future__ import annotations

import torch
from ase.data import covalent_radii

KE = 14.399645  # e² / (4 π ε₀), eV·Å
ZBL_A = 0.46850  # Å
ZBL_C = (0.18175, 0.50986, 0.28022, 0.02817)
ZBL_D = (3.19980, 0.94229, 0.40290, 0.20162)
P = 6  # envelope order


def envelope(x: torch.Tensor) -> torch.Tensor:
    """1 at x = 0, 0 (value, slope and curvature) at x >= 1 (DimeNet's polynomial, p = 6)."""
    p = P
    f = (1 - (p + 1) * (p + 2) / 2 * x**p + p * (p + 2) * x ** (p + 1)
         - p * (p + 1) / 2 * x ** (p + 2))
    return torch.where(x < 1, f, torch.zeros_like(x))


def zbl_pair_energy(zi: torch.Tensor, zj: torch.Tensor, r: torch.Tensor,
                    scale: float = 1.0) -> torch.Tensor:
    """ZBL energy (eV) of each pair at distance ``r`` (Å), enveloped to zero at
    ``scale`` × (covalent radius i + covalent radius j); float64."""
    r = r.double()
    zi64, zj64 = zi.double(), zj.double()
    a = ZBL_A / (zi64**0.23 + zj64**0.23)
    x = r / a
    phi = sum(c * torch.exp(-d * x) for c, d in zip(ZBL_C, ZBL_D, strict=True))
    rc = torch.as_tensor(covalent_radii, dtype=torch.float64, device=r.device)
    r_max = scale * (rc[zi] + rc[zj])
    return KE * zi64 * zj64 / r * phi * envelope(r / r_max)


def zbl_atom_energies(z: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, r: torch.Tensor,
                      scale: float = 1.0) -> torch.Tensor:
    """Per-atom share (float64[N], eV) of the ZBL energy over directed edges ``src -> dst``
    (each pair appears twice, so each edge adds half its pair energy to ``src``)."""
    e = zbl_pair_energy(z[src], z[dst], r, scale)
    out = torch.zeros(z.shape[0], dtype=torch.float64, device=r.device)
    return out.index_add(0, src, 0.5 * e)


def zbl_forces(z: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, vec: torch.Tensor,
               scale: float = 1.0) -> torch.Tensor:
    """Forces (float64[N, 3], eV/Å) of the prior, for models whose forces do not come from
    autograd of the energy (``model.forces: direct``). ``vec``: ``pos[dst] - pos[src]``
    (+ periodic shift) of each directed edge."""
    with torch.enable_grad():
        v = vec.detach().double().requires_grad_(True)
        r = torch.sqrt((v * v).sum(-1) + 1e-12)
        (gv,) = torch.autograd.grad(0.5 * zbl_pair_energy(z[src], z[dst], r, scale).sum(), v)
    f = torch.zeros(z.shape[0], 3, dtype=torch.float64, device=vec.device)
    return f.index_add(0, src, gv).index_add(0, dst, -gv)  # dE/dpos[dst] = gv, dE/dpos[src] = -gv
