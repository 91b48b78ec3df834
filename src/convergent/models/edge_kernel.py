"""The edge attention's message step over receiver-sorted (CSR) edges: torch or Triton.

:func:`edge_messages` computes, for every receiver atom ``i`` and head, the attention over
its edges ``e = (i, j)`` — gather ``q_i``, ``k_j``, ``v_j``; scores ``<q_i, k_j>/sqrt(d) +
b_e``; weights (``silu(s) φ`` or the softmax with a sink slot, see
:class:`~convergent.models.edge_attention.EdgeAttentionBlock`); the weighted sum
``Σ_e a_e v_j ⊙ f_e`` — as one of:

* ``torch`` (:func:`messages_torch`): the reference's operations with every per-receiver
  reduction a segment sum over contiguous ranges and every gather's gradient a segment
  sum too (:mod:`convergent.models.segments`): no atomics, no index sorts; autocast off
  inside (the dtypes are explicit: products in the features' dtype, scores, weights and
  sums in >= fp32), so CUDA autocast adds no fp32 copies of the [E, hidden] products.
* ``triton`` (:mod:`convergent.models.edge_triton`): one fused kernel per direction. The
  forward reads each source row once and writes only the [N, hidden] messages. Backward:
  the first order (forces at inference, MD, screening) is two Triton kernels; where the
  backward itself is differentiated (training on forces: ``create_graph``), it recomputes
  with :func:`messages_torch` and differentiates that, so the second order is torch's
  (the fused forward then adds its own cost to the torch path's: see docs/gpu-notes.md).

``model.edge_kernel``: ``auto`` (Triton on CUDA when it imports and the features are
fp32/bf16/fp16 with head width <= 256, for a block in eval mode; torch otherwise, training
mode included: the fused forward cannot pay there until the second order is a kernel too),
``torch``, ``triton`` (refused where it cannot run: no CUDA and no ``TRITON_INTERPRET=1``,
or an unsupported dtype), ``index`` (the earlier scatter/``index_add_`` path, kept as the
reference).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
from torch import nn

from convergent.core.errors import ConfigError
from convergent.models.segments import Segments, gather, segment_max, segment_sum

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def messages_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fe: torch.Tensor,
                   env: torch.Tensor, recv: Segments, send: Segments, heads: int,
                   softmax: bool) -> torch.Tensor:
    """Messages [N, heads·d] in ``promote(q.dtype, fp32)`` with torch segment operations.

    ``q``, ``k``, ``v`` [N, heads·d]; ``fe`` [E, heads + heads·d] (score bias, value
    filter); ``env`` [E]; ``recv`` the edges grouped by receiver (``src``), ``send`` by
    sender (``dst``)."""
    with torch.autocast(q.device.type, enabled=False):
        d = q.shape[1] // heads
        acc = torch.promote_types(q.dtype, torch.float32)
        qk = (gather(q, recv) * gather(k, send)).view(-1, heads, d).sum(-1)
        score = qk.to(acc) / math.sqrt(d) + fe[:, :heads].to(acc)
        env_h = env.to(acc).unsqueeze(1)
        if softmax:
            m = segment_max(score, recv, initial=0.0)  # the sink slot's score is 0
            w = torch.exp(score - m.index_select(0, recv.index)) * env_h
            a = w / gather(torch.exp(-m) + segment_sum(w, recv), recv)
        else:
            a = nn.functional.silu(score) * env_h
        vals = (gather(v, send) * fe[:, heads:]).view(-1, heads, d)
        return segment_sum(a.unsqueeze(-1) * vals, recv).view(recv.n, heads * d)


class _TritonMessages(torch.autograd.Function):
    """Triton forward and first-order backward; a differentiated backward recomputes with
    :func:`messages_torch` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fe: torch.Tensor,  # type: ignore[override]
                env: torch.Tensor, recv: Segments, send: Segments, heads: int,
                softmax: bool) -> torch.Tensor:
        from convergent.models import edge_triton

        out, stats = edge_triton.forward(q, k, v, fe, env, send.index, recv.order, recv.ptr,
                                         heads, softmax)
        ctx.save_for_backward(q, k, v, fe, env, out, stats)
        ctx.meta = (recv, send, heads, softmax)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        saved = ctx.saved_tensors
        recv, send, heads, softmax = ctx.meta
        need = ctx.needs_input_grad[:5]
        if torch.is_grad_enabled():  # create_graph: the gradient is itself differentiated
            grads = _recompute(saved[:5], need, grad, recv, send, heads, softmax)
        else:
            from convergent.models import edge_triton

            raw = edge_triton.backward(grad, saved, recv, send, heads, softmax)
            grads = [g.to(x.dtype) if nd else None for g, x, nd in zip(raw, saved[:5], need, strict=True)]
        return (*grads, None, None, None, None)


def _recompute(inputs: tuple[torch.Tensor, ...], need: tuple[bool, ...], grad: torch.Tensor,
               recv: Segments, send: Segments, heads: int, softmax: bool) -> list[Any]:
    """Gradients of :func:`messages_torch` at ``inputs`` with their graph (create_graph).

    Each input enters through a fresh alias (``view_as``): an input may be an ancestor of
    another (the envelope feeds the edge filters and the next layers' queries), and
    ``autograd.grad`` with respect to the originals would add those paths here as well
    as in the outer backward. The aliases keep the graph to the originals."""
    with torch.enable_grad():
        xs = [x.view_as(x) if nd else x.detach() for x, nd in zip(inputs, need, strict=True)]
        out = messages_torch(*xs, recv, send, heads, softmax)
    wrt = [x for x, nd in zip(xs, need, strict=True) if nd]
    got = iter(torch.autograd.grad(out, wrt, grad.to(out.dtype), create_graph=True,
                                   allow_unused=True))
    return [next(got) if nd else None for nd in need]


@functools.cache
def triton_importable() -> bool:
    """Whether ``triton`` imports here."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False
    return True


def triton_unsupported(q: torch.Tensor, heads: int) -> str | None:
    """Why the Triton kernel cannot run on features ``q`` [N, heads·d] here (None: it can)."""
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return f"needs CUDA tensors (or TRITON_INTERPRET=1), not {q.device.type}"
    if not triton_importable():
        return "triton does not import"
    if q.dtype not in TRITON_DTYPES:
        return f"supports float32/bfloat16/float16 features, not {q.dtype}"
    if q.shape[1] // heads > 256:
        return f"supports heads up to 256 wide, not {q.shape[1] // heads}"
    return None


def edge_messages(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fe: torch.Tensor,
                  env: torch.Tensor, recv: Segments, send: Segments, heads: int,
                  softmax: bool, kernel: str = "auto") -> torch.Tensor:
    """Messages [N, heads·d] (>= fp32) by ``kernel`` (auto | torch | triton; see the module
    docstring)."""
    if kernel == "torch" or (kernel == "auto" and (
            q.device.type != "cuda" or triton_unsupported(q, heads) is not None)):
        return messages_torch(q, k, v, fe, env, recv, send, heads, softmax)
    why = triton_unsupported(q, heads)
    if why is not None:
        raise ConfigError(f"model.edge_kernel=triton: the kernel {why}",
                              hint="set model.edge_kernel=auto (Triton where it runs, else torch)")
    return _TritonMessages.apply(q, k, v, fe, env, recv, send, heads, softmax)
