"""Pipeline stages: each owns a contiguous slice of layers and the K/V blocks of them.

:class:`StageRunner` runs one micro-batch through its layers (and, on the last stage,
the LM head and sampling). :func:`stage_main` is a stage *process*: it joins a
``torch.distributed`` group (gloo on CPU, NCCL on GPU), receives batch metadata from the
engine through a queue, receives activations point to point from the previous stage,
and sends its output to the next stage (or sampled tokens back to the engine). The
messages are the records of :mod:`convergent.serve.messages`; the layer split is
training's too (:func:`convergent.models.layersplit.split_layers`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from convergent.models.layersplit import split_layers, stage_layers
from convergent.serve.config import EngineConfig
from convergent.serve.messages import (
    BatchMeta,
    BatchResult,
    Heartbeat,
    RendezvousPort,
    Sampled,
    StageBusy,
    StageError,
    StageReady,
    StopStage,
)

if TYPE_CHECKING:
    import torch

    from convergent.serve.engine_async import PendingSampled

__all__ = ["StageRunner", "StageSpec", "split_layers", "stage_main"]

PROMPT_LOGPROB_CHUNK = 256  # prompt rows per LM-head call when scoring a prompt


@dataclass
class StageSpec:
    """How to build one stage: stage ``stage`` of ``num_stages`` of the checkpoint at
    ``model_dir``, with ``num_blocks`` KV blocks, run as ``serve.engine`` says (dtype,
    INT8, device: on CUDA stage s uses cuda:s, one GPU per stage; torch threads)."""

    model_dir: str
    stage: int
    num_stages: int
    num_blocks: int
    engine: EngineConfig = field(default_factory=EngineConfig)
    step_capacity: int = 1 << 15  # int64 elements of a step's metadata buffers (they grow)
    max_num_seqs: int = 256  # serve.scheduler.max_num_seqs: the decode graphs' largest bucket
    max_batched_tokens: int = 1024  # serve.scheduler.max_batched_tokens: the mixed graphs' largest


class StageRunner:
    """One stage's model slice and KV cache; :meth:`run` processes one micro-batch."""

    def __init__(self, spec: StageSpec) -> None:
        import torch

        from convergent.models.llama import read_config
        from convergent.serve.kv_cache import KVCache

        self.spec = spec
        self.torch = torch
        eng = spec.engine
        self.dtype = getattr(torch, eng.dtype)
        cfg = read_config(spec.model_dir)
        self.config = cfg
        self.layers = stage_layers(cfg.num_hidden_layers, spec.stage, spec.num_stages)
        self.first = spec.stage == 0
        self.last = spec.stage == spec.num_stages - 1
        if eng.device.startswith("cuda"):
            from convergent.cluster.placement import check_serve_stages

            # stage s on cuda:s (within CUDA_VISIBLE_DEVICES); never two stages on one GPU
            check_serve_stages("cuda", spec.num_stages, torch.cuda.device_count())
            self.device = torch.device("cuda", spec.stage)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        from convergent.compress.qcheckpoint import load_llama

        self.model = load_llama(
            spec.model_dir, self.layers, self.first, self.last, self.dtype, eng.quantize
        ).to(self.device)
        self.model.model.rotary.to(self.device)
        if self.device.type == "cpu":  # fused QKV / gate-up, weights prepacked for oneDNN,
            from convergent.models.paged_linear import fuse_for_serving

            # each weight held once (with compile=decode also plain: the compiled decode
            # step folds those into its own packed constants)
            fuse_for_serving(self.model, release=True, keep_plain=eng.compile != "off")
        from convergent.models.paged_decode import resolve_backend
        from convergent.models.paged_meta import StepBuffers

        # decode attention (serve.engine.attention_backend) and the step's metadata buffers:
        # numpy into pinned host memory, one copy to the device per micro-batch
        self.backend = resolve_backend(eng.attention_backend, self.device)
        self.buffers = StepBuffers(self.device, capacity=spec.step_capacity)
        from convergent.serve.graphs import (
            build_compiled,
            build_graphs,
            build_mixed_graphs,
            graph_mode,
        )

        # serve.engine.cuda_graphs: the decode graphs' padding rows write one spare block
        mode = graph_mode(eng, self.device, self.backend, self.model.model.rotary.dynamic)
        self.kv = KVCache(
            len(self.layers),
            spec.num_blocks + (mode != "off" or eng.compile != "off"),
            eng.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        with torch.inference_mode():
            self.graphs = build_graphs(
                self.model, self.kv.layers, cfg, eng, mode=mode, num_blocks=spec.num_blocks,
                max_num_seqs=spec.max_num_seqs, backend=self.backend, first=self.first,
                last=self.last, dtype=self.dtype, device=self.device)
            self.mixed = build_mixed_graphs(
                self.model, self.kv.layers, eng, mode=mode, max_tokens=spec.max_batched_tokens,
                first=self.first, dtype=self.dtype, device=self.device)
            self.compiled = build_compiled(self.model, self.kv.layers, eng, first=self.first,
                                           last=self.last, scratch_block=spec.num_blocks)

    def run(self, meta: BatchMeta, x: torch.Tensor | None = None,
            defer: bool = False) -> torch.Tensor | Sampled | PendingSampled:
        """Stage 0 takes ``meta.input_ids``; others the previous stage's hidden ``x``.

        Returns the hidden states (``[T, hidden]``) or, on the last stage, the
        :class:`~convergent.serve.messages.Sampled` tokens (and logprobs where asked);
        with ``defer`` a step without logprobs returns a
        :class:`~convergent.serve.engine_async.PendingSampled` instead (the tokens'
        copy to the host started, not waited for). A pure decode step goes through the
        decode graphs where the stage has them (:mod:`convergent.serve.graphs`).
        """
        torch = self.torch
        from convergent.models.llama import PagedBatch

        with torch.inference_mode():
            g = self.graphs
            if g is not None and not meta.prompt_rows and g.fits(
                    meta.query_lens, meta.context_lens, meta.sample_rows):
                out = g.run(meta.input_ids if self.first else x, meta.positions, meta.slots,
                            meta.context_lens, meta.block_tables)
                return self._sample(meta, out, defer) if self.last else out
            # every index list of the step in one upload: ids (stage 0), the sampled and
            # the prompt-logprob rows (last stage) beside the attention's metadata
            batch = PagedBatch.build(
                self.buffers,
                meta.positions,
                meta.slots,
                meta.query_lens,
                meta.context_lens,
                meta.block_tables,
                self.spec.engine.block_size,
                backend=self.backend,
                extras=[meta.input_ids if self.first else (),
                        meta.sample_rows if self.last else (),
                        meta.prompt_rows if self.last else ()],
            )
            ids, sample_rows, prompt_rows = batch.extras
            if self.first:
                x = ids
            c, m = self.compiled, self.mixed
            if c is not None and c.fits(batch) and (
                    not self.last or list(meta.sample_rows) == list(range(len(meta.sample_rows)))):
                out = c.run(x, batch)  # hidden states, or the logits of every row
                return self._sample(meta, out, defer) if self.last else out
            if m is not None and m.fits(len(meta.positions)):
                h = m.run(x, batch)
                if not self.last:  # a static buffer: the next step overwrites it
                    h = h.clone()
            else:
                h = self.model.model.forward_paged(x, batch, self.kv.layers)
            if not self.last:
                return h
            logits = (self.model.logits(h.index_select(0, sample_rows)).float()
                      if meta.sample_rows else None)
            out = self._sample(meta, logits, defer)
            if meta.prompt_rows:
                self._prompt_logprobs(meta, h, prompt_rows, out)
            return out

    def _sample(self, meta: BatchMeta, logits: torch.Tensor | None,
                defer: bool) -> Sampled | PendingSampled:
        """The sampler on the device over the sampled rows' ``logits`` (fp32); logprobs
        where asked. ``defer`` (and no logprobs): the tokens' copy is started, not
        waited for (:class:`~convergent.serve.engine_async.PendingSampled`)."""
        from convergent.serve.engine_async import PendingSampled
        from convergent.serve.sampling import row_logprobs, sample_device

        out = Sampled()
        if logits is None:
            return out
        toks_dev = sample_device(logits, meta.sampling)
        rids = meta.sample_rids
        if defer and not meta.prompt_rows and all(k < 0 for k in meta.sampling.logprobs):
            return PendingSampled.start(out, rids, toks_dev)
        toks = toks_dev.tolist()  # the step's one device-to-host wait
        lps = row_logprobs(logits, toks, meta.sampling)
        out.tokens = dict(zip(rids, toks, strict=True))
        out.logprobs = {r: x for r, x in zip(rids, lps, strict=True) if x is not None}
        return out

    def _prompt_logprobs(
        self, meta: BatchMeta, h: torch.Tensor, prompt_rows: torch.Tensor, out: Sampled
    ) -> None:
        """The logprobs of the prompt tokens ``meta.prompt_targets`` from the logits of the
        rows before them (in chunks of rows: the logits are rows x vocabulary)."""
        from convergent.serve.sampling import prompt_logprobs

        for a in range(0, len(meta.prompt_rows), PROMPT_LOGPROB_CHUNK):
            b = a + PROMPT_LOGPROB_CHUNK
            logits = self.model.logits(h.index_select(0, prompt_rows[a:b])).float()
            lps = prompt_logprobs(logits, meta.prompt_targets[a:b], meta.prompt_ks[a:b])
            for rid, e in zip(meta.prompt_rids[a:b], lps, strict=True):
                out.prompt_logprobs.setdefault(rid, []).append(e)


def _next_meta(in_q, parent: int, poll_s: float = 1.0) -> BatchMeta | None:
    """The engine's next micro-batch; ``None`` on :class:`StopStage` and when the engine
    process is gone (killed by a signal: its daemon stages would otherwise wait forever)."""
    while True:
        try:
            msg = in_q.get(timeout=poll_s)
        except queue.Empty:
            if os.getppid() != parent:
                return None
            continue
        return None if isinstance(msg, StopStage) else msg


def _start_heartbeat(out_q, stage: int, interval: float) -> None:
    import threading

    def beat():
        while True:
            out_q.put(Heartbeat(stage))
            time.sleep(interval)

    threading.Thread(target=beat, name="stage-heartbeat", daemon=True).start()


def _join_pipeline(dist, spec: StageSpec, in_q, out_q, backend: str, timeout_s: float) -> None:
    """The process group of the pipeline's stages. Stage 0 hosts the rendezvous store on a
    port the kernel picks (no pick-then-bind race with other processes) and reports it;
    the engine forwards it to the other stages as their first message."""
    from datetime import timedelta

    timeout = timedelta(seconds=timeout_s)
    p = spec.num_stages
    if spec.stage == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, p, is_master=True, timeout=timeout, wait_for_workers=False
        )
        out_q.put(RendezvousPort(store.port))
    else:
        port: RendezvousPort = in_q.get(timeout=timeout_s)
        store = dist.TCPStore("127.0.0.1", port.port, p, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=spec.stage, world_size=p, timeout=timeout)


