"""Paged decode attention as Triton kernels: each KV block read once, no gathered copy.

One program per (decode sequence, KV head, split of its context): it loads the ``rep`` query heads that share the
KV head (GQA), walks the sequence's context in tiles of ``TILE`` tokens through its block
table (each token's slot is ``table[t // block_size] * block_size + t % block_size``),
and keeps an online softmax in float32 (running max, running sum, rescaled accumulator),
writing the ``[rep, head_dim]`` output straight into the packed output rows. With more than
one split (flash-decoding: a few long contexts would leave most of the GPU idle, one
program walking each context alone; at 4e3e605 the one-split kernel read 0.5 TB/s at 64
sequences x 2,048 tokens on an H100) each program writes its part's max, sum and
accumulator, and a second kernel combines them.

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

__all__ = ["choose_splits", "decode_triton"]

_KERNELS: dict[tuple[str, bool], Any] = {}  # (kernel, interpreted?) -> the jitted kernel
TARGET_PROGRAMS = 2048  # split the context until the grid has about this many programs
MIN_SPLIT_TILES = 4  # ... but never into parts of fewer tiles of the widest context


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, tab_ptr, ctx_ptr, row_ptr, pm_ptr, pden_ptr, pacc_ptr,
    sq_t, sq_h, sk_s, sk_h, so_t, so_h, s_tab, scale,
    REP: tl.constexpr, REP_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
    BS: tl.constexpr, TILE: tl.constexpr, USE_DOT: tl.constexpr, SPLITS: tl.constexpr,
):
    """One (decode sequence, KV head, split): online softmax over the split's part of the
    context, tile by tile; one split writes the output, several their partial results."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(row_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), TILE) * TILE  # each split's tokens, whole tiles
    lo = split * chunk
    hi = tl.minimum(ctx, lo + chunk)
    r = tl.arange(0, REP_P)
    d = tl.arange(0, HD_P)
    qmask = (r < REP)[:, None] & (d < HD)[None, :]
    q_off = row * sq_t + (kvh * REP + r)[:, None] * sq_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=qmask, other=0.0)
    m = tl.full([REP_P], float("-inf"), tl.float32)
    den = tl.zeros([REP_P], tl.float32)
    acc = tl.zeros([REP_P, HD_P], tl.float32)
    for start in range(lo, hi, TILE):
        t = start + tl.arange(0, TILE)
        tmask = t < hi
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
    if SPLITS == 1:
        out = acc / den[:, None]
        o_off = row * so_t + (kvh * REP + r)[:, None] * so_h + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=qmask)
    else:  # an empty split (lo >= hi) writes max -inf, sum 0, accumulator 0
        base = ((seq * tl.num_programs(1) + kvh) * SPLITS + split) * REP_P + r
        tl.store(pm_ptr + base, m)
        tl.store(pden_ptr + base, den)
        tl.store(pacc_ptr + base[:, None] * HD_P + d[None, :], acc)


def _paged_combine_kernel(
    pm_ptr, pden_ptr, pacc_ptr, o_ptr, row_ptr, so_t, so_h,
    REP: tl.constexpr, REP_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One (decode sequence, KV head): the splits' partial softmaxes combined (each
    rescaled to the largest maximum; split 0 is never empty, so that maximum is finite)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(row_ptr + seq)
    r = tl.arange(0, REP_P)
    d = tl.arange(0, HD_P)
    first = (seq * tl.num_programs(1) + kvh) * SPLITS * REP_P
    m = tl.full([REP_P], float("-inf"), tl.float32)
    for i in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(pm_ptr + first + i * REP_P + r))
    den = tl.zeros([REP_P], tl.float32)
    acc = tl.zeros([REP_P, HD_P], tl.float32)
    for i in tl.static_range(SPLITS):
        base = first + i * REP_P + r
        mi = tl.load(pm_ptr + base)
        w = tl.where(mi > float("-inf"), tl.exp(mi - m), 0.0)
        den += w * tl.load(pden_ptr + base)
        acc += w[:, None] * tl.load(pacc_ptr + base[:, None] * HD_P + d[None, :])
    out = acc / den[:, None]
    qmask = (r < REP)[:, None] & (d < HD)[None, :]
    o_off = row * so_t + (kvh * REP + r)[:, None] * so_h + d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=qmask)


def _kernel(fn, interpret: bool):
    """The jitted kernel, built on first use: ``triton.jit`` reads ``TRITON_INTERPRET``
    when it decorates, so the decision is taken here, not at import."""
    key = (fn.__name__, interpret)
    if key not in _KERNELS:
        _KERNELS[key] = triton.jit(fn)
    return _KERNELS[key]


def choose_splits(n: int, nkv: int, width_tokens: int, tile: int) -> int:
    """Splits of each sequence's context (flash-decoding): enough for about
    :data:`TARGET_PROGRAMS` programs (a few sequences of long contexts would otherwise
    leave most of the GPU idle, each program walking its whole context alone), at most 16,
    and none shorter than :data:`MIN_SPLIT_TILES` tiles of the widest context the block
    table holds (``width_tokens``; the device's context lengths are not read: no sync)."""
    want = -(-TARGET_PROGRAMS // max(1, n * nkv))
    return max(1, min(16, want, width_tokens // (MIN_SPLIT_TILES * tile)))


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
    splits: int | None = None,
) -> None:
    """Decode attention of the sequences whose query is packed row ``rows[i]`` of ``q``
    ``[T, nq, hd]``, written into the same rows of ``out`` ``[T, nq, hd]``.

    ``k_cache`` / ``v_cache`` ``[slots, nkv, hd]`` (last dim contiguous, the serving
    dtype), ``tables`` ``[n, W]`` the block ids of each sequence (padding unread),
    ``ctx`` ``[n]`` its context length (>= 1) including the new token, whose K/V is
    already in the cache. ``tile`` tokens per inner step (a power of two >= 16);
    ``splits`` parts of each context run by separate programs and combined by a second
    kernel (:func:`choose_splits` when ``None``; 1: one kernel, no partial results).
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
    if splits is None:
        splits = choose_splits(n, nkv, tables.shape[1] * block_size, tile)
    rep_p, hd_p = _pow2(rep, 16 if use_dot else 1), _pow2(hd, 16)
    part = (torch.empty(n * nkv * splits * rep_p, dtype=torch.float32, device=q.device),
            torch.empty(n * nkv * splits * rep_p, dtype=torch.float32, device=q.device),
            torch.empty(n * nkv * splits * rep_p * hd_p, dtype=torch.float32, device=q.device)
            ) if splits > 1 else (out, out, out)  # unused with one split
    _kernel(_paged_decode_kernel, interpret)[(n, nkv, splits)](
        q, k_cache, v_cache, out, tables, ctx, rows, *part,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), tables.stride(0), float(scale),
        REP=rep, REP_P=rep_p, HD=hd, HD_P=hd_p,
        BS=block_size, TILE=tile, USE_DOT=use_dot, SPLITS=splits,
    )
    if splits > 1:
        _kernel(_paged_combine_kernel, interpret)[(n, nkv)](
            *part, out, rows, out.stride(0), out.stride(1),
            REP=rep, REP_P=rep_p, HD=hd, HD_P=hd_p, SPLITS=splits)
