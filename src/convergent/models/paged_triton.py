"""Paged decode attention as one Triton kernel: each KV block read once, no gathered copy.

One program per (decode sequence, KV head): it loads the ``rep`` query heads that share the
KV head (GQA), walks the sequence's context in tiles of ``TILE`` tokens through its block
table (each token's slot is ``table[t // block_size] * block_size + t % block_size``),
and keeps an online softmax in float32 (running max, running sum, rescaled accumulator),
writing the ``[rep, head_dim]`` output straight into the packed output rows.

Two inner products, chosen at compile time by the input dtype: float32 multiplies and
sums elementwise (IEEE float32, never TF32: ``tl.dot`` on float32 inputs rounds them to
TF32 on tensor cores); bfloat16 / float16 load in their dtype (the bytes moved are the
dtype's) and take ``tl.dot`` on the values cast to float32 — exact in TF32, whose 10-bit
mantissa holds both dtypes' — with float32 accumulation, the query heads padded to 16
rows, the probabilities rounded to TF32 (not to the dtype) before the PV product. A
bf16 ``tl.dot`` would use the faster bf16 MMA, but decode attention is bound by memory,
not by its multiplies, and Triton 3.9's interpreter computes ``tl.dot`` on bf16 operands
wrongly (checked: errors of 1e10 on a 16x16 product), so the CPU check could not cover it.

Only long-standing ``triton.language`` calls (load/store with masks, arange, program_id,
dot, trans, max/sum/exp/where, constexpr): the GPU machine's torch 2.11 ships Triton ~3.5,
this venv 3.9. On CPU tensors the kernel runs under Triton's interpreter, which needs
``TRITON_INTERPRET=1`` in the environment when the kernel is first used (the tests set
it); :func:`decode_triton` refuses CPU tensors without it. Imported only where the
``triton`` backend runs (it imports triton).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["decode_triton"]

_KERNELS: dict[bool, Any] = {}  # interpreted? -> the jitted kernel


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, tab_ptr, ctx_ptr, row_ptr,
    sq_t, sq_h, sk_s, sk_h, so_t, so_h, s_tab, scale,
    REP: tl.constexpr, REP_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
    BS: tl.constexpr, TILE: tl.constexpr, USE_DOT: tl.constexpr,
):
    """One (decode sequence, KV head): online softmax over the context, tile by tile."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(row_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    r = tl.arange(0, REP_P)
    d = tl.arange(0, HD_P)
    qmask = (r < REP)[:, None] & (d < HD)[None, :]
    q_off = row * sq_t + (kvh * REP + r)[:, None] * sq_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=qmask, other=0.0)
    m = tl.full([REP_P], float("-inf"), tl.float32)
    den = tl.zeros([REP_P], tl.float32)
    acc = tl.zeros([REP_P, HD_P], tl.float32)
    for start in range(0, ctx, TILE):
        t = start + tl.arange(0, TILE)
        tmask = t < ctx
        blk = tl.load(tab_ptr + seq * s_tab + t // BS, mask=tmask, other=0)
        kv_off = (blk * BS + t % BS)[:, None] * sk_s + kvh * sk_h + d[None, :]
        kvmask = tmask[:, None] & (d < HD)[None, :]
        k = tl.load(k_ptr + kv_off, mask=kvmask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kvmask, other=0.0)
        if USE_DOT:  # bf16 / fp16 values are exact in TF32: the products are exact
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))  # [REP_P, TILE]
        else:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            pv = tl.dot(p, v.to(tl.float32))
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / den[:, None]
    o_off = row * so_t + (kvh * REP + r)[:, None] * so_h + d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=qmask)


def _kernel(interpret: bool):
    """The jitted kernel, built on first use: ``triton.jit`` reads ``TRITON_INTERPRET``
    when it decorates, so the decision is taken here, not at import."""
    if interpret not in _KERNELS:
        _KERNELS[interpret] = triton.jit(_paged_decode_kernel)
    return _KERNELS[interpret]


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    tables: torch.Tensor,
    ctx: torch.Tensor,
    block_size: int,
    scale: float,
    tile: int = 32,
) -> None:
    """Decode attention of the sequences whose query is packed row ``rows[i]`` of ``q``
    ``[T, nq, hd]``, written into the same rows of ``out`` ``[T, nq, hd]``.

    ``k_cache`` / ``v_cache`` ``[slots, nkv, hd]`` (last dim contiguous, the serving
    dtype), ``tables`` ``[n, W]`` the block ids of each sequence (padding unread),
    ``ctx`` ``[n]`` its context length (>= 1) including the new token, whose K/V is
    already in the cache. ``tile`` tokens per inner step (a power of two >= 16).
    """
    n = rows.numel()
    if n == 0:
        return
    interpret = q.device.type != "cuda"
    if interpret and not _interpreting():
        raise RuntimeError("the triton decode attention on CPU tensors needs TRITON_INTERPRET=1 "
                           "(Triton's interpreter); serve.engine.attention_backend=auto uses "
                           "it on CUDA only")
    _t, nq, hd = q.shape
    nkv = k_cache.shape[1]
    rep = nq // nkv
    use_dot = q.dtype != torch.float32
    assert k_cache.dtype == v_cache.dtype == q.dtype == out.dtype, "one dtype"
    for t in (q, k_cache, v_cache, out):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    kern = _kernel(interpret)
    kern[(n, nkv)](
        q, k_cache, v_cache, out, tables, ctx, rows,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), tables.stride(0), float(scale),
        REP=rep, REP_P=_pow2(rep, 16 if use_dot else 1), HD=hd, HD_P=_pow2(hd, 16),
        BS=block_size, TILE=tile, USE_DOT=use_dot,
    )
