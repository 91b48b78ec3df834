"""Edge-wise attention over a neighbour list: the scalar block of the molecular model.

See :mod:`convergent.models.molecular` for the architecture; :class:`EdgeGeometry` holds
the parameter-free edge features every block reads (distances in Å).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from convergent.models.edge_kernel import edge_messages
from convergent.models.segments import Segments


@dataclass
class EdgeGeometry:
    """Edges ``src -> dst`` (centre, neighbour) int64[E] and their parameter-free
    features: ``vec`` = pos[dst] - pos[src] (+ cell shift) float[E, 3] Å, distance ``r``
    [E] Å, radial basis ``rbf`` [E, num_rbf], envelope ``env`` [E], ``topk`` (or None).
    ``recv``/``send``: the edges grouped by centre / by neighbour (CSR,
    :mod:`convergent.models.segments`; None: the scalar block scatters with ``index_add_``);
    ``kernel``: ``model.edge_kernel`` (:mod:`convergent.models.edge_kernel`)."""

    src: torch.Tensor
    dst: torch.Tensor
    vec: torch.Tensor
    r: torch.Tensor
    rbf: torch.Tensor
    env: torch.Tensor
    topk: tuple[int, torch.Tensor] | None = None
    recv: Segments | None = None
    send: Segments | None = None
    kernel: str = "index"

    @cached_property
    def unit(self) -> torch.Tensor:
        """Unit bond vectors ``vec / r`` [E, 3] (from the centre to the neighbour); computed
        once per geometry, shared by every block."""
        return self.vec / self.r.clamp_min(1e-6).unsqueeze(-1)


class EdgeAttentionBlock(nn.Module):
    """One pre-norm Transformer block whose attention runs over an edge list."""

    def __init__(self, hidden: int, heads: int, num_rbf: int, mlp_ratio: int, weights: str = "softmax") -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
        if weights not in ("softmax", "silu"):
            raise ValueError(f"attention weights must be softmax or silu, not {weights!r}")
        self.hidden, self.heads, self.weights = hidden, heads, weights
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.edge = nn.Linear(num_rbf, heads + hidden)  # score bias per head + value filter
        self.out = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, mlp_ratio * hidden), nn.SiLU(), nn.Linear(mlp_ratio * hidden, hidden)
        )

    def forward(self, h: torch.Tensor, g: EdgeGeometry, edge_chunk: int = 0) -> torch.Tensor:
        """``h`` [N, hidden]; edges ``g.src -> g.dst`` (centre, neighbour) with radial basis
        ``g.rbf`` [E, R] and envelope ``g.env`` [E]. ``g.topk=(k, rows)`` keeps the k
        best-scoring edges per centre, where ``rows`` int64[B, 3] = (first edge, centres,
        edges per centre) of each molecule's row-major all-pairs block. Edge tensors are
        processed in chunks of ``edge_chunk`` edges (0 = all at once, the default): same
        result, smaller transient allocations, but every chunk adds an O(N) gradient buffer
        in backward (the gathers ``q[src]``, ``k[dst]``, ``v[dst]``), so cost grows as
        N·E/edge_chunk. With ``g.recv``/``g.send`` (CSR), no ``topk``, no chunks and
        ``g.kernel`` not ``index``, the message step is :func:`edge_messages` instead."""
        if g.recv is not None and g.send is not None and g.topk is None and edge_chunk <= 0 \
                and g.kernel != "index":
            return self._forward_csr(h, g)
        src, dst, rbf, env, topk = g.src, g.dst, g.rbf, g.env, g.topk
        n, hd, nh = h.shape[0], self.hidden, self.heads
        d = hd // nh
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        acc = torch.promote_types(h.dtype, torch.float32)  # softmax in >= fp32
        n_edges = src.numel()
        step = n_edges if (topk is not None or edge_chunk <= 0) else edge_chunk
        # split (not slicing): its backward concatenates the chunk gradients, O(E) in total,
        # where each slice's backward would allocate a zero gradient of the full [E, ...].
        srcs, dsts = src.split(max(step, 1)), dst.split(max(step, 1))
        scores, fvs = [], []
        for s_c, d_c, rbf_c in zip(srcs, dsts, rbf.split(max(step, 1)), strict=True):
            fe = self.edge(rbf_c)  # [e, heads + hidden]: score bias, value filter
            scores.append(self._scores(q[s_c], k[d_c], fe[:, :nh], acc))
            fvs.append(fe[:, nh:])
        score = torch.cat(scores) if len(scores) != 1 else scores[0]
        if topk is not None:
            keep = _topk_edges(score.mean(-1), topk[0], topk[1])
            src, dst, score, env = src[keep], dst[keep], score[keep], env[keep]
            fvs, srcs, dsts = [fvs[0][keep]], [src], [dst]
        a = self._weights(score, src, env, n).split([c.numel() for c in srcs])
        agg = torch.zeros(n, nh, d, dtype=acc, device=h.device)
        for s_c, d_c, a_c, fv in zip(srcs, dsts, a, fvs, strict=True):
            vals = (v[d_c] * fv).view(-1, nh, d)  # in h's dtype (bf16 under autocast)
            # a_c is in acc (>= fp32): the product promotes to acc in the same kernel, with
            # no separate [E, hidden] cast copy (same numbers; less traffic per edge)
            agg.index_add_(0, s_c, a_c.unsqueeze(-1) * vals)  # in place: no copy per chunk
        h = h + self.out(agg.view(n, hd).to(h.dtype))
        return h + self.mlp(self.norm2(h))

    def _forward_csr(self, h: torch.Tensor, g: EdgeGeometry) -> torch.Tensor:
        """The block with the message step over CSR edges (same numbers up to rounding)."""
        assert g.recv is not None and g.send is not None
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        fe = self.edge(g.rbf)  # [E, heads + hidden]: score bias, value filter
        # auto in training mode: torch (forces are differentiated again there, and the
        # fused kernel's differentiable backward recomputes with torch: see edge_kernel)
        kernel = "torch" if g.kernel == "auto" and self.training else g.kernel
        agg = edge_messages(q, k, v, fe, g.env, g.recv, g.send, self.heads,
                            self.weights == "softmax", kernel)
        h = h + self.out(agg.to(h.dtype))
        return h + self.mlp(self.norm2(h))

    def _scores(self, q_src: torch.Tensor, k_dst: torch.Tensor, bias: torch.Tensor,
                acc: torch.dtype) -> torch.Tensor:
        """Per-head scores [E, heads] in ``acc``: ``<q_i, k_j> / sqrt(d) + b(r_ij)``."""
        d = self.hidden // self.heads
        qk = (q_src * k_dst).view(-1, self.heads, d).sum(-1)
        return qk.to(acc) / math.sqrt(d) + bias.to(acc)

    def _weights(self, score: torch.Tensor, src: torch.Tensor, env: torch.Tensor, n: int) -> torch.Tensor:
        """Attention weights [E, heads] from scores [E, heads] and envelope ``env`` [E].

        ``softmax``: softmax over each centre's neighbours weighted by the envelope, plus
        a zero-score "sink" slot so a lone neighbour's weight also fades at the cutoff
        (the message is a weighted mean). ``silu``: ``silu(s_ij) · φ(r_ij)``, unnormalised
        (the message is a gated sum, so it grows with the number of neighbours).
        """
        env = env.to(score.dtype).unsqueeze(1)
        if self.weights == "silu":
            return nn.functional.silu(score) * env
        nh = score.shape[1]
        m = torch.zeros((n, nh), dtype=score.dtype, device=score.device)  # sink score 0
        m = m.scatter_reduce(0, src.unsqueeze(1).expand(-1, nh), score.detach(), "amax")
        w = torch.exp(score - m[src]) * env
        denom = torch.exp(-m).index_add_(0, src, w)
        return w / denom[src]


def _topk_edges(score: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    """Indices of the ``k`` best-scoring edges per centre in all-pairs blocks."""
    keep = []
    for start, n_center, per in rows.tolist():
        if per == 0:
            continue
        block = score[start : start + n_center * per].view(n_center, per)
        kk = min(k, per)
        idx = torch.topk(block, kk, dim=1).indices
        keep.append((idx + torch.arange(n_center, device=score.device).unsqueeze(1) * per + start).flatten())
    if not keep:
        return torch.zeros(0, dtype=torch.int64, device=score.device)
    return torch.cat(keep)
