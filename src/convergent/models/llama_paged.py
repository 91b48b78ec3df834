"""The paged-KV serving path of the Llama decoder: packed-batch metadata and attention.

:class:`PagedBatch` describes one packed serving batch (tokens of many sequences
concatenated, their keys/values in a paged cache). :meth:`PagedBatch.build` makes one
from a step's host lists through preallocated buffers (:mod:`convergent.models.paged_meta`:
numpy into pinned memory, one copy per step); :meth:`PagedBatch.prepare` builds once per
batch the RoPE tables (and, for a batch made directly from tensors, the attention groups)
every layer reuses, and :func:`paged_attention` is the attention of one layer over that
cache (called by :meth:`convergent.models.llama_model.Attention.forward_paged`). Decode
queries go to the batch's attention backend (:mod:`convergent.models.paged_decode`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from convergent.models.llama_rope import Rotary, signed_sin
from convergent.models.paged_decode import DecodeBatch, decode_flex
from convergent.models.paged_meta import StepBuffers, StepPlan, pad_groups, plan_step

__all__ = ["DecodeGroup", "PagedBatch", "PrefillGroup", "SERVING_SDPA_BACKENDS", "StepBuffers",
           "bmm_attention", "bmm_layout", "pad_groups", "paged_attention", "serving_attention",
           "write_kv"]

# SDPA backends of the serving forward on CUDA: not cuDNN's. Its attention builds and caches
# a graph per input shape, and a serving step's shapes change every step (context width,
# group sizes): profiled on an H100 (2026-11-27, docs/gpu-notes.md) it spent 1.18 ms of host
# time per call, 4.5 s of a 7.4 s trace, for 32 ms of GPU work. FlashAttention takes the
# causal prefills, the memory-efficient kernel the masked decode groups.
SERVING_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                         SDPBackend.MATH]


def decode_waste(device: torch.device) -> float:
    """How much padding a decode group may hold (:func:`~convergent.models.paged_meta.pad_groups`):
    on the CPU all decodes go in one group (a group is ~7 calls of fixed cost, more than its
    padded keys cost there); elsewhere 0.3."""
    return 1.0 if device.type == "cpu" else 0.3


def serving_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """The context one serving forward runs in: on CUDA, SDPA limited to
    :data:`SERVING_SDPA_BACKENDS`; elsewhere nothing changes."""
    return sdpa_kernel(SERVING_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class DecodeGroup:
    """Decode sequences attended together: keys gathered block-wise, padded to ``width`` blocks."""

    rows: torch.Tensor  # [G] packed row of each sequence's query
    blocks: torch.Tensor  # [G * width] block ids (padding: block 0, masked)
    bias: torch.Tensor  # [G, width * block_size] 0 for valid keys, -inf for padding
    width: int
    # the CPU float32 kernel's layout (:func:`_decode_bmm`), made by a forward's first layer
    # from blocks and bias (who refills those in place, as the static decode path does,
    # sets these back to None)
    kv_rows: torch.Tensor | None = None  # [G * nkv * L] rows of the [slots * nkv, hd] cache
    bias_bmm: torch.Tensor | None = None  # [G * nkv, rep, L]


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

    The attention's index tensors, shared by all layers: decode sequences in padded
    groups that gather whole KV blocks (``backend`` ``sdpa_gather``) or one
    :class:`~convergent.models.paged_decode.DecodeBatch` for the block-table kernels
    (``triton``, ``flex``), fresh prefills in padded causal groups, and only chunked
    prefills after a cached prefix one at a time. :meth:`build` plans them with numpy and
    uploads them with the step; :meth:`prepare` does the same for a batch made directly.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    backend: str = "sdpa_gather"  # decode attention: sdpa_gather | triton | flex
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    decode: DecodeBatch | None = None  # the decodes of the triton / flex backends
    chunked: list[int] = field(default_factory=list)  # sequences with a cached prefix
    starts: list[int] = field(default_factory=list)  # packed row of each sequence's first token
    chunk_slots: dict[int, torch.Tensor] = field(default_factory=dict)  # of chunked sequences
    extras: list[torch.Tensor] = field(default_factory=list)  # build()'s extra index lists
    max_waste: float | None = None  # decode groups' padding cap; None: decode_waste(device)
    _rope: dict[str, Any] = field(default_factory=dict)
    _planned: bool = False

    @classmethod
    def build(
        cls,
        buffers: StepBuffers,
        positions: Sequence[int],
        slots: Sequence[int],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        backend: str = "sdpa_gather",
        extras: Sequence[Sequence[int]] = (),
    ) -> PagedBatch:
        """A batch whose every index tensor (positions, slots, the attention groups and
        ``extras``, e.g. the input ids and the sampled rows, as :attr:`extras`) comes from
        one upload of ``buffers``: numpy into the (pinned) host buffer, one copy."""
        plan = plan_step(query_lens, context_lens, block_tables, block_size,
                         gather_decode=backend == "sdpa_gather",
                         decode_waste=decode_waste(buffers.device))
        views = buffers.upload([positions, slots, *extras, *plan.parts()])
        k = 2 + len(extras)
        b = cls(views[0], views[1], query_lens, context_lens, block_tables, block_size, backend,
                extras=views[2:k])
        b._apply(plan, views[k:])
        return b

    def _apply(self, plan: StepPlan, views: list[torch.Tensor]) -> None:
        """Turn a plan's uploaded arrays (``views``, in :meth:`StepPlan.parts` order) into
        the attention groups."""
        it = iter(views)
        dev = self.positions.device
        self.starts = plan.starts.tolist()
        self.chunked = plan.chunked
        bs = self.block_size
        for *_arrays, width in plan.decode_groups:
            rows, blocks, ctx = next(it), next(it), next(it)
            keys = torch.arange(width * bs, device=dev)
            bias = torch.zeros(rows.numel(), width * bs, device=dev)
            bias.masked_fill_(keys[None, :] >= ctx[:, None], float("-inf"))
            self.decode_groups.append(DecodeGroup(rows, blocks, bias, width))
        for *_parts, length in plan.prefill_groups:
            self.prefill_groups.append(PrefillGroup(next(it), next(it), next(it), length))
        for i in plan.chunked:
            self.chunk_slots[i] = next(it)
        if plan.decode_batch is not None:
            rows, tables, ctx = next(it), next(it), next(it)
            self.decode = DecodeBatch(rows, tables, ctx, tables.shape[1])
        self._planned = True

    def plan(self) -> None:
        """The attention groups, unless :meth:`build` made the batch (planned as there,
        copied once)."""
        if not self._planned:
            waste = self.max_waste
            plan = plan_step(self.query_lens, self.context_lens, self.block_tables,
                             self.block_size, gather_decode=self.backend == "sdpa_gather",
                             decode_waste=decode_waste(self.positions.device)
                             if waste is None else waste)
            parts = plan.parts()
            need = sum(p.size for p in parts)
            bufs = StepBuffers(self.positions.device, capacity=max(1, need), pinned=False)
            self._apply(plan, bufs.upload(parts))

    def prepare(self, rotary: Rotary) -> None:
        """Precompute RoPE tables (and :meth:`plan` the attention groups) shared by all
        layers (:meth:`rope`)."""
        if self._rope:
            return
        self.plan()
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
        self._rope["sin_signed"] = signed_sin(self._rope["sin"])

    def rope(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's RoPE tables in ``dtype`` (cast once per dtype, reused by every
        layer): cos and the signed sin of :func:`~convergent.models.llama_rope.apply_rope_signed`."""
        key = ("tables", dtype)
        if key not in self._rope:
            self._rope[key] = (self._rope["cos"].to(dtype), self._rope["sin_signed"].to(dtype))
        return self._rope[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """One layer's attention over this batch: :func:`paged_attention`."""
        return paged_attention(q, k, v, self, k_cache, v_cache, scale)

    def seq_slots(self, i: int) -> torch.Tensor:
        """KV slots of positions ``0 .. context_lens[i]-1`` of chunked sequence ``i``
        (planned with the step)."""
        return self.chunk_slots[i]


def _decode_in_place(q, k_cache, v_cache, out, batch: PagedBatch, scale: float) -> None:
    """The decode rows of ``out`` by the block-table backend of ``batch`` (no gathered copy)."""
    dec = batch.decode
    if batch.backend == "triton":
        from convergent.models.paged_triton import decode_triton

        decode_triton(q, k_cache, v_cache, out, dec.rows, dec.tables, dec.ctx, batch.block_size,
                      scale)
    elif batch.backend == "flex":
        out.index_copy_(0, dec.rows, decode_flex(q, k_cache, v_cache, dec, batch.block_size, scale))
    else:
        raise ValueError(f"attention backend {batch.backend!r} has no block-table decode")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """The new tokens' keys / values [T, nkv, hd] into the paged caches at ``slots`` [T]."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def bmm_layout(blocks: torch.Tensor, bias: torch.Tensor, width: int, block_size: int, nkv: int,
               rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout :func:`bmm_attention` reads for a decode group of ``n`` sequences (block
    ids ``blocks`` [n * width], key mask ``bias`` [n, width * block_size]): the row
    (slot * nkv + head) of the ``[slots * nkv, hd]`` cache for each (sequence, kv head,
    key), and the bias as [n * nkv, rep, keys]."""
    n, length = bias.shape
    dev = blocks.device
    slots = (blocks.view(n, width, 1) * block_size
             + torch.arange(block_size, device=dev)).view(n, 1, length)
    kv_rows = (slots * nkv + torch.arange(nkv, device=dev).view(1, nkv, 1)).view(-1)
    return kv_rows, bias.view(n, 1, 1, length).expand(n, nkv, rep, length).reshape(
        n * nkv, rep, length).contiguous()  # (one sequence and one kv head: a view)


def bmm_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  kv_rows: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention ``softmax(q k^T * scale + bias) v`` by batched GEMMs over
    (sequence, kv head): q [n, nq, hd] (one query per sequence), ``kv_rows`` / ``bias``
    from :func:`bmm_layout`; [n, nq, hd]. Each key/value row is gathered once, straight
    into the ``[n * nkv, keys, hd]`` layout the GEMMs read; scores and softmax in q's
    dtype (float32: the CPU kernel). On 2 cores at 20 sequences x 128 keys it takes about
    0.7x the time of the gather + SDPA path, whose fused kernel pays a parallel region per
    call for a few microseconds of work."""
    n, nq, hd = q.shape
    rows, rep, length = bias.shape
    k = k_cache.view(-1, hd).index_select(0, kv_rows).view(rows, length, hd)
    v = v_cache.view(-1, hd).index_select(0, kv_rows).view(rows, length, hd)
    s = torch.baddbmm(bias, q.reshape(rows, rep, hd), k.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(s, -1), v).view(n, nq, hd)


def _decode_bmm(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: DecodeGroup,
                block_size: int, scale: float) -> torch.Tensor:
    """A decode group's attention by :func:`bmm_attention` (the CPU float32 kernel); its
    layout is made once per step, by the first layer."""
    nkv = k_cache.shape[1]
    if g.kv_rows is None:
        g.kv_rows, g.bias_bmm = bmm_layout(g.blocks, g.bias, g.width, block_size, nkv,
                                           q.shape[1] // nkv)
    return bmm_attention(q.index_select(0, g.rows), k_cache, v_cache, g.kv_rows, g.bias_bmm,
                         scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PagedBatch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's attention over a packed batch and its paged cache.

    q [T, nq, hd], k / v [T, nkv, hd] (RoPE applied) are this batch's new tokens; their
    keys/values are first written into k_cache / v_cache [num_slots, nkv, hd] at
    ``batch.slot_mapping``. Returns the attention output [T, nq, hd] in ``q.dtype``.
    Decode queries: with ``batch.backend`` ``sdpa_gather``, a fused SDPA kernel over
    the gathered KV blocks of each padded group, whose scores and softmax accumulate in
    float32; ``triton`` / ``flex`` read the blocks in place through the block
    tables (:mod:`convergent.models.paged_decode`). Prefills always take SDPA.
    ``out``: where to write the result ([T, nq, hd], e.g. a static buffer of
    :mod:`convergent.models.paged_pieces`); a new tensor when ``None``.
    """
    t, nq, hd = q.shape
    nkv = k.shape[1]
    rep = nq // nkv
    dtype, dev = q.dtype, q.device
    write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    if out is None:
        out = torch.empty(t, nq, hd, dtype=dtype, device=dev)
    bs = batch.block_size
    kb = k_cache.view(-1, bs, nkv, hd)
    vb = v_cache.view(-1, bs, nkv, hd)
    if batch.decode is not None:
        _decode_in_place(q, k_cache, v_cache, out, batch, scale)
    bmm = dev.type == "cpu" and dtype == torch.float32 and k_cache.dtype == dtype
    for g in batch.decode_groups:  # one query per sequence: [G, nkv, rep, hd]
        if bmm:
            out.index_copy_(0, g.rows, _decode_bmm(q, k_cache, v_cache, g, bs, scale))
            continue
        n, length = g.rows.numel(), g.width * bs
        qd = q.index_select(0, g.rows).view(n, nkv, rep, hd)
        kd = kb.index_select(0, g.blocks).view(n, length, nkv, hd).to(dtype)
        vd = vb.index_select(0, g.blocks).view(n, length, nkv, hd).to(dtype)
        # one fused kernel, float32 scores and softmax (on the CPU in float32 too: half
        # the time of an explicit matmul-softmax, equal to it within float32 rounding)
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
