"""Triton kernels of the fused edge attention (:mod:`convergent.models.edge_kernel`).

Imported only when the Triton path runs (this module imports ``triton``). The kernels are
jitted on first use, so ``TRITON_INTERPRET=1`` set before the first call runs them on CPU
tensors (the tests do); only long-standing ``triton.language`` operations are used (the
GPU machines' torch ships an older Triton than the dev venv).

Per receiver atom ``i`` and head ``h`` (one program each), over ``i``'s edges ``e = (i, j)``
in ``ptr[i]:ptr[i+1]`` (edge ids through ``order`` when the edges are not sorted):
``s_e = <q_i, k_j> / sqrt(d) + b_e``, weights ``a_e = silu(s_e) φ_e`` or the softmax with
a zero-score sink ``a_e = φ_e exp(s_e - m) / (exp(-m) + Σ φ exp(s - m))`` (online: one
pass, running max ``m`` and denominator ``l``), message ``Σ_e a_e v_j ⊙ f_e``. Everything
is read once from its source rows (q, k, v: [N, ...], bias and filter: [E, ...]) and
accumulated in fp32; nothing per edge is written.

Backward (first order): ``_bwd_recv`` recomputes each receiver's weights (softmax: from the
saved ``m``, ``l``), writes the per-edge gradients (bias, filter, envelope per head) and
``dq`` (its own row), and the per-edge-head ``ds`` and ``a`` that ``_bwd_send`` reads over
the sender segments (edges grouped by ``j``) to write ``dk`` and ``dv``: no atomics.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_E = 16  # edges per loop step


# ``scale`` is a constexpr: Inductor (train.compile=blocks) passes a runtime Python float as
# fp64, which promoted the fp32 accumulators (the compiled-blocks GPU test at 4e3e605)
def _fwd(q_ptr, k_ptr, v_ptr, fe_ptr, env_ptr, dst_ptr, order_ptr, ptr_ptr, out_ptr, stats_ptr,
         stride_q, stride_k, stride_v, stride_fe, n_heads, head_dim, scale: tl.constexpr,
         HAS_ORDER: tl.constexpr, SOFTMAX: tl.constexpr,
         BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.load(ptr_ptr + i)
    hi = tl.load(ptr_ptr + i + 1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    col = h * head_dim + offs_d
    qi = tl.load(q_ptr + i * stride_q + col, mask=dmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m = tl.max(tl.zeros([BLOCK_E], dtype=tl.float32), axis=0)  # the sink's score, 0
    lsum = m + 1.0  # the sink's exp(0 - m)
    for start in range(lo, hi, BLOCK_E):
        e = start + tl.arange(0, BLOCK_E)
        emask = e < hi
        if HAS_ORDER:
            eid = tl.load(order_ptr + e, mask=emask, other=0)
        else:
            eid = e
        j = tl.load(dst_ptr + eid, mask=emask, other=0)
        m2 = emask[:, None] & dmask[None, :]
        kj = tl.load(k_ptr + j[:, None] * stride_k + col[None, :], mask=m2, other=0.0)
        s = tl.sum(kj.to(tl.float32) * qi[None, :], axis=1) * scale
        s += tl.load(fe_ptr + eid * stride_fe + h, mask=emask, other=0.0).to(tl.float32)
        env = tl.load(env_ptr + eid, mask=emask, other=0.0).to(tl.float32)
        vj = tl.load(v_ptr + j[:, None] * stride_v + col[None, :], mask=m2, other=0.0)
        fv = tl.load(fe_ptr + eid[:, None] * stride_fe + n_heads + col[None, :], mask=m2, other=0.0)
        val = vj.to(tl.float32) * fv.to(tl.float32)
        if SOFTMAX:
            m_new = tl.maximum(m, tl.max(tl.where(emask, s, float("-inf")), axis=0))
            alpha = tl.exp(m - m_new)
            w = tl.where(emask, tl.exp(s - m_new) * env, 0.0)
            lsum = lsum * alpha + tl.sum(w, axis=0)
            acc = acc * alpha + tl.sum(w[:, None] * val, axis=0)
            m = m_new
        else:
            w = tl.where(emask, s * tl.sigmoid(s) * env, 0.0)
            acc += tl.sum(w[:, None] * val, axis=0)
    if SOFTMAX:
        acc = acc / lsum
        tl.store(stats_ptr + (i * n_heads + h) * 2, m)
        tl.store(stats_ptr + (i * n_heads + h) * 2 + 1, lsum)
    tl.store(out_ptr + i * n_heads * head_dim + col, acc, mask=dmask)


def _bwd_recv(q_ptr, k_ptr, v_ptr, fe_ptr, env_ptr, dst_ptr, order_ptr, ptr_ptr,
              g_ptr, out_ptr, stats_ptr, dq_ptr, dfe_ptr, denv_ptr, ds_ptr, a_ptr,
              stride_q, stride_k, stride_v, stride_fe, n_heads, head_dim, scale: tl.constexpr,
              HAS_ORDER: tl.constexpr, SOFTMAX: tl.constexpr,
              BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.load(ptr_ptr + i)
    hi = tl.load(ptr_ptr + i + 1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    col = h * head_dim + offs_d
    hd = n_heads * head_dim
    qi = tl.load(q_ptr + i * stride_q + col, mask=dmask, other=0.0).to(tl.float32)
    gi = tl.load(g_ptr + i * hd + col, mask=dmask, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_D], dtype=tl.float32)
    if SOFTMAX:
        m = tl.load(stats_ptr + (i * n_heads + h) * 2)
        lsum = tl.load(stats_ptr + (i * n_heads + h) * 2 + 1)
        big_d = tl.sum(gi * tl.load(out_ptr + i * hd + col, mask=dmask, other=0.0), axis=0)
    for start in range(lo, hi, BLOCK_E):
        e = start + tl.arange(0, BLOCK_E)
        emask = e < hi
        if HAS_ORDER:
            eid = tl.load(order_ptr + e, mask=emask, other=0)
        else:
            eid = e
        j = tl.load(dst_ptr + eid, mask=emask, other=0)
        m2 = emask[:, None] & dmask[None, :]
        kj = tl.load(k_ptr + j[:, None] * stride_k + col[None, :], mask=m2, other=0.0).to(tl.float32)
        s = tl.sum(kj * qi[None, :], axis=1) * scale
        s += tl.load(fe_ptr + eid * stride_fe + h, mask=emask, other=0.0).to(tl.float32)
        env = tl.load(env_ptr + eid, mask=emask, other=0.0).to(tl.float32)
        vj = tl.load(v_ptr + j[:, None] * stride_v + col[None, :], mask=m2, other=0.0).to(tl.float32)
        fv_ptrs = fe_ptr + eid[:, None] * stride_fe + n_heads + col[None, :]
        fv = tl.load(fv_ptrs, mask=m2, other=0.0).to(tl.float32)
        da = tl.sum(gi[None, :] * vj * fv, axis=1)  # dL/da_e
        if SOFTMAX:
            p = tl.exp(s - m) / lsum
            a = p * env
            ds = a * (da - big_d)
            denv = p * (da - big_d)
        else:
            sig = tl.sigmoid(s)
            a = s * sig * env
            ds = da * env * sig * (1.0 + s * (1.0 - sig))
            denv = da * s * sig
        ds = tl.where(emask, ds, 0.0)
        a = tl.where(emask, a, 0.0)
        dq += tl.sum(ds[:, None] * kj, axis=0)
        tl.store(dfe_ptr + eid * (n_heads + hd) + h, ds, mask=emask)
        tl.store(dfe_ptr + eid[:, None] * (n_heads + hd) + n_heads + col[None, :],
                 a[:, None] * gi[None, :] * vj, mask=m2)
        tl.store(denv_ptr + eid * n_heads + h, denv, mask=emask)
        tl.store(ds_ptr + eid * n_heads + h, ds, mask=emask)
        tl.store(a_ptr + eid * n_heads + h, a, mask=emask)
    tl.store(dq_ptr + i * hd + col, dq * scale, mask=dmask)


def _bwd_send(q_ptr, g_ptr, fe_ptr, src_ptr, order_ptr, ptr_ptr, ds_ptr, a_ptr, dk_ptr, dv_ptr,
              stride_q, stride_fe, n_heads, head_dim, scale: tl.constexpr,
              BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    j = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.load(ptr_ptr + j)
    hi = tl.load(ptr_ptr + j + 1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    col = h * head_dim + offs_d
    hd = n_heads * head_dim
    dk = tl.zeros([BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_E):
        e = start + tl.arange(0, BLOCK_E)
        emask = e < hi
        eid = tl.load(order_ptr + e, mask=emask, other=0)
        i = tl.load(src_ptr + eid, mask=emask, other=0)
        m2 = emask[:, None] & dmask[None, :]
        ds = tl.load(ds_ptr + eid * n_heads + h, mask=emask, other=0.0)
        a = tl.load(a_ptr + eid * n_heads + h, mask=emask, other=0.0)
        qi = tl.load(q_ptr + i[:, None] * stride_q + col[None, :], mask=m2, other=0.0).to(tl.float32)
        gi = tl.load(g_ptr + i[:, None] * hd + col[None, :], mask=m2, other=0.0).to(tl.float32)
        fv_ptrs = fe_ptr + eid[:, None] * stride_fe + n_heads + col[None, :]
        fv = tl.load(fv_ptrs, mask=m2, other=0.0).to(tl.float32)
        dk += tl.sum(ds[:, None] * qi, axis=0)
        dv += tl.sum(a[:, None] * gi * fv, axis=0)
    tl.store(dk_ptr + j * hd + col, dk * scale, mask=dmask)
    tl.store(dv_ptr + j * hd + col, dv, mask=dmask)


@functools.cache
def _jitted(interpret: bool) -> tuple[Any, Any, Any]:
    """The three kernels, jitted in the mode TRITON_INTERPRET says at the first call."""
    del interpret  # the cache key: triton.jit reads TRITON_INTERPRET itself
    return triton.jit(_fwd), triton.jit(_bwd_recv), triton.jit(_bwd_send)


def _kernels() -> tuple[Any, Any, Any]:
    return _jitted(os.environ.get("TRITON_INTERPRET", "0") == "1")


def _meta(q: torch.Tensor, heads: int) -> tuple[int, int, float]:
    d = q.shape[1] // heads
    return d, max(16, triton.next_power_of_2(d)), 1.0 / math.sqrt(d)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fe: torch.Tensor,
            env: torch.Tensor, dst: torch.Tensor, order: torch.Tensor | None, ptr: torch.Tensor,
            heads: int, softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Messages float32[N, heads·d] and the softmax statistics float32[N, heads, 2]."""
    n = ptr.numel() - 1
    d, block_d, scale = _meta(q, heads)
    out = torch.empty(n, heads * d, dtype=torch.float32, device=q.device)
    stats = torch.empty(n, heads, 2, dtype=torch.float32, device=q.device)
    if n:
        _kernels()[0][(n, heads)](
            q, k, v, fe, env, dst, dst if order is None else order, ptr, out, stats,
            q.stride(0), k.stride(0), v.stride(0), fe.stride(0), heads, d, scale,
            HAS_ORDER=order is not None, SOFTMAX=softmax, BLOCK_E=BLOCK_E, BLOCK_D=block_d)
    return out, stats


