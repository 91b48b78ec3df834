"""Decode steps through static buffers padded to batch-size buckets, replayed as CUDA graphs.

A pure decode step (one new token per sequence, every sequence sampled) of ``n``
sequences runs as the smallest bucket ``b >= n`` of :func:`decode_buckets` (1, 2, 4, 8,
then every 16 up to the largest, as vLLM and nano-vllm capture them). Its inputs live in
static device buffers that every bucket views a prefix of: the token ids (or, after the
first pipeline stage, the hidden states), positions, KV slots, context lengths and the
block table ``[max_seqs, max_blocks]`` (one flat int64 buffer, filled with numpy on the
host and copied in one non-blocking copy from pinned memory). The ``b - n`` padding rows
are sequences of one token at position 0 whose key/value goes to a scratch KV block that
the block manager never hands out (:attr:`GraphShape.scratch_block`, one block past the
real ones), and whose attention reads only that block: a real block is never written
and the real rows compute exactly what they would alone (every op is row-wise but the
attention, which reads each row's own blocks).

:meth:`DecodeGraphs.capture` records one CUDA graph per bucket, largest first, all in one
memory pool, after a warm-up run on a side stream (Triton's JIT, cuBLAS's handles): the
forward (embedding, layers, norm and, on the last stage, the LM head in float32) from
the static buffers to a static output. A host synchronisation inside the forward would
make the capture fail, so a captured runner is itself the proof that a decode step has
none. Without capture (``capture=False``: the CPU, or ``serve.engine.cuda_graphs=on``
there) :meth:`DecodeGraphs.run` runs the very same padded static-buffer forward eagerly,
which is how the CPU tests check the padding against the eager path.

Decode attention in the graph: the ``triton`` backend's kernel over the static block
table (it loops over each row's own context on the device), or ``sdpa_gather`` as one
group padded to ``max_blocks`` blocks with its mask made on the device from the
context lengths (correct, but it gathers the widest context for every row: the graphs
are for ``triton``). ``flex`` and dynamic-NTK RoPE (its tables depend on each sequence's
length on the host) are not captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from convergent.models.llama_paged import DecodeGroup, PagedBatch
from convergent.models.paged_decode import DecodeBatch

__all__ = ["GRAPH_BACKENDS", "DecodeGraphs", "GraphShape", "decode_buckets"]

GRAPH_BACKENDS = ("triton", "sdpa_gather")  # decode attention the static path supports


def decode_buckets(max_seqs: int) -> list[int]:
    """Batch sizes captured for ``max_seqs`` sequences: 1, 2, 4, 8, 16, 32, 48, ... and
    ``max_seqs`` itself (every decode step pads to the smallest that holds it)."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs={max_seqs}: need at least 1")
    out = {b for b in (1, 2, 4, 8) if b <= max_seqs}
    out.update(range(16, max_seqs + 1, 16))
    out.add(max_seqs)
    return sorted(out)


@dataclass(frozen=True)
class GraphShape:
    """The static buffers' sizes: up to ``max_seqs`` sequences of up to ``max_blocks``
    KV blocks of ``block_size`` tokens; padding rows write block ``scratch_block``."""

    max_seqs: int
    max_blocks: int
    block_size: int
    scratch_block: int


