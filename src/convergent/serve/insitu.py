"""Cost table profiled *in situ*: a short warm-up sweep through the real stage processes.

Timing one layer in the engine's process (:func:`~convergent.serve.costs.profile_costs`)
misses what the stages do to each other in a real run: on a small CPU the stage
processes share cores and memory bandwidth, and the engine adds dispatch and hop
latency. Here synthetic micro-batches of prefill, decode and mixed shapes go through
the same executor the run will use, ``depth`` of them in flight so every stage works
at once, and per-stage models are fitted on the stages' own busy intervals
(:func:`~convergent.serve.costs.calibrate_from_run`). The sweep writes only into KV
blocks nobody owns yet (it runs before any request), so it changes no output.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from convergent.serve.config import EngineConfig, SchedulerConfig
from convergent.serve.costs import BatchShape, CostTable, calibrate_from_run
from convergent.serve.messages import BatchMeta, BatchResult, StageBusy
from convergent.serve.sampling import SamplingParams

if TYPE_CHECKING:
    from convergent.serve.executor import LocalExecutor, ProcessExecutor

__all__ = ["sweep_shapes", "profile_in_situ"]

GREEDY = SamplingParams()


def sweep_shapes(
    max_tokens: int, max_seqs: int, max_len: int, capacity: int
) -> list[tuple[list[int], list[int]]]:
    """Batch shapes ``(query_lens, context_lens)`` covering prefill, decode and mixed
    micro-batches within the budgets: tokens per batch, sequences per batch, context
    length and the KV cache's ``capacity`` in tokens (no real batch holds more)."""
    shapes: list[tuple[list[int], list[int]]] = []
    for b in (1, 4, 16, 32, 64, 128, 256):
        for c in (16, 64, 192, 512):
            if b <= min(max_seqs, max_tokens) and c < max_len and b * c <= capacity:
                shapes.append(([1] * b, [c] * b))
    for n in (8, 32, 128, 512):
        if n > min(max_len, max_tokens, capacity):
            continue
        k_max = max(1, min(max_tokens // n, max_seqs, capacity // n))
        for k in sorted({1, k_max}):
            shapes.append(([n] * k, [n] * k))
    for b in (8, 32):  # mixed: decodes plus a prompt (the interleaved baseline's batches)
        n = min(max_tokens - b, 128, max_len - 1)
        if b < max_seqs and n > 1 and b * 96 + n <= capacity:
            shapes.append(([1] * b + [n], [96] * b + [n]))
    return shapes


def _meta(bid: int, ql: list[int], cl: list[int], num_blocks: int, bs: int) -> BatchMeta:
    """A synthetic micro-batch of these query and context lengths, every item sampled
    greedily, its KV in blocks taken round-robin."""
    meta = BatchMeta(bid, [], [], [], ql, cl, [], [], list(range(len(ql))))
    nxt = 0
    for q, c in zip(ql, cl, strict=True):
        nb = -(-c // bs)
        table = [(nxt + j) % num_blocks for j in range(nb)]
        nxt += nb
        meta.block_tables.append(table)
        for p in range(c - q, c):
            meta.input_ids.append(p % 200 + 1)
            meta.positions.append(p)
            meta.slots.append(table[p // bs] * bs + p % bs)
        meta.sample_rows.append(len(meta.positions) - 1)
        meta.sampling.add(GREEDY, c)
    return meta


def _shape(ql: list[int], cl: list[int]) -> BatchShape:
    s = BatchShape(sampled=len(ql))
    for q, c in zip(ql, cl, strict=True):
        if q == 1:
            s.decode_seqs += 1
            s.decode_ctx += c
        else:
            s.prefill_tokens += q
            s.prefill_pairs += q * c
    return s


def profile_in_situ(
    executor: LocalExecutor | ProcessExecutor,
    base: CostTable,
    *,
    depth: int,
    num_blocks: int,
    engine: EngineConfig,
    scheduler: SchedulerConfig,
    reps: int = 2,
    seed: int = 0,
) -> CostTable:
    """Run the sweep ``reps`` times (shuffled) through ``executor`` with ``depth``
    micro-batches in flight, within ``num_blocks`` KV blocks of ``engine.block_size``, the
    scheduler's budgets and ``engine.max_model_len``; return per-stage models fitted on the
    busy intervals (``source = "profiled in situ"``). ``base.layers_per_stage`` gives the
    stages."""
    bs = engine.block_size
    capacity = num_blocks * bs
    shapes = sweep_shapes(
        scheduler.max_batched_tokens, scheduler.max_num_seqs, engine.max_model_len, capacity
    )
    shapes = shapes * max(1, reps)
    random.Random(seed).shuffle(shapes)
    shapes = [([1], [16])] * depth + shapes  # warm-up, discarded
    p = len(base.layers_per_stage)
    log: dict[int, dict] = {}
    pending = list(enumerate(shapes))
    in_flight = 0
    while pending or in_flight or any(len(e["stages"]) < p for e in log.values()):
        while pending and in_flight < depth:
            i, (ql, cl) = pending.pop(0)
            bid = -1 - i  # negative: never a scheduler's id
            log[bid] = {"submit": time.monotonic(), "shape": _shape(ql, cl), "stages": {}}
            executor.submit(_meta(bid, ql, cl, num_blocks, bs))
            in_flight += 1
        msgs = executor.poll(timeout=1.0)
        recv = time.monotonic()
        for m in msgs:
            if isinstance(m, StageBusy):
                log[m.bid]["stages"][m.stage] = (m.t0, m.t1)
            elif isinstance(m, BatchResult):
                log[m.bid]["stages"][p - 1] = (m.t0, m.t1)
                log[m.bid]["recv"] = recv
                in_flight -= 1
    for i in range(depth):
        log.pop(-1 - i)
    table = calibrate_from_run(log, base)
    table.source = "profiled in situ"
    return table
