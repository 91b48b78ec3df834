"""How :meth:`Engine.map <convergent.analytics.engine.Engine.map>` groups shard tasks
into Dask tasks (``batch``): one Dask task per shard, guided runs, even runs per worker,
or even runs and a tail of single shards. Dask's per-task cost (scheduler, client and the
workers' event loops, a few ms each) is what the runs save; balance between the workers is
what they must keep."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BATCH_MAX = 8  # Engine.map(batch=True): most tasks run as one Dask task
EVEN = "even"  # Engine.map(batch=EVEN): one run per worker, about equal records
BALANCED = "balanced"  # batch=BALANCED: EVEN over most records, then single tasks
TAIL_SHARE = 0.05  # batch=BALANCED: the share of records left to single tasks at the end


def units(n: int, placed: dict[int, list[str]], workers: int, batch: bool | str,
          sizes: Sequence[int] | None = None) -> list[list[int]]:
    """Task numbers ``0..n-1`` in runs of consecutive tasks that may run on the same
    workers. With ``batch``, guided sizes: up to :data:`BATCH_MAX` tasks, and at most a
    ``1 / (2 x workers)`` share of what is left, so the runs shrink to single tasks at the
    end and no worker is left with a long run while the others are idle. With
    ``batch=EVEN``, one run per worker, cut where the running total of ``sizes`` (records;
    1 per task without) crosses each worker's equal share: for stages whose cost per task
    is a few milliseconds and follows its records (split's molecule keys, read from the
    shard index alone), where each Dask task's cost and the driver's handling of each result
    outweigh the balancing that guided runs buy (100 shards on 2 workers: 0.22 s in 19
    tasks, 0.15 s in 2). With ``batch=BALANCED``, the same equal runs over the first
    ``1 - TAIL_SHARE`` of the records, then the last shards one task each, which the Dask
    scheduler balances between the workers (queued until one is free, or stolen): for long
    stages whose cost follows their records (split's write), where a dozen guided tasks
    cost the driver and the workers' event loops CPU time that the tasks themselves lose on
    a small machine (split of 1M records on 2 cores: 0.26 CPU-s of scheduler, client and
    worker loops in 19 tasks, 0.17 in 7), and the tail still evens out a worker that runs
    slower."""
    if not batch:
        return [[k] for k in range(n)]
    by: dict[tuple[str, ...], list[int]] = {}
    for k in range(n):
        by.setdefault(tuple(placed.get(k) or ()), []).append(k)
    out: list[list[int]] = []
    for ws, ks in by.items():
        w = max(len(ws) or workers, 1)
        if batch in (EVEN, BALANCED):
            out.extend(_even(ks, [sizes[k] if sizes is not None else 1 for k in ks], w,
                             TAIL_SHARE if batch == BALANCED else 0.0))
        else:
            out.extend(_guided(ks, w))
    return out


def _even(ks: list[int], sizes: list[int], w: int, tail: float) -> list[list[int]]:
    """``w`` runs of about equal ``sizes`` over the first ``1 - tail`` of them, then the
    rest one task each (never an empty run)."""
    cum = np.cumsum(sizes)
    head = len(ks) if not tail else int(np.searchsorted(cum, cum[-1] * (1 - tail), side="right"))
    out: list[list[int]] = []
    if head:
        c = cum[:head]
        cuts = np.searchsorted(c, c[-1] * np.arange(1, w) / w, side="right") if w > 1 else []
        out.extend(p.tolist() for p in np.split(np.asarray(ks[:head]), cuts) if p.size)
    out.extend([k] for k in ks[head:])
    return out


def _guided(ks: list[int], w: int) -> list[list[int]]:
    """Runs of at most :data:`BATCH_MAX`, and a ``1 / (2 w)`` share of what is left."""
    out, i = [], 0
    while i < len(ks):
        size = min(BATCH_MAX, -(-(len(ks) - i) // (2 * w)))
        out.append(ks[i: i + size])
        i += size
    return out