class DecodeGraphs:
    """Static decode buffers of one stage's model slice, per bucket a static batch and
    (when captured) a CUDA graph; :meth:`run` fills, pads and runs or replays.

    ``model`` is a :class:`~convergent.models.llama_model.LlamaForCausalLM` (a stage's
    slice: ``first`` takes token ids, else hidden states; ``last`` ends in the LM head),
    ``kv`` its layers' ``(key, value)`` caches, each with ``scratch_block + 1`` blocks.
    """

    def __init__(self, model: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 shape: GraphShape, backend: str, *, first: bool, last: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        if backend not in GRAPH_BACKENDS:
            raise ValueError(f"decode graphs support {GRAPH_BACKENDS}, not {backend!r}")
        self.model, self.kv, self.shape, self.backend = model, kv, shape, backend
        self.first, self.last, self.device = first, last, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.buckets = decode_buckets(shape.max_seqs)
        n, w = shape.max_seqs, shape.max_blocks
        self._fields = 4 + w  # ids | positions | slots | ctx | tables [n, w]
        self._flat = torch.zeros(n * self._fields, dtype=torch.int64, device=self.device)
        self.static = self._views(self._flat)
        hidden = model.config.hidden_size
        self._hidden = None if first else torch.zeros(n, hidden, dtype=dtype, device=self.device)
        self._rows = torch.arange(n, device=self.device)
        self._keys = torch.arange(w * shape.block_size, device=self.device)
        turns = 2 if self.cuda else 1
        self._host = [torch.zeros(n * self._fields, dtype=torch.int64, pin_memory=self.cuda)
                      for _ in range(turns)]
        self._events = [torch.cuda.Event() for _ in range(turns)] if self.cuda else []
        self._turn = 0
        self._batches = {b: self._static_batch(b) for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._out: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps replayed from a captured graph
        self.static_runs = 0  # steps run through the static buffers without a graph
        self._fill(self._host[0].numpy(), [], [], [], [], [], 0, self.buckets[-1])
        self._flat.copy_(self._host[0])

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        n, w = self.shape.max_seqs, self.shape.max_blocks
        v = {"ids": flat[:n], "pos": flat[n:2 * n], "slots": flat[2 * n:3 * n],
             "ctx": flat[3 * n:4 * n], "tables": flat[4 * n:].view(n, w)}
        return v

    def _static_batch(self, b: int) -> PagedBatch:
        """The batch of bucket ``b``: views of the static buffers (planned: no host plan)."""
        s, bs = self.static, self.shape.block_size
        batch = PagedBatch(s["pos"][:b], s["slots"][:b], [1] * b, [2] * b, [], bs,
                           backend=self.backend)
        if self.backend == "triton":
            batch.decode = DecodeBatch(self._rows[:b], s["tables"][:b], s["ctx"][:b],
                                       self.shape.max_blocks)
        else:
            empty = torch.empty(0, device=self.device)
            batch.decode_groups = [DecodeGroup(self._rows[:b], s["tables"][:b].reshape(-1),
                                               empty, self.shape.max_blocks)]
        batch._planned = True
        return batch

    # -- which steps, which bucket
    def fits(self, query_lens: Sequence[int], context_lens: Sequence[int],
             sample_rows: Sequence[int]) -> bool:
        """Whether a step is a pure decode this runner holds: at most ``max_seqs``
        sequences, one new token each after a context (as the eager plan's decodes), the
        longest context within ``max_blocks`` blocks, every row sampled in order."""
        n = len(query_lens)
        if not 0 < n <= self.shape.max_seqs or any(q != 1 for q in query_lens):
            return False
        if min(context_lens) < 2 or max(context_lens) > self.shape.max_blocks * self.shape.block_size:
            return False
        return not self.last or list(sample_rows) == list(range(n))

    def bucket(self, n: int) -> int:
        """The smallest bucket holding ``n`` sequences."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} sequences exceed the largest bucket {self.buckets[-1]}")

    # -- filling the static buffers
    def _fill(self, host: np.ndarray, ids, positions, slots, context_lens, block_tables,
              n: int, b: int) -> None:
        """Write a step's ``n`` rows and ``b - n`` padding rows into the host image."""
        m, w = self.shape.max_seqs, self.shape.max_blocks
        scratch = self.shape.scratch_block
        cols = [host[i * m:(i + 1) * m] for i in range(4)]
        tables = host[4 * m:].reshape(m, w)
        for col, vals, pad in ((cols[0], ids, 0), (cols[1], positions, 0),
                               (cols[2], slots, scratch * self.shape.block_size),
                               (cols[3], context_lens, 1)):
            if n:
                col[:n] = vals if len(vals) else 0
            col[n:b] = pad
        tables[:b] = 0
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = t
        tables[n:b, 0] = scratch

    def _upload(self, *step, n: int, b: int) -> None:
        """Fill the next host image and copy it to the static buffers in one copy (on the
        CPU the image is the static buffer's own memory: no copy)."""
        i = self._turn
        self._turn = (i + 1) % len(self._host)
        if not self.cuda:
            self._fill(self._flat.numpy(), *step, n, b)
            return
        self._events[i].synchronize()  # the copy that last read this image has finished
        self._fill(self._host[i].numpy(), *step, n, b)
        self._flat.copy_(self._host[i], non_blocking=True)
        self._events[i].record()

    # -- running
    def _forward(self, b: int) -> torch.Tensor:
        """The padded forward of bucket ``b`` from the static buffers (what is captured)."""
        batch = self._batches[b]
        batch._rope.clear()
        if self.backend == "sdpa_gather":  # the padding mask, made on the device
            ctx = self.static["ctx"][:b]
            bias = torch.zeros(b, self._keys.numel(), device=self.device)
            g = batch.decode_groups[0]
            g.bias = bias.masked_fill_(self._keys[None, :] >= ctx[:, None], float("-inf"))
            g.kv_rows = g.bias_bmm = None  # the CPU kernel's layout of the last step's tables
        x = self.static["ids"][:b] if self.first else self._hidden[:b]
        h = self.model.model.forward_paged(x, batch, self.kv)
        return self.model.logits(h).float() if self.last else h

    def run(self, x: Sequence[int] | torch.Tensor, positions: Sequence[int],
            slots: Sequence[int], context_lens: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """One decode step of ``n = len(positions)`` sequences (``x``: their token ids on
        the first stage, else their hidden states ``[n, hidden]``): the logits ``[n, V]``
        (float32, last stage) or hidden states ``[n, hidden]``, a view of a static output
        that the next :meth:`run` overwrites."""
        n = len(positions)
        b = self.bucket(n)
        ids = x if self.first else ()
        self._upload(ids, positions, slots, context_lens, block_tables, n=n, b=b)
        if not self.first:
            self._hidden[:n].copy_(x)
        if b in self._graphs:
            self._graphs[b].replay()
            self.replays += 1
            return self._out[b][:n]
        self.static_runs += 1
        return self._forward(b)[:n]

    def capture(self) -> None:
        """Capture one CUDA graph per bucket (largest first, one shared memory pool) after
        a warm-up run on a side stream; the static buffers hold padding rows meanwhile."""
        if not self.cuda:
            raise ValueError("CUDA graphs need a CUDA device; on the CPU run() is eager")
        pool = None
        side = torch.cuda.Stream(self.device)
        for b in reversed(self.buckets):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                out = self._forward(b)
            pool = g.pool() if pool is None else pool
            self._graphs[b], self._out[b] = g, out
        torch.cuda.synchronize(self.device)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)