def stage_main(
    spec: StageSpec, in_q, out_q, hb_interval: float = 1.0, rdzv_timeout_s: float = 120.0
) -> None:
    """Entry point of a stage process (``multiprocessing`` spawn target).

    Sends to ``out_q`` (:mod:`convergent.serve.messages`): :class:`RendezvousPort` (stage
    0), :class:`StageReady`, then per micro-batch :class:`StageBusy` (or, on the last
    stage, :class:`BatchResult`), a :class:`StageError` when it fails and, every
    ``hb_interval`` seconds from a side thread, a :class:`Heartbeat` (the engine's
    liveness check).
    """
    try:
        import torch

        torch.set_num_threads(max(1, spec.engine.torch_threads))
        parent = os.getppid()
        runner = StageRunner(spec)
        if spec.num_stages > 1:
            import torch.distributed as dist

            backend = "nccl" if runner.device.type == "cuda" else "gloo"
            _join_pipeline(dist, spec, in_q, out_q, backend, rdzv_timeout_s)
        out_q.put(StageReady(spec.stage, runner.kv.nbytes))
        _start_heartbeat(out_q, spec.stage, hb_interval)
        _serve_batches(runner, in_q, out_q, parent)
    except Exception:  # report instead of hanging the engine
        out_q.put(StageError(spec.stage, traceback.format_exc()))


