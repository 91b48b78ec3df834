"""Gradient compression for DDP as comm hooks, with byte counting and comm timing.

``parallel.compression``:

* ``none``     — plain all-reduce (``allreduce_hook``), fp32 payload;
* ``fp16``     — cast the bucket to fp16, all-reduce, cast back (2 bytes/element);
* ``powersgd`` — PyTorch's PowerSGD (rank ``powersgd_rank``, error feedback, warm start;
  plain all-reduce for the first ``powersgd_start_iter`` steps);
* ``topk``     — ours: top-k sparsification with error feedback. Each rank adds its
  residual (what it did not send before) to the bucket, sends the ``k = ratio * n``
  largest-magnitude entries as (value fp32, index int32) pairs with one all-gather,
  keeps the rest as the new residual, and every rank rebuilds the same dense average.
  Error feedback makes the dropped mass arrive later instead of never.

Every hook is wrapped by :func:`instrument`, which records, per step, the payload bytes
this rank put on the wire (``CommStats.bytes``) and when the last gradient bucket became
ready, from which the trainer measures *exposed* communication (time from the last
bucket being ready until ``backward()`` returns, i.e. the all-reduce not hidden behind
backward compute). The PowerSGD byte count follows its algorithm (P and Q factors of the
matrices it compresses, the rest uncompressed); it is an accounting, not a wire capture.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Per-step counters filled by the instrumented hook (reset by the trainer)."""

    bytes: int = 0
    buckets: int = 0
    last_ready: float | None = None
    total_bytes: int = 0

    def reset(self) -> None:
        self.bytes = 0
        self.buckets = 0
        self.last_ready = None


@dataclass
class TopKState:
    """State of the top-k hook: ratio, process group, residual per bucket index."""

    ratio: float
    process_group: Any = None
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)


def topk_hook(state, bucket):  # noqa: ANN001 - DDP checks annotations, keep none
    """DDP comm hook: top-k sparsified all-gather with error feedback (see module doc)."""
    group = state.process_group
    world = dist.get_world_size(group)
    grad = bucket.buffer()
    n = grad.numel()
    idx_key = bucket.index()
    res = state.residuals.get(idx_key)
    acc = grad.float() + res if res is not None and res.shape == grad.shape else grad.float()
    k = max(1, min(n, math.ceil(state.ratio * n)))
    top = acc.abs().topk(k, sorted=False).indices
    vals = acc[top]
    new_res = acc.clone()
    new_res[top] = 0.0
    state.residuals[idx_key] = new_res
    payload = torch.cat([vals, top.to(torch.int32).view(torch.float32)])
    gathered = [torch.empty_like(payload) for _ in range(world)]
    fut = dist.all_gather(gathered, payload, group=group, async_op=True).get_future()

    def decompress(_: torch.futures.Future) -> torch.Tensor:
        out = torch.zeros(n, dtype=torch.float32, device=grad.device)
        for p in gathered:
            out.index_add_(0, p[k:].view(torch.int32).long(), p[:k])
        out.div_(world)
        grad.copy_(out.to(grad.dtype))
        return grad

    return fut.then(decompress)


def topk_bytes(bucket: Any, ratio: float) -> int:
    n = bucket.buffer().numel()
    return 8 * max(1, min(n, math.ceil(ratio * n)))


def powersgd_bytes(bucket: Any, state: Any) -> int:
    """Payload bytes PowerSGD all-reduces for ``bucket`` at the state's iteration."""
    buf = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        return buf.numel() * buf.element_size()
    r = state.matrix_approximation_rank
    total = 0
    for g in bucket.gradients():
        if g.dim() <= 1:
            total += g.numel() * 4
            continue
        n = g.shape[0]
        m = g.numel() // n
        rr = min(n, m, r)
        if n * m > (n + m) * rr * state.min_compression_rate:
            total += (n + m) * rr * 4
        else:
            total += n * m * 4
    return total


def instrument(hook: Any, stats: CommStats, nbytes: Any) -> Any:
    """Wrap a comm hook to count bytes and stamp when each bucket is ready."""

    def wrapped(state, bucket):  # noqa: ANN001 - DDP checks annotations, keep none
        stats.last_ready = time.perf_counter()
        b = int(nbytes(state, bucket))
        stats.bytes += b
        stats.total_bytes += b
        stats.buckets += 1
        return hook(state, bucket)

    return wrapped


def register_compression(ddp_model: Any, kind: str, pcfg: Any, stats: CommStats) -> Any:
    """Register the comm hook for ``kind`` on a DDP model; returns the hook state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def elem_bytes(_: Any, b: Any) -> int:
        return b.buffer().numel() * b.buffer().element_size()

    if kind == "none":
        ddp_model.register_comm_hook(
            None, instrument(default_hooks.allreduce_hook, stats, elem_bytes)
        )
        return None
    if kind == "fp16":
        ddp_model.register_comm_hook(
            None,
            instrument(
                default_hooks.fp16_compress_hook, stats, lambda _, b: b.buffer().numel() * 2
            ),
        )
        return None
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=pcfg.powersgd_rank,
            start_powerSGD_iter=max(2, pcfg.powersgd_start_iter),
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        ddp_model.register_comm_hook(
            state,
            instrument(powerSGD_hook.powerSGD_hook, stats, lambda s, b: powersgd_bytes(b, s)),
        )
        return state
    if kind == "topk":
        state = TopKState(ratio=pcfg.topk_ratio)
        ddp_model.register_comm_hook(
            state, instrument(topk_hook, stats, lambda s, b: topk_bytes(b, s.ratio))
        )
        return state
    raise ValueError(f"unknown compression {kind!r}")
