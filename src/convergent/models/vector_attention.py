"""Edge attention with a vector channel per atom (``model.vectors: true``).

Each atom carries scalars ``x`` [N, H] and vectors ``v`` [N, 3, H] (H = ``hidden``); the
block state is packed as one tensor ``[x | v]`` of shape [N, 4H] so that pipeline stages
pass a single tensor. The attention weights ``a_ij`` are those of the scalar block
(:class:`~convergent.models.edge_attention.EdgeAttentionBlock`: query-key score plus a
distance bias, softmax with a sink slot or silu gate, cosine cutoff); the values now
carry geometry:

* scalar message ``Σ_j a_ij (W x_j ⊙ f(r_ij))`` as before;
* vector message ``Σ_j a_ij [(W₁ x_j ⊙ f₁(r_ij)) v_j + (W₂ x_j ⊙ f₂(r_ij)) r̂_ij]`` — the
  neighbour's vectors and the bond direction ``r̂_ij``, scaled by invariant gates;
* update (a gated mixing of the two channels, as in PaiNN's update block): after adding
  the messages, ``(o₁, o₂, o₃) = MLP([x, ‖U v‖])`` and
  ``x += o₃ + o₂ ⊙ <U v, W v>``, ``v += o₁ ⊙ W v``, with ``U, W`` linear maps that mix
  channels only (never the x, y, z components). This MLP replaces the scalar block's
  output projection and feed-forward layer.

Scalars see vectors only through norms and inner products of channel mixes, and vectors
are built from ``r̂_ij`` with invariant coefficients, so ``x`` (and the energy read from
it) is invariant and ``v`` rotates with the structure. The angular information (bond
angles through the inner products of bond directions) is what a distance-only model
lacks. Costs O(N·k) like the scalar block, with ~3x its per-edge memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from convergent.models.edge_attention import EdgeAttentionBlock, _topk_edges

if TYPE_CHECKING:
    from convergent.models.edge_attention import EdgeGeometry


class VectorAttentionBlock(EdgeAttentionBlock):
    """Edge attention over packed scalar/vector atom states [N, 4·hidden] (module doc)."""

    def __init__(self, hidden: int, heads: int, num_rbf: int, mlp_ratio: int, weights: str = "softmax") -> None:
        super().__init__(hidden, heads, num_rbf, mlp_ratio, weights)
        self.qkv = nn.Linear(hidden, 5 * hidden)  # query, key, 3 value groups
        self.edge = nn.Linear(num_rbf, heads + 3 * hidden)  # score bias + 3 value filters
        self.vec_mix = nn.Linear(hidden, 2 * hidden, bias=False)  # U, W (channels only)
        self.mlp = nn.Sequential(  # [x, |U v|] -> o1, o2, o3
            nn.Linear(2 * hidden, mlp_ratio * hidden), nn.SiLU(), nn.Linear(mlp_ratio * hidden, 3 * hidden)
        )
        del self.out, self.norm2  # the mixing MLP takes their place

    def forward(self, h: torch.Tensor, g: EdgeGeometry, edge_chunk: int = 0) -> torch.Tensor:
        """``h`` [N, 4·hidden] packed ``[x | v]``; returns the updated state (same shape).
        Edges run in one pass (the model refuses ``model.edge_chunk`` with vectors)."""
        if edge_chunk:
            raise ValueError("VectorAttentionBlock runs all edges in one pass (edge_chunk=0)")
        n, hd, nh = h.shape[0], self.hidden, self.heads
        d = hd // nh
        x, v = h[:, :hd], h[:, hd:].view(n, 3, hd)
        q, k, val = self.qkv(self.norm1(x)).split([hd, hd, 3 * hd], dim=-1)
        acc = torch.promote_types(h.dtype, torch.float32)
        src, dst, env, unit = g.src, g.dst, g.env, g.unit
        fe = self.edge(g.rbf)
        score = self._scores(q[src], k[dst], fe[:, :nh], acc)
        filt = fe[:, nh:]
        if g.topk is not None:
            keep = _topk_edges(score.mean(-1), g.topk[0], g.topk[1])
            src, dst, env, unit = src[keep], dst[keep], env[keep], unit[keep]
            score, filt = score[keep], filt[keep]
        a = self._weights(score, src, env, n)  # [E, heads]
        # a (and so msg, m1, m2) is in acc: products promote in-kernel, no [E, ...] cast copies
        msg = (val[dst] * filt).view(-1, 3, nh, d) * a.view(-1, 1, nh, 1)
        mx, m1, m2 = msg.view(-1, 3, hd).unbind(1)  # [E, H] each
        vmsg = v[dst] * m1.unsqueeze(1) + m2.unsqueeze(1) * unit.unsqueeze(-1)
        x = x + torch.zeros(n, hd, dtype=acc, device=h.device).index_add_(0, src, mx).to(x.dtype)
        v = v + torch.zeros(n, 3, hd, dtype=acc, device=h.device).index_add_(0, src, vmsg).to(v.dtype)
        uv, wv = self.vec_mix(v).split(hd, dim=-1)  # [N, 3, H] each
        norm = torch.sqrt((uv.to(acc) ** 2).sum(1) + 1e-8).to(x.dtype)
        o1, o2, o3 = self.mlp(torch.cat([x, norm], dim=-1)).split(hd, dim=-1)
        x = x + o3 + o2 * (uv * wv).sum(1)
        v = v + o1.unsqueeze(1) * wv
        return torch.cat([x, v.reshape(n, 3 * hd).to(x.dtype)], dim=-1)
