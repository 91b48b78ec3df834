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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from convergent.train.config import ParallelConfig


@dataclass
class CommStats:
    """Per-step counters filled by the instrumented hook (reset by the trainer)."""

    bytes: int = 0
    buckets: int = 0
    last_ready: float | None = None

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


def topk_payload(
    tensor: torch.Tensor, residuals: dict, key: Any, ratio: float
) -> tuple[torch.Tensor, int]:
    """Top-k selection with error feedback: ``(payload, k)``.

    The residual of ``key`` (what earlier rounds did not send) is added to ``tensor``,
    the ``k = ceil(ratio * n)`` largest magnitudes are sent, the rest is kept as the new
    residual. The payload is ``[values (fp32), indices (int32 viewed as fp32)]``.
    """
    n = tensor.numel()
    res = residuals.get(key)
    acc = tensor.float() + res if res is not None and res.shape == tensor.shape else tensor.float()
    k = max(1, min(n, math.ceil(ratio * n)))
    top = acc.abs().topk(k, sorted=False).indices
    new_res = acc.clone()
    new_res[top] = 0.0
    residuals[key] = new_res
    return torch.cat([acc[top], top.to(torch.int32).view(torch.float32)]), k


def topk_sum(gathered: list[torch.Tensor], k: int, n: int, device: Any) -> torch.Tensor:
    """Sum of the sparse payloads of :func:`topk_payload` as a dense fp32 vector of ``n``."""
    out = torch.zeros(n, dtype=torch.float32, device=device)
    for p in gathered:
        out.index_add_(0, p[k:].view(torch.int32).long(), p[:k])
    return out


def topk_hook(state, bucket):  # noqa: ANN001 - DDP checks annotations, keep none
    """DDP comm hook: top-k sparsified all-gather with error feedback (see module doc)."""
    group = state.process_group
    world = dist.get_world_size(group)
    grad = bucket.buffer()
    n = grad.numel()
    idx_key = bucket.index()
    payload, k = topk_payload(grad, state.residuals, idx_key, state.ratio)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    fut = dist.all_gather(gathered, payload, group=group, async_op=True).get_future()

    def decompress(_: torch.futures.Future) -> torch.Tensor:
        out = topk_sum(gathered, k, n, grad.device)
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


def instrument(hook: Any, stats: CommStats, nbytes: Any, before: Any = None) -> Any:
    """Wrap a comm hook to count bytes and stamp when each bucket is ready.

    ``before(state, bucket)``, when given, runs first (layout notes, state restore).
    """

    def wrapped(state, bucket):  # noqa: ANN001 - DDP checks annotations, keep none
        stats.last_ready = time.perf_counter()
        if before is not None:
            before(state, bucket)
        b = int(nbytes(state, bucket))
        stats.bytes += b
        stats.buckets += 1
        return hook(state, bucket)

    return wrapped


