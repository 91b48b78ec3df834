"""Decode attention over the paged KV cache without a gathered copy of each context.

The serving forward's decode queries (one new token per sequence) can be attended three
ways, chosen by ``serve.engine.attention_backend`` (:func:`resolve_backend`):

* ``sdpa_gather`` — today's path (:func:`convergent.models.llama_paged.paged_attention`):
  each padded group of sequences gathers its whole context into a padded K/V copy per
  layer, then SDPA. Reads the cache, writes the copy, reads the copy.
* ``triton`` — :func:`convergent.models.paged_triton.decode_triton`: one kernel per layer
  for all decode sequences, each KV block read once.
* ``flex`` — PyTorch's FlexAttention (:func:`decode_flex`) over the whole cache as one
  key sequence, with a block mask built from the block tables (KV block = one cache
  page): compiled on CUDA, eager (and then materialising every score) on the CPU, where
  it serves only as a check of the mask.

:func:`decode_reference` is the plain-torch statement of what the kernels compute: block
by block through the block table, online softmax in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BACKENDS", "DecodeBatch", "decode_flex", "decode_reference", "resolve_backend",
           "triton_available"]

BACKENDS = ("sdpa_gather", "triton", "flex")


@dataclass
class DecodeBatch:
    """The decode sequences of a step, for the block-table kernels (device tensors)."""

    rows: torch.Tensor  # [n] packed row of each sequence's query
    tables: torch.Tensor  # [n, width] block ids (padding: 0, never read)
    ctx: torch.Tensor  # [n] context length including the new token
    width: int  # blocks of the longest context
    cache: dict[str, Any] = field(default_factory=dict)  # per-batch state (flex's block mask)


def triton_available() -> bool:
    """Whether ``triton`` imports (the GPU image has it; the CPU venv's dev extra too)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return False
    return True


def resolve_backend(name: str, device: torch.device | str) -> str:
    """``auto`` -> ``triton`` on CUDA where Triton imports, else ``sdpa_gather``; an
    explicit name is kept (``triton`` on CPU tensors needs ``TRITON_INTERPRET=1``)."""
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"attention backend {name!r}: choose auto or one of {BACKENDS}")
        return name
    if torch.device(device).type == "cuda" and triton_available():
        return "triton"
    return "sdpa_gather"


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dec: DecodeBatch,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention read block by block through the block tables: for block column
    ``j`` every sequence's ``j``-th block ``[n, block_size, nkv, hd]`` is read once and
    folded into a float32 online softmax. Returns ``[n, nq, hd]`` in ``q.dtype``."""
    n = dec.rows.numel()
    _t, nq, hd = q.shape
    nkv = k_cache.shape[1]
    rep = nq // nkv
    kb = k_cache.view(-1, block_size, nkv, hd)
    vb = v_cache.view(-1, block_size, nkv, hd)
    qd = q.index_select(0, dec.rows).view(n, nkv, rep, hd).float()
    m = torch.full((n, nkv, rep), float("-inf"), device=q.device)
    den = torch.zeros(n, nkv, rep, device=q.device)
    acc = torch.zeros(n, nkv, rep, hd, device=q.device)
    offs = torch.arange(block_size, device=q.device)
    for j in range(dec.width):
        blk = dec.tables[:, j]
        k = kb.index_select(0, blk).float()  # [n, bs, nkv, hd]
        v = vb.index_select(0, blk).float()
        s = torch.einsum("ngrd,nsgd->ngrs", qd, k) * scale
        valid = (j * block_size + offs)[None, :] < dec.ctx[:, None]  # [n, bs]
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        den = den * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("ngrs,nsgd->ngrd", p, v)
        m = m_new
    return (acc / den[..., None]).reshape(n, nq, hd).to(q.dtype)


_FLEX: dict[str, Any] = {}


def _flex_fn(device: torch.device):
    """flex_attention compiled on CUDA (its fused kernel; the step's sequence count changes
    every step, so after the first recompile torch.compile marks it dynamic); eager
    elsewhere (the unfused reference, which materialises the scores: a check only)."""
    key = device.type
    if key not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX[key] = torch.compile(flex_attention) if key == "cuda" else flex_attention
    return _FLEX[key]


def _flex_mask(dec: DecodeBatch, num_pages: int, block_size: int, q_block: int = 128):
    """The block mask of one step, built from the block tables (not by evaluating the mask
    over every query x slot, and with no device-to-host wait): query tile ``i`` visits
    exactly the pages of its sequences; ``mask_mod`` keeps, within them, the sequence's own
    slots below its context length."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = dec.tables.device
    n, w = dec.tables.shape
    col = torch.arange(w, device=dev)
    used = col[None, :] < ((dec.ctx + block_size - 1) // block_size)[:, None]  # [n, w]
    # page -> (sequence, first position); unused table entries write a spare last entry
    target = torch.where(used, dec.tables, num_pages).reshape(-1)
    page_seq = torch.full((num_pages + 1,), -1, dtype=torch.int64, device=dev)
    page_pos = torch.zeros(num_pages + 1, dtype=torch.int64, device=dev)
    page_seq[target] = torch.arange(n, device=dev).repeat_interleave(w)
    page_pos[target] = (col * block_size).repeat(n)
    ntiles = -(-n // q_block)
    per_tile = torch.zeros(ntiles, num_pages, dtype=torch.int32, device=dev)  # as wide as the KV
    counts = torch.zeros(ntiles, dtype=torch.int32, device=dev)
    for i in range(ntiles):  # up to q_block sequences a tile: one or two tiles
        rows = slice(i * q_block, (i + 1) * q_block)
        pages = torch.sort(target.view(n, w)[rows].reshape(-1)).values  # used first
        k = min(pages.numel(), num_pages)
        per_tile[i, :k] = torch.where(pages[:k] < num_pages, pages[:k], 0).to(torch.int32)
        counts[i] = used[rows].sum()
    ctx = dec.ctx

    def mask_mod(b, h, q_idx, kv_idx):
        p = kv_idx // block_size
        return (page_seq[p] == q_idx) & (page_pos[p] + kv_idx % block_size < ctx[q_idx])

    return BlockMask.from_kv_blocks(
        counts[None, None], per_tile[None, None], BLOCK_SIZE=(q_block, block_size),
        mask_mod=mask_mod, seq_lengths=(n, num_pages * block_size))


def decode_flex(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dec: DecodeBatch,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention by FlexAttention: the step's decode queries as one query sequence
    ``[1, nq, n, hd]``, the whole cache as one key sequence ``[1, nkv, slots, hd]`` (a
    view, no copy), GQA by ``enable_gqa``; the block mask (built once per step and shared
    by the layers) lets each query tile visit only its sequences' pages. Returns
    ``[n, nq, hd]`` in ``q.dtype``."""
    import warnings

    n = dec.rows.numel()
    slots = k_cache.shape[0]
    if "flex_mask" not in dec.cache:
        dec.cache["flex_mask"] = _flex_mask(dec, slots // block_size, block_size)
    qd = q.index_select(0, dec.rows).transpose(0, 1)[None]  # [1, nq, n, hd]
    k = k_cache.transpose(0, 1)[None]
    v = v_cache.transpose(0, 1)[None]
    with warnings.catch_warnings():  # eager on CPU: "called without torch.compile()"
        warnings.simplefilter("ignore", UserWarning)
        o = _flex_fn(q.device)(qd, k, v, block_mask=dec.cache["flex_mask"], scale=scale,
                               enable_gqa=k.shape[1] != qd.shape[1])
    return o[0].transpose(0, 1).reshape(n, q.shape[1], q.shape[2])
