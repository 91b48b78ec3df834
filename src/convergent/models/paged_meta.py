"""A serving step's metadata, planned with numpy and copied to the device once.

:class:`StepBuffers` holds preallocated int64 host buffers (pinned on CUDA, two of them
used in turn) and one device buffer. :func:`plan_step` turns a step's query lengths,
context lengths and block tables into the index arrays the attention needs (padded decode
groups, padded fresh-prefill groups, the slots of chunked prefills, the decode block
table of the block-table kernels), all numpy vector operations but for the grouping
itself (:func:`pad_groups`, a sort over sequences). :meth:`StepBuffers.upload` writes
every array of the step back to back into the next host buffer and issues one
non-blocking copy; the model reads device-side views of it.

No ``torch.tensor(list)`` and no ``pin_memory()`` per step: the pinned buffers are
allocated once (and again, twice as large, only when a step outgrows them). A host
buffer is written again only after the copy that read it has finished (a CUDA event per
buffer), so the host may run a step ahead of the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["StepBuffers", "StepPlan", "pad_groups", "plan_step"]

I64 = np.int64


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


@dataclass
class StepPlan:
    """A step's index arrays (numpy int64), in the order :meth:`parts` lists them."""

    starts: np.ndarray  # [n] packed row of each sequence's first token
    decode: list[int]  # sequences decoding one token after a context
    chunked: list[int]  # sequences prefilling a chunk after a cached prefix
    # per padded decode group: (rows [G], blocks [G * width], ctx [G]) and its width
    decode_groups: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = field(default_factory=list)
    # per padded fresh-prefill group: (gather [G * length], valid [k], rows [k]) and its length
    prefill_groups: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = field(default_factory=list)
    chunk_slots: list[np.ndarray] = field(default_factory=list)  # per chunked sequence
    # the block-table kernels' decode batch: rows [n], tables [n, width], ctx [n]
    decode_batch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def parts(self) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for rows, blocks, ctx, _w in self.decode_groups:
            out += [rows, blocks, ctx]
        for gather, valid, rows, _n in self.prefill_groups:
            out += [gather, valid, rows]
        out += self.chunk_slots
        if self.decode_batch is not None:
            out += list(self.decode_batch)
        return out


