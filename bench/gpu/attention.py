"""Decode attention over the paged KV cache, side by side: gather + SDPA vs Triton (split
contexts as :func:`~convergent.models.paged_triton.choose_splits` says, and one split) vs
FlexAttention.

A micro-benchmark of one layer's decode step at the attention shape of the 1.1B Llama of
bench/gpu/throughput.py (32 query / 4 KV heads, head_dim 64, blocks of 16 tokens, bf16),
for a few (sequences, context) batches: each side runs
:func:`convergent.models.llama_paged.paged_attention` on the same decode-only step (the new
K/V written, then the decode attention), planned for its backend, timed with CUDA events
after a warm-up (Triton's JIT and FlexAttention's compile are timed apart as
``first_call_s``). Per side: the median and spread of the per-call time, the KV bytes the
step must read (the context's K and V), the bandwidth that implies, and the largest
difference of its output from the gather side's. It also times the host side of the new
step metadata (``PagedBatch.build`` for the batch: numpy into the pinned buffers, one
copy).

Runs inside ``bench/gpu/profile.py``'s serve part (``--only serve``), under a time budget
(``budget_s``, default 30 s: sides past it are recorded as skipped), so it fits the
lease's ~2-minute serve slot; on the CPU (``device="cpu"``, tiny shapes) it is a smoke
check of the same code: the Triton side needs CUDA or ``TRITON_INTERPRET=1``, FlexAttention
runs eager there (it materialises the scores).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

__all__ = ["GPU_SHAPES", "decode_attention_bench"]

# (sequences, mean context tokens) of a decode step: the bench's 64 sequences at the trace's
# lengths, vLLM's default of 256 sequences, and long contexts
GPU_SHAPES = [(64, 512), (256, 512), (64, 2048)]
MODEL = dict(nq=32, nkv=4, hd=64, block_size=16)


def _step(n: int, ctx: int, nkv: int, hd: int, bs: int, dtype, device, seed: int = 0):
    """A decode-only step of ``n`` sequences with contexts uniform in ``[ctx/2, 3ctx/2]``,
    their blocks scattered over a cache of exactly the blocks they use (shuffled)."""
    import torch

    rng = random.Random(seed)
    lens = [rng.randint(max(2, ctx // 2), max(2, 3 * ctx // 2)) for _ in range(n)]
    nblk = [-(-c // bs) for c in lens]
    pool = list(range(sum(nblk)))
    rng.shuffle(pool)
    tables, pos, slots = [], [], []
    for c, k in zip(lens, nblk, strict=True):
        t = [pool.pop() for _ in range(k)]
        tables.append(t)
        pos.append(c - 1)
        slots.append(t[(c - 1) // bs] * bs + (c - 1) % bs)
    g = torch.Generator().manual_seed(seed)
    shape = (sum(nblk) * bs, nkv, hd)
    kc = torch.randn(shape, generator=g).to(dtype).to(device)
    vc = torch.randn(shape, generator=g).to(dtype).to(device)
    return dict(lens=lens, tables=tables, pos=pos, slots=slots, kc=kc, vc=vc)


def _time(fn, device: str, reps: int) -> list[float]:
    """Per-call seconds of ``fn`` (CUDA events on the GPU, perf_counter on the CPU)."""
    import torch

    out = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def _side(backend: str, st: dict, q, k, v, bs: int, scale: float, device: str, reps: int):
    """One side on one step: first call (compile/JIT), then ``reps`` timed calls."""
    import torch

    from convergent.models.llama import PagedBatch, paged_attention
    from convergent.models.paged_meta import StepBuffers

    n = len(st["lens"])
    bufs = StepBuffers(device)
    one_split = backend == "triton_one_split"  # the kernel before split contexts
    batch = PagedBatch.build(bufs, st["pos"], st["slots"], [1] * n, st["lens"], st["tables"], bs,
                             backend="triton" if one_split else backend)
    kc, vc = st["kc"].clone(), st["vc"].clone()

    def call():
        from convergent.models import paged_triton

        target = paged_triton.TARGET_PROGRAMS
        paged_triton.TARGET_PROGRAMS = 0 if one_split else target  # 0: choose_splits -> 1
        try:
            with torch.inference_mode():
                return paged_attention(q, k, v, batch, kc, vc, scale)
        finally:
            paged_triton.TARGET_PROGRAMS = target

    t0 = time.perf_counter()
    out = call()
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(2):
        call()
    times = _time(call, device, reps)
    return out, first, times


def _build_host_us(st: dict, bs: int, device: str, reps: int = 20) -> float:
    """Host microseconds of PagedBatch.build for the step (median), Triton's plan."""
    from convergent.models.llama import PagedBatch
    from convergent.models.paged_meta import StepBuffers

    bufs = StepBuffers(device)
    n = len(st["lens"])
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        PagedBatch.build(bufs, st["pos"], st["slots"], [1] * n, st["lens"], st["tables"], bs,
                         backend="triton", extras=[st["pos"], list(range(n))])
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _sides(device: str) -> list[str]:
    import os

    from convergent.models.paged_decode import triton_available

    sides = ["sdpa_gather"]
    if triton_available() and (device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        sides += ["triton", "triton_one_split"]
    return [*sides, "flex"]


def decode_attention_bench(device: str = "cuda", shapes=None, dtypes=("bfloat16",),
                           reps: int = 10, budget_s: float = 30.0, model=None) -> dict[str, Any]:
    """Every side on every (dtype, shape); see the module's docstring."""
    import torch

    m = dict(MODEL if model is None else model)
    shapes = GPU_SHAPES if shapes is None else shapes
    t_start = time.monotonic()
    rows: list[dict[str, Any]] = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for n, ctx in shapes:
            st = _step(n, ctx, m["nkv"], m["hd"], m["block_size"], dtype, device)
            g = torch.Generator().manual_seed(1)
            q = torch.randn(n, m["nq"], m["hd"], generator=g).to(dtype).to(device)
            k = torch.randn(n, m["nkv"], m["hd"], generator=g).to(dtype).to(device)
            v = torch.randn(n, m["nkv"], m["hd"], generator=g).to(dtype).to(device)
            kv_bytes = sum(st["lens"]) * m["nkv"] * m["hd"] * 2 * dtype.itemsize
            row: dict[str, Any] = {"dtype": dname, "sequences": n, "mean_context": ctx,
                                   "context_tokens": sum(st["lens"]), "kv_bytes": kv_bytes,
                                   "build_host_us": round(_build_host_us(st, m["block_size"], device), 1),
                                   "sides": {}}
            ref = None
            for side in _sides(device):
                if time.monotonic() - t_start > budget_s:
                    row["sides"][side] = {"skipped": f"over the {budget_s:.0f} s budget"}
                    continue
                try:
                    out, first, times = _side(side, st, q, k, v, m["block_size"], m["hd"] ** -0.5,
                                              device, reps)
                except Exception as exc:  # noqa: BLE001 - a failing side must not end the run
                    row["sides"][side] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
                    continue
                ref = out if ref is None else ref
                med = statistics.median(times)
                row["sides"][side] = {
                    "median_us": round(med * 1e6, 2), "min_us": round(min(times) * 1e6, 2),
                    "max_us": round(max(times) * 1e6, 2), "first_call_s": round(first, 3),
                    "kv_gb_per_s": round(kv_bytes / med / 1e9, 1),
                    "max_abs_diff_vs_gather": float((out.float() - ref.float()).abs().max())}
            base = row["sides"].get("sdpa_gather", {}).get("median_us")
            for s in row["sides"].values():
                if base and "median_us" in s:
                    s["speedup_vs_gather"] = round(base / s["median_us"], 2)
            rows.append(row)
    return {"model": {**m, "note": "the 1.1B Llama of bench/gpu/throughput.py, one layer"},
            "device": device, "reps": reps, "rows": rows,
            "wall_s": round(time.monotonic() - t_start, 1)}