def backward(grad: torch.Tensor, saved: tuple[torch.Tensor, ...], recv: Any, send: Any,
             heads: int, softmax: bool) -> tuple[torch.Tensor, ...]:
    """Gradients (float32) of q, k, v [N, heads·d], fe [E, heads + heads·d], env [E]."""
    q, k, v, fe, env, out, stats = saved
    n, e = recv.n, recv.index.numel()
    d, block_d, scale = _meta(q, heads)
    hd = heads * d
    f32 = dict(dtype=torch.float32, device=q.device)
    dq, dk, dv = (torch.zeros(n, hd, **f32) for _ in range(3))
    dfe, denv_h = torch.zeros(e, heads + hd, **f32), torch.zeros(e, heads, **f32)
    ds, a = torch.empty(e, heads, **f32), torch.empty(e, heads, **f32)
    if n and e:
        fwd, recv_k, send_k = _kernels()
        grad = grad.contiguous()
        recv_k[(n, heads)](
            q, k, v, fe, env, send.index, recv.index if recv.order is None else recv.order,
            recv.ptr, grad, out, stats, dq, dfe, denv_h, ds, a,
            q.stride(0), k.stride(0), v.stride(0), fe.stride(0), heads, d, scale,
            HAS_ORDER=recv.order is not None, SOFTMAX=softmax, BLOCK_E=BLOCK_E, BLOCK_D=block_d)
        send_k[(n, heads)](
            q, grad, fe, recv.index, send.order, send.ptr, ds, a, dk, dv,
            q.stride(0), fe.stride(0), heads, d, scale, BLOCK_E=BLOCK_E, BLOCK_D=block_d)
    return dq, dk, dv, dfe, denv_h.sum(1)
