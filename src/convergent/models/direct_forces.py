"""Direct force head: forces predicted from the final atom features (``model.forces: direct``).

``F_i = scale · Σ_j φ(r_ij) · w(h_i, h_j, rbf(r_ij)) · r̂_ij`` over the neighbour edges
``i -> j``, with ``r̂_ij`` the unit vector from atom ``i`` to neighbour ``j``, ``φ`` the
cosine cutoff envelope and ``w`` a small MLP giving one scalar per edge. ``w`` sees only
invariants (atom features built from distances, the radial basis), so the forces rotate
with the structure (rotation-equivariant by construction) and are unchanged by
translations and atom permutations. ``w`` is symmetric in ``(i, j)`` (its input is
``h_i + h_j``, ``h_i ⊙ h_j``, ``rbf(r_ij)``) and ``r̂_ji = -r̂_ij``, so pairwise
contributions cancel: the net force on an isolated molecule is zero (momentum is
conserved).

Trade-off: direct forces need no gradient with respect to positions, so training on
them needs no double backward (any parallel strategy works, pipeline stages included)
and inference costs one forward; but they are *not conservative* — they are not the
gradient of the predicted energy, so molecular dynamics with them does not conserve
energy and they usually fit less accurately. Autograd forces (``model.forces:
autograd``, ``F = -dE/dpositions``) remain the default for accuracy.
"""

from __future__ import annotations

import torch
from torch import nn


class DirectForceHead(nn.Module):
    """Edge-wise force head (see the module docstring); output in units of ``scale``."""

    def __init__(self, hidden: int, num_rbf: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(2 * hidden + num_rbf, hidden), nn.SiLU(), nn.Linear(hidden, 1)
        )

    def forward(
        self,
        h: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
        rbf: torch.Tensor,
        env: torch.Tensor,
        vec: torch.Tensor,
        r: torch.Tensor,
    ) -> torch.Tensor:
        """Forces float32[N, 3] (before ``scale``) from atom features ``h`` [N, hidden],
        edges ``src -> dst`` [E], radial basis ``rbf`` [E, R], envelope ``env`` [E],
        vectors ``vec`` = pos[dst] - pos[src] [E, 3] Å and distances ``r`` [E] Å."""
        x = self.norm(h)
        xi, xj = x[src], x[dst]
        w = self.mlp(torch.cat([xi + xj, xi * xj, rbf.to(x.dtype)], dim=-1)).squeeze(-1)
        acc = torch.promote_types(w.dtype, torch.float32)
        w = w.to(acc) * env.to(acc)
        unit = vec.to(acc) / r.to(acc).clamp_min(1e-6).unsqueeze(-1)
        out = torch.zeros(h.shape[0], 3, dtype=acc, device=h.device)
        return out.index_add(0, src, w.unsqueeze(-1) * unit)