def _serve_batches(runner: StageRunner, in_q, out_q, parent: int) -> None:
    """Run micro-batches until the engine says stop: receive activations (the next
    receive posted before computing this one), compute, send on or report."""
    import torch
    import torch.distributed as dist

    stage, p = runner.spec.stage, runner.spec.num_stages
    hidden = runner.config.hidden_size
    pending: deque = deque()

    def post_recv(meta: BatchMeta):
        """Post the receive of ``meta``'s activations (later stages); returns
        ``(meta, tensor, work)``."""
        if runner.first:
            return meta, None, None
        x = torch.empty(meta.num_tokens, hidden, dtype=runner.dtype, device=runner.device)
        return meta, x, dist.irecv(x, src=stage - 1)

    nxt = None  # the next micro-batch, its receive already posted
    stop = False  # the engine's stop message was read ahead
    while True:
        if nxt is None:
            meta = None if stop else _next_meta(in_q, parent)
            if meta is None:
                break
            nxt = post_recv(meta)
        meta, x, work = nxt
        nxt = None
        if work is not None:
            work.wait()
        if not runner.first:
            # post the next receive before computing: the transfer overlaps this
            # micro-batch instead of starting after it (stage turnaround)
            with contextlib.suppress(queue.Empty):
                ahead = in_q.get_nowait()
                if isinstance(ahead, StopStage):
                    stop = True
                else:
                    nxt = post_recv(ahead)
        t0 = time.monotonic()
        out = runner.run(meta, x)
        t1 = time.monotonic()
        if runner.last:
            out_q.put(BatchResult(meta.bid, out, t0, t1))
        else:
            out = out.contiguous()
            pending.append((dist.isend(out, dst=stage + 1), out))
            while len(pending) > 8:
                pending.popleft()[0].wait()
            out_q.put(StageBusy(stage, meta.bid, t0, t1))
    while pending:
        pending.popleft()[0].wait()
    if p > 1:
        dist.destroy_process_group()
