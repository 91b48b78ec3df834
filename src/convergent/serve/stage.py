"""Pipeline stages: each owns a contiguous slice of layers and the K/V blocks of them.

:class:`StageRunner` runs one micro-batch through its layers (and, on the last stage,
the LM head and sampling). :func:`stage_main` is a stage *process*: it joins a
``torch.distributed`` group (gloo on CPU, NCCL on GPU), receives batch metadata from the
engine through a queue, receives activations point to point from the previous stage,
and sends its output to the next stage (or sampled tokens back to the engine).
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

__all__ = ["BatchMeta", "StageRunner", "split_layers", "stage_main", "StageSpec"]


def split_layers(n_layers: int, stages: int) -> list[list[int]]:
    """Contiguous, near-equal layer slices (earlier stages take the remainder)."""
    if stages < 1 or stages > n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {stages} stages")
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


@dataclass
class BatchMeta:
    """What the engine sends every stage for one micro-batch (plain lists: cheap to pickle)."""

    bid: int
    input_ids: list[int]  # packed new tokens (used by stage 0)
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # packed row of the last token of each sampled item
    sample_rids: list[int]
    temperatures: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)  # per sampled row (request seed + position)
    top_ks: list[int] = field(default_factory=list)  # per sampled row; <= 0: off
    top_ps: list[float] = field(default_factory=list)  # per sampled row; 1.0: off
    logprobs: list[int] = field(default_factory=list)  # per sampled row; -1: none

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass
class StageSpec:
    """How to build one stage."""

    model_dir: str
    stage: int
    num_stages: int
    num_blocks: int
    block_size: int
    dtype: str = "float32"
    threads: int = 1
    device: str = "cpu"  # "cpu" or "cuda" (stage s uses cuda:s; one GPU per stage)
    quantize: str = "none"  # serve.quantize (convergent.compress)


class StageRunner:
    """One stage's model slice and KV cache; :meth:`run` processes one micro-batch."""

    def __init__(self, spec: StageSpec) -> None:
        import torch

        from convergent.models.llama import read_config
        from convergent.serve.kv_cache import KVCache

        self.spec = spec
        self.torch = torch
        self.last_logprobs: dict[int, tuple] = {}  # rid -> (logprob, top) of the last run
        self.dtype = getattr(torch, spec.dtype)
        cfg = read_config(spec.model_dir)
        self.config = cfg
        self.layers = split_layers(cfg.num_hidden_layers, spec.num_stages)[spec.stage]
        self.first = spec.stage == 0
        self.last = spec.stage == spec.num_stages - 1
        if spec.device.startswith("cuda"):
            from convergent.placement import check_serve_stages

            # stage s on cuda:s (within CUDA_VISIBLE_DEVICES); never two stages on one GPU
            check_serve_stages("cuda", spec.num_stages, torch.cuda.device_count())
            self.device = torch.device("cuda", spec.stage)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        from convergent.compress.qcheckpoint import load_llama

        self.model = load_llama(
            spec.model_dir, self.layers, self.first, self.last, self.dtype, spec.quantize
        ).to(self.device)
        self.model.model.rotary.to(self.device)
        self.kv = KVCache(
            len(self.layers),
            spec.num_blocks,
            spec.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )

    def run(self, meta: BatchMeta, x=None):
        """Stage 0 takes ``meta.input_ids``; others the previous stage's hidden ``x``.

        Returns the hidden states (``[T, hidden]``) or, on the last stage, a dict
        ``rid -> sampled token``.
        """
        torch = self.torch
        from convergent.models.llama import PagedBatch
        from convergent.serve.sampling import RowParams, sample_rows

        with torch.inference_mode():
            if self.first:
                x = self._ids(meta.input_ids)
            batch = PagedBatch(
                self._ids(meta.positions),
                self._ids(meta.slots),
                meta.query_lens,
                meta.context_lens,
                meta.block_tables,
                self.spec.block_size,
            )
            h = self.model.model.forward_paged(x, batch, self.kv.layers)
            if not self.last:
                return h
            rows = self._ids(meta.sample_rows)
            logits = self.model.logits(h.index_select(0, rows)).float()
            toks, info = sample_rows(
                logits,
                RowParams(meta.temperatures, meta.seeds, meta.top_ks, meta.top_ps, meta.logprobs),
            )
            # logprob info (where asked) is kept beside the tokens for the caller
            out = dict(zip(meta.sample_rids, toks, strict=True))
            self.last_logprobs = {
                r: x for r, x in zip(meta.sample_rids, info, strict=True) if x is not None
            }
            return out

    def _ids(self, values: list[int]):
        """int64 index tensor on this stage's device (CUDA: pinned, non-blocking copy)."""
        t = self.torch.tensor(values, dtype=self.torch.int64)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)


def _next_meta(in_q, parent: int, poll_s: float = 1.0):
    """The engine's next message; ``None`` (stop) also when the engine process is gone
    (killed by a signal: its daemon stages would otherwise wait forever)."""
    while True:
        try:
            return in_q.get(timeout=poll_s)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _start_heartbeat(out_q, stage: int, interval: float) -> None:
    import threading

    def beat():
        while True:
            out_q.put(("hb", stage))
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
        out_q.put(("port", store.port))
    else:
        port = in_q.get(timeout=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, p, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=spec.stage, world_size=p, timeout=timeout)


def stage_main(
    spec: StageSpec, in_q, out_q, hb_interval: float = 1.0, rdzv_timeout_s: float = 120.0
) -> None:
    """Entry point of a stage process (``multiprocessing`` spawn target).

    Messages to ``out_q``: ``("port", port)`` (stage 0's rendezvous store), ``("ready",
    stage, kv_bytes)``, ``("busy", stage, bid, t0, t1)``,
    ``("result", bid, {rid: token}, t0, t1, {rid: logprob info})``, ``("error", stage,
    traceback)`` and, every ``hb_interval`` seconds from a side thread, ``("hb", stage)``
    (the engine's liveness check).
    """
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, spec.threads))
        parent = os.getppid()
        runner = StageRunner(spec)
        p = spec.num_stages
        device_gpu = runner.device.type == "cuda"
        if p > 1:
            backend = "nccl" if device_gpu else "gloo"
            _join_pipeline(dist, spec, in_q, out_q, backend, rdzv_timeout_s)
        out_q.put(("ready", spec.stage, runner.kv.nbytes))
        _start_heartbeat(out_q, spec.stage, hb_interval)
        hidden = runner.config.hidden_size
        pending: deque = deque()

        def post_recv(meta):
            """Post the receive of ``meta``'s activations (later stages); returns
            ``(meta, tensor, work)``."""
            if runner.first:
                return meta, None, None
            x = torch.empty(meta.num_tokens, hidden, dtype=runner.dtype, device=runner.device)
            return meta, x, dist.irecv(x, src=spec.stage - 1)

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
                    if ahead is None:
                        stop = True
                    else:
                        nxt = post_recv(ahead)
            t0 = time.monotonic()
            out = runner.run(meta, x)
            t1 = time.monotonic()
            if runner.last:
                out_q.put(("result", meta.bid, out, t0, t1, runner.last_logprobs))
            else:
                out = out.contiguous()
                pending.append((dist.isend(out, dst=spec.stage + 1), out))
                while len(pending) > 8:
                    pending.popleft()[0].wait()
                out_q.put(("busy", spec.stage, meta.bid, t0, t1))
        while pending:
            pending.popleft()[0].wait()
        if p > 1:
            dist.destroy_process_group()
    except Exception:  # report instead of hanging the engine
        out_q.put(("error", spec.stage, traceback.format_exc()))