def _table_array(block_tables: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """The block tables as one zero-padded ``[n, width]`` array (one flat conversion)."""
    n = len(block_tables)
    lens = np.fromiter((len(t) for t in block_tables), I64, n)
    out = np.zeros((n, max(width, int(lens.max(initial=0)))), I64)
    if lens.sum():
        flat = np.fromiter((b for t in block_tables for b in t), I64, int(lens.sum()))
        out[np.arange(out.shape[1])[None, :] < lens[:, None]] = flat
    return out


def _prefill_group(seqs: np.ndarray, ql: np.ndarray, starts: np.ndarray, length: int):
    """gather / valid / rows of fresh prefills ``seqs`` padded to ``length`` tokens."""
    idx = np.arange(length, dtype=I64)
    pos = starts[seqs][:, None] + idx[None, :]  # [G, length] packed rows
    ok = idx[None, :] < ql[seqs][:, None]
    return np.where(ok, pos, 0).ravel(), np.flatnonzero(ok.ravel()).astype(I64), pos[ok]


def plan_step(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    gather_decode: bool = True,
    decode_waste: float = 0.3,
) -> StepPlan:
    """The index arrays of one packed step (see :class:`StepPlan`).

    Sequence ``i`` brings ``query_lens[i]`` new tokens and then holds ``context_lens[i]``;
    one new token after a context is a decode, a whole prompt a fresh prefill, the rest
    chunked prefills. ``gather_decode``: decodes in padded gather groups (today's SDPA
    path; ``decode_waste``: the padding a group may hold, see :func:`pad_groups`), else one
    decode batch for the block-table kernels.
    """
    ql = np.asarray(query_lens, I64)
    cl = np.asarray(context_lens, I64)
    n = ql.size
    starts = np.zeros(n, I64)
    np.cumsum(ql[:-1], out=starts[1:])
    is_dec = (ql == 1) & (cl > 1)
    is_fresh = ql == cl
    dec = np.flatnonzero(is_dec)
    nblk = -(-cl // block_size)
    bt = _table_array(block_tables, int(nblk.max(initial=0)))
    plan = StepPlan(starts, dec.tolist(), np.flatnonzero(~is_dec & ~is_fresh).tolist())
    if gather_decode:
        for g in pad_groups(nblk[dec].tolist(), max_waste=decode_waste):
            seqs = dec[g]
            width = int(nblk[seqs[0]])
            plan.decode_groups.append((starts[seqs], bt[seqs, :width].ravel(), cl[seqs], width))
    elif dec.size:
        width = int(nblk[dec].max())
        plan.decode_batch = (starts[dec], np.ascontiguousarray(bt[dec, :width]), cl[dec])
    fresh = np.flatnonzero(is_fresh)
    for g in pad_groups(ql[fresh].tolist()):
        seqs = fresh[g]
        length = int(ql[seqs[0]])
        plan.prefill_groups.append((*_prefill_group(seqs, ql, starts, length), length))
    for i in plan.chunked:
        pos = np.arange(cl[i], dtype=I64)
        plan.chunk_slots.append(bt[i, pos // block_size] * block_size + pos % block_size)
    return plan


class StepBuffers:
    """Preallocated int64 host buffers (pinned on CUDA, two in turn) and one device buffer
    of at least ``capacity`` elements; :meth:`upload` fills one and copies it once.

    On the CPU the views are of the host buffer itself (no copy); they are valid until
    the next :meth:`upload` (the stage runs one step at a time).
    """

    def __init__(self, device: torch.device | str, capacity: int = 1 << 14,
                 pinned: bool | None = None) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pinned = self.cuda if pinned is None else pinned
        self.uploads = 0
        self.grows = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        turns = 2 if self.cuda else 1
        self._host = [torch.empty(capacity, dtype=torch.int64, pin_memory=self.pinned)
                      for _ in range(turns)]
        self._np = [h.numpy() for h in self._host]
        self._dev = torch.empty(capacity, dtype=torch.int64, device=self.device) if self.cuda else None
        # one event per host buffer, recorded after the copy that reads it (an event never
        # recorded synchronizes at once)
        self._events = [torch.cuda.Event() for _ in range(turns)] if self.cuda else []
        self._turn = 0
        self.capacity = capacity

    def _grow(self, need: int) -> None:
        for ev in self._events:  # the old host buffers' copies must end before they go
            ev.synchronize()
        self.grows += 1
        self._alloc(max(need, 2 * self.capacity))

    def upload(self, parts: Sequence[Sequence[int] | np.ndarray]) -> list[torch.Tensor]:
        """Write ``parts`` (int sequences or int64 arrays, any shape) back to back into
        the next host buffer with numpy and copy the used prefix to the device in one
        non-blocking copy; returns one device view per part, in its shape."""
        arrays = [np.asarray(p, dtype=I64) for p in parts]
        total = sum(a.size for a in arrays)
        if total > self.capacity:
            self._grow(total)
        i = self._turn
        self._turn = (i + 1) % len(self._host)
        if self.cuda:
            self._events[i].synchronize()  # its previous copy has read it
        host = self._np[i]
        spans, off = [], 0
        for a in arrays:
            host[off:off + a.size] = a.ravel()
            spans.append((off, a.shape))
            off += a.size
        src = self._host[i]
        if self.cuda:
            self._dev[:total].copy_(self._host[i][:total], non_blocking=self.pinned)
            self._events[i].record()
            src = self._dev
        self.uploads += 1
        return [src[o:o + int(np.prod(shape, dtype=I64))].view(shape) for o, shape in spans]