def _q_slices(bucket_params: list[tuple[str, torch.Size]], state: Any) -> dict[str, slice]:
    """Where each compressed matrix's Q factor lives in PowerSGD's flat Q buffer.

    Mirrors ``powerSGD_hook``: tensors viewed as ``(shape[0], -1)``, compressed when
    ``_should_compress`` says so, Q factors grouped by matrix shape (first appearance
    order), ``m x rank`` elements each.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    groups: dict[tuple[int, int], list[str]] = {}
    for name, shape in bucket_params:
        n = shape[0]
        m = math.prod(shape) // n
        r = min(n, m, state.matrix_approximation_rank)
        if _should_compress(n, m, r, state.min_compression_rate)[0]:
            groups.setdefault((n, m), []).append(name)
    out, pos = {}, 0
    for (n, m), names in groups.items():
        size = m * min(n, m, state.matrix_approximation_rank)
        for name in names:
            out[name] = slice(pos, pos + size)
            pos += size
    return out


class CompressionState:
    """A DDP comm hook's state, kept per parameter across bucket layouts and restarts.

    Error-feedback buffers are flat per DDP bucket, and DDP rebuilds its buckets after
    the first iteration of every process (so a resumed run, and iteration 2 of any run,
    sees another layout than the buffers were made in). Whenever a bucket's parameter
    layout changes, and in :meth:`state_dict`, the buffers are split per parameter (by
    FQN): top-k residuals, PowerSGD error and warm-start Q factors; each bucket
    reassembles its buffers from those pieces when it is next seen. PowerSGD's iteration
    counter and RNG are saved too. Checkpoints store this per rank (same world size).
    """

    def __init__(self, kind: str, hook_state: Any, module: torch.nn.Module) -> None:
        self.kind = kind
        self.hook_state = hook_state
        self._names = {id(p): n for n, p in module.named_parameters()}
        self.layout: dict[int, list[tuple[str, torch.Size]]] = {}  # bucket -> params
        self._where: dict[str, int] = {}  # parameter FQN -> bucket index
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def note(self, _state: Any, bucket: Any) -> None:
        """Track the bucket's parameter layout; (re)assemble per-parameter buffers."""
        if self.hook_state is None:
            return
        params = [(self._names[id(p)], p.shape) for p in bucket.parameters()]
        idx = bucket.index()
        if self.layout.get(idx) not in (None, params) or any(
            self._where.get(n, idx) != idx for n, _ in params
        ):
            self._pending = self._capture()  # layout changed: re-key by parameter
            self._clear()
        self.layout[idx] = params
        self._where.update((n, idx) for n, _ in params)
        if self._pending:
            self._restore(idx, params, bucket.buffer())

    @staticmethod
    def _split(flat: torch.Tensor, params: list[tuple[str, torch.Size]]) -> dict:
        out, pos = {}, 0
        for name, shape in params:
            n = math.prod(shape)
            out[name] = flat[pos : pos + n].detach().clone()
            pos += n
        return out

    @staticmethod
    def _join(parts: dict[str, torch.Tensor], params: list, like: torch.Tensor) -> Any:
        if not all(name in parts for name, _ in params):
            return None
        return torch.cat([parts[name].reshape(-1) for name, _ in params]).to(like)

    def _capture(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-parameter copies of the flat buffers (plus any still pending)."""
        st = self.hook_state
        out: dict[str, dict[str, torch.Tensor]] = {k: dict(v) for k, v in self._pending.items()}
        if self.kind == "topk":
            res = out.setdefault("residual", {})
            for idx, flat in st.residuals.items():
                res.update(self._split(flat, self.layout[idx]))
        elif self.kind == "powersgd":
            err, q = out.setdefault("error", {}), out.setdefault("q", {})
            for idx, flat in st.error_dict.items():
                err.update(self._split(flat, self.layout[idx]))
            for idx, flat in st.q_memory_dict.items():
                for name, sl in _q_slices(self.layout[idx], st).items():
                    q[name] = flat[sl].detach().clone()
        return out

    def _clear(self) -> None:
        st = self.hook_state
        self.layout, self._where = {}, {}
        if self.kind == "topk":
            st.residuals.clear()
        elif self.kind == "powersgd":
            st.error_dict.clear()
            st.q_memory_dict.clear()
            st.p_memory_dict.clear()

    def state_dict(self) -> dict[str, Any]:
        """Per-parameter error-feedback state (CPU tensors) and counters."""
        out: dict[str, Any] = {"kind": self.kind}
        for key, parts in self._capture().items():
            out[key] = {n: t.cpu() for n, t in parts.items()}
        if self.kind == "powersgd":
            st = self.hook_state
            out.update(
                iter=st.iter, rng=st.rng.get_state(),
                numel=(st.total_numel_before_compression, st.total_numel_after_compression),
            )
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore counters now and error-feedback buffers as their buckets appear."""
        if sd.get("kind") != self.kind or self.hook_state is None:
            return  # checkpoint of another compression: start this one fresh
        st = self.hook_state
        self._clear()
        if self.kind == "topk":
            self._pending = {"residual": dict(sd["residual"])}
        elif self.kind == "powersgd":
            st.iter = int(sd["iter"])
            st.rng.set_state(sd["rng"])
            st.total_numel_before_compression, st.total_numel_after_compression = sd["numel"]
            self._pending = {"error": dict(sd["error"]), "q": dict(sd["q"])}

    def _restore(self, idx: int, params: list, buf: torch.Tensor) -> None:
        st = self.hook_state
        if self.kind == "topk":
            flat = self._join(self._pending.get("residual", {}), params, buf.float())
            if flat is not None:
                st.residuals[idx] = flat
        elif self.kind == "powersgd":
            flat = self._join(self._pending.get("error", {}), params, buf)
            if flat is not None:
                st.error_dict[idx] = flat
            slices = _q_slices(params, st)
            q = self._pending.get("q", {})
            if slices and all(n in q for n in slices):
                size = max(sl.stop for sl in slices.values())
                qbuf = torch.empty(size, dtype=buf.dtype, device=buf.device)
                for name, sl in slices.items():
                    qbuf[sl] = q[name].to(qbuf)
                st.q_memory_dict[idx] = qbuf
                # P is recomputed from M Q; its presence marks Q as warm (not re-drawn)
                r = st.matrix_approximation_rank
                p_size = sum(
                    shape[0] * min(shape[0], math.prod(shape) // shape[0], r)
                    for name, shape in params if name in slices
                )
                st.p_memory_dict[idx] = torch.empty(p_size, dtype=buf.dtype, device=buf.device)
        for parts in self._pending.values():
            for name, _ in params:
                parts.pop(name, None)
        if not any(self._pending.values()):
            self._pending = {}


def register_compression(
    ddp_model: Any, kind: str, pcfg: ParallelConfig, stats: CommStats
) -> CompressionState:
    """Register the comm hook for ``kind`` on a DDP model; returns its state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def elem_bytes(_: Any, b: Any) -> int:
        return b.buffer().numel() * b.buffer().element_size()

    if kind == "none":
        hook, state, nbytes = default_hooks.allreduce_hook, None, elem_bytes
    elif kind == "fp16":
        hook, state = default_hooks.fp16_compress_hook, None
        nbytes = lambda _, b: b.buffer().numel() * 2  # noqa: E731
    elif kind == "powersgd":
        hook = powerSGD_hook.powerSGD_hook
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=pcfg.powersgd_rank,
            start_powerSGD_iter=max(2, pcfg.powersgd_start_iter),
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        nbytes = lambda s, b: powersgd_bytes(b, s)  # noqa: E731
    elif kind == "topk":
        hook, state = topk_hook, TopKState(ratio=pcfg.topk_ratio)
        nbytes = lambda s, b: topk_bytes(b, s.ratio)  # noqa: E731
    else:
        raise ValueError(f"unknown compression {kind!r}")
    cs = CompressionState(kind, state, ddp_model.module)
    ddp_model.register_comm_hook(state, instrument(hook, stats, nbytes, cs.note))
    return cs
