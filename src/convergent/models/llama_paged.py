"""The paged-KV serving path of the Llama decoder: packed-batch metadata and attention.

:class:`PagedBatch` describes one packed serving batch (tokens of many sequences
concatenated, their keys/values in a paged cache); :meth:`PagedBatch.prepare` builds once
per batch the RoPE tables and the padded attention groups every layer reuses, and
:func:`paged_attention` is the attention of one layer over that cache (called by
:meth:`convergent.models.llama_model.Attention.forward_paged`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from convergent.models.llama_rope import Rotary

__all__ = ["DecodeGroup", "PagedBatch", "PrefillGroup", "SERVING_SDPA_BACKENDS", "pad_groups",
           "paged_attention", "serving_attention"]

# SDPA backends of the serving forward on CUDA: not cuDNN's. Its attention builds and caches
# a graph per input shape, and a serving step's shapes change every step (context width,
# group sizes): profiled on an H100 (2026-11-27, docs/gpu-notes.md) it spent 1.18 ms of host
# time per call, 4.5 s of a 7.4 s trace, for 32 ms of GPU work. FlashAttention takes the
# causal prefills, the memory-efficient kernel the masked decode groups.
SERVING_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         SDPBackend.MATH]


def serving_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """The context one serving forward runs in: on CUDA, SDPA limited to
    :data:`SERVING_SDPA_BACKENDS`; elsewhere nothing changes."""
    return sdpa_kernel(SERVING_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def pad_groups(
    lengths: Sequence[int], min_size: int = 8, max_waste: float = 0.3
) -> list[list[int]]:
    """Split items into groups padded to their longest member (indices, longest first).

    Items are sorted by length; a group is closed once it has ``min_size`` members and
    adding the next item would pad more than ``max_waste`` of the group's slots. Few
    groups keep the per-group kernel count low; the waste cap bounds padded work.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    width = total = 0
    for i in order:
        n = lengths[i]
        slots = width * (len(cur) + 1)
        if cur and len(cur) >= min_size and slots - (total + n) > max_waste * slots:
            groups.append(cur)
            cur, total = [], 0
        if not cur:
            width = n
        cur.append(i)
        total += n
    if cur:
        groups.append(cur)
    return groups


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on ``dev``: on CUDA from pinned memory without blocking the host
    (the copy is ordered on the current stream before the kernels that read it)."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


@dataclass
class DecodeGroup:
    """Decode sequences attended together: keys gathered block-wise, padded to ``width`` blocks."""

    rows: torch.Tensor  # [G] packed row of each sequence's query
    blocks: torch.Tensor  # [G * width] block ids (padding: block 0, masked)
    bias: torch.Tensor  # [G, width * block_size] 0 for valid keys, -inf for padding
    width: int


@dataclass
class PrefillGroup:
    """Fresh prefills (no cached prefix) attended together, padded to ``length`` tokens."""

    gather: torch.Tensor  # [G * length] packed rows (padding: row 0)
    valid: torch.Tensor  # [n valid] positions in the padded [G * length] layout
    rows: torch.Tensor  # [n valid] packed rows they map to
    length: int


@dataclass
class PagedBatch:
    """Metadata of one packed serving batch (all tensors on the model's device).

    Tokens of every sequence are concatenated: sequence ``i`` contributes
    ``query_lens[i]`` new tokens at positions ``context_lens[i] - query_lens[i] ...
    context_lens[i] - 1``. ``slot_mapping[t]`` is the KV slot (``block * block_size +
    offset``) where token ``t``'s key/value is written; ``block_tables[i]`` lists the
    blocks of sequence ``i`` in order.

    :meth:`prepare` builds, once per batch, the index tensors every layer reuses: decode
    sequences in padded groups that gather whole KV blocks (no per-sequence loop),
    fresh prefills in padded causal groups, and only chunked prefills after a cached
    prefix one at a time.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    chunked: list[int] = field(default_factory=list)  # sequences with a cached prefix
    starts: list[int] = field(default_factory=list)  # packed row of each sequence's first token
    _rope: dict[str, Any] = field(default_factory=dict)

    def prepare(self, rotary: Rotary) -> None:
        """Precompute RoPE tables and attention groups (shared by all layers)."""
        if self._rope:
            return
        dev = self.positions.device
        if rotary.dynamic:  # dynamic NTK: each sequence's length decides its frequencies
            cs, ss, off = [], [], 0
            for q, c in zip(self.query_lens, self.context_lens, strict=True):
                co, si = rotary.cos_sin(self.positions[off : off + q], seq_len=c)
                cs.append(co)
                ss.append(si)
                off += q
            self._rope["cos"], self._rope["sin"] = torch.cat(cs), torch.cat(ss)
        else:
            self._rope["cos"], self._rope["sin"] = rotary.cos_sin(self.positions)
        starts, off = [], 0
        for q in self.query_lens:
            starts.append(off)
            off += q
        self.starts = starts
        dec, fresh, self.chunked = [], [], []
        for i, (q, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            (dec if q == 1 and c > 1 else fresh if q == c else self.chunked).append(i)
        bs = self.block_size
        nblk = [-(-self.context_lens[i] // bs) for i in dec]
        for g in pad_groups(nblk):
            seqs = [dec[j] for j in g]
            width = nblk[g[0]]
            blocks = []
            for i in seqs:
                bt = self.block_tables[i][:width]
                blocks.extend(bt)
                blocks.extend([0] * (width - len(bt)))
            ctx = torch.tensor([self.context_lens[i] for i in seqs])
            bias = torch.zeros(len(seqs), width * bs)
            bias.masked_fill_(torch.arange(width * bs)[None, :] >= ctx[:, None], float("-inf"))
            self.decode_groups.append(
                DecodeGroup(
                    _to_device(torch.tensor([starts[i] for i in seqs]), dev),
                    _to_device(torch.tensor(blocks), dev),
                    _to_device(bias, dev),
                    width,
                )
            )
        lens = [self.query_lens[i] for i in fresh]
        for g in pad_groups(lens):
            seqs = [fresh[j] for j in g]
            length = lens[g[0]]
            gather, valid, rows = [], [], []
            for r, i in enumerate(seqs):
                n, s0 = self.query_lens[i], starts[i]
                gather.extend(range(s0, s0 + n))
                gather.extend([0] * (length - n))
                valid.extend(range(r * length, r * length + n))
                rows.extend(range(s0, s0 + n))
            self.prefill_groups.append(
                PrefillGroup(
                    _to_device(torch.tensor(gather), dev),
                    _to_device(torch.tensor(valid), dev),
                    _to_device(torch.tensor(rows), dev),
                    length,
                )
            )

    def seq_slots(self, i: int) -> torch.Tensor:
        """KV slots of positions ``0 .. context_lens[i]-1`` of sequence ``i``."""
        n, bs = self.context_lens[i], self.block_size
        pos = torch.arange(n, device=self.positions.device)
        bt = torch.tensor(self.block_tables[i], dtype=torch.int64, device=pos.device)
        return bt[pos // bs] * bs + pos % bs


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PagedBatch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One layer's attention over a packed batch and its paged cache.

    q [T, nq, hd], k / v [T, nkv, hd] (RoPE applied) are this batch's new tokens; their
    keys/values are first written into k_cache / v_cache [num_slots, nkv, hd] at
    ``batch.slot_mapping``. Returns the attention output [T, nq, hd] in ``q.dtype``: on
    GPU and in bf16/fp16 every attention is a fused SDPA kernel over the gathered KV
    blocks, whose scores and softmax accumulate in float32 (float32 on CPU keeps the
    explicit matmul-softmax reference path).
    """
    t, nq, hd = q.shape
    nkv = k.shape[1]
    rep = nq // nkv
    dtype, dev = q.dtype, q.device
    k_cache.index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, batch.slot_mapping, v.to(v_cache.dtype))
    out = torch.empty(t, nq, hd, dtype=dtype, device=dev)
    bs = batch.block_size
    kb = k_cache.view(-1, bs, nkv, hd)
    vb = v_cache.view(-1, bs, nkv, hd)
    for g in batch.decode_groups:  # one query per sequence: [G, nkv, rep, hd]
        n, length = g.rows.numel(), g.width * bs
        qd = q.index_select(0, g.rows).view(n, nkv, rep, hd)
        kd = kb.index_select(0, g.blocks).view(n, length, nkv, hd).to(dtype)
        vd = vb.index_select(0, g.blocks).view(n, length, nkv, hd).to(dtype)
        if dtype == torch.float32 and dev.type == "cpu":  # exact reference path
            s = torch.matmul(qd, kd.permute(0, 2, 3, 1)) * scale  # [G, nkv, rep, L]
            p = torch.softmax(s + g.bias[:, None, None, :], dim=-1)
            od = torch.matmul(p, vd.transpose(1, 2))  # [G, nkv, rep, hd]
        else:  # fused kernel (GPU, reduced precision): float32 scores and softmax
            od = F.scaled_dot_product_attention(
                qd,
                kd.transpose(1, 2),
                vd.transpose(1, 2),
                attn_mask=g.bias.to(dtype)[:, None, None, :],
                scale=scale,
            )
        out.index_copy_(0, g.rows, od.reshape(n, nq, hd))
    for g in batch.prefill_groups:  # fresh prompts: causal over their own tokens
        n, ln = g.gather.numel() // g.length, g.length
        qp = q.index_select(0, g.gather).view(n, ln, nq, hd).transpose(1, 2)
        kp = k.index_select(0, g.gather).view(n, ln, nkv, hd).transpose(1, 2)
        vp = v.index_select(0, g.gather).view(n, ln, nkv, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qp, kp, vp, is_causal=True, scale=scale, enable_gqa=rep > 1
        )
        o = o.transpose(1, 2).reshape(n * ln, nq, hd).index_select(0, g.valid)
        out.index_copy_(0, g.rows, o)
    for i in batch.chunked:  # chunk after a cached prefix: query j sees keys <= n - ql + j
        ql, s0, n = batch.query_lens[i], batch.starts[i], batch.context_lens[i]
        slots = batch.seq_slots(i)
        ks = k_cache[slots].to(dtype).transpose(0, 1)[None]  # [1, nkv, n, hd]
        vs = v_cache[slots].to(dtype).transpose(0, 1)[None]
        qs = q[s0 : s0 + ql].transpose(0, 1)[None]  # [1, nq, ql, hd]
        qpos = torch.arange(n - ql, n, device=dev)[:, None]
        kpos = torch.arange(n, device=dev)[None, :]
        mask = (kpos <= qpos)[None, None]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=rep > 1
        )
        out[s0 : s0 + ql] = o[0].transpose(0, 1)
    return out
