"""Schedulers: which tokens of which requests go into the next micro-batch.

They hold request state and a :class:`~convergent.serve.kv_cache.BlockManager` but no
model, so they run the same under the real engine, the discrete-event simulator and unit
tests. The engine calls :meth:`Scheduler.schedule` whenever fewer than
:attr:`Scheduler.depth` micro-batches are in flight, and :meth:`Scheduler.complete` with
the sampled tokens when one comes back from the last stage.

* ``sequential`` — one process, continuous batching (one micro-batch in flight).
* ``interleaved`` — the conventional pipeline baseline: ``P`` micro-batches in flight,
  each mixing ready decodes with new prefills up to a token budget; with
  ``chunked_prefill`` long prompts are split to fill the budget exactly.
* ``tdpipe`` — prefill and decode separated in time (TD-Pipe): (a) a prefill phase
  admits requests greedily (FIFO) while the *predicted* peak KV use (prompts + predicted
  output lengths, counted in whole blocks per sequence at every future step) stays under
  ``tdpipe_memory_fraction`` of the budget; (b) decode micro-batches are rebuilt every round from
  all ready sequences so the ``P`` batches stay balanced as requests finish (inter-batch
  work stealing); (c) at each round boundary it switches back to prefill when decode's
  computational intensity (throughput of its current per-batch size relative to a large
  batch, from the cost table) drops below the useful fraction of a prefill round (its
  prompts packed into budget-sized micro-batches) after its pipeline bubbles, or (d) when
  the head of the queue has waited ``tdpipe_max_wait_s`` and the KV
  cache can take it: a bound on time to first token that intensity alone does not give
  (a few requests arriving while a large batch decodes are never worth a switch). While
  prefilling it keeps ``2P`` micro-batches in flight: prompt batches do not depend on
  each other, so stage 0 need not wait for the engine's round trip.

The shared request state and base class are in :mod:`convergent.serve.scheduler_base`,
TD-Pipe in :mod:`convergent.serve.tdpipe`; this module holds the conventional policies
and :func:`make_scheduler`, and re-exports the public names.

A KV shortage during decode preempts the most recently admitted idle request by
recompute (its blocks are freed; it is re-prefilled later with prompt + generated tokens).
"""

from __future__ import annotations

from collections.abc import Callable

from convergent.serve.config import SchedulerConfig
from convergent.serve.costs import CostTable
from convergent.serve.kv_cache import BlockManager
from convergent.serve.scheduler_base import (
    MAX_MODEL_LEN,
    Item,
    MicroBatch,
    Request,
    RequestStatus,
    Scheduler,
)
from convergent.serve.tdpipe import TDPipeScheduler, predicted_peak_blocks, predicted_peak_tokens

__all__ = [
    "Request",
    "RequestStatus",
    "Item",
    "MicroBatch",
    "SchedulerConfig",
    "Scheduler",
    "SequentialScheduler",
    "InterleavedScheduler",
    "TDPipeScheduler",
    "make_scheduler",
    "predicted_peak_tokens",
    "predicted_peak_blocks",
]


class InterleavedScheduler(Scheduler):
    """Conventional PP: each micro-batch = ready decodes + new prefills within the budget."""

    name = "interleaved"

    def schedule(self) -> MicroBatch | None:
        cfg = self.cfg
        items: list[Item] = []
        budget = cfg.max_batched_tokens
        pool = self._idle_running()
        # 1. requests already running: decodes and unfinished chunked prefills
        for r in sorted(pool, key=lambda x: x.admit_order):
            if r.state != RequestStatus.RUNNING or r.in_flight:
                continue
            n_left = r.total_len - r.num_computed
            if n_left == 1:
                if len(items) >= cfg.max_num_seqs:
                    continue
                if not self._reserve_decode(r, pool, {it.rid for it in items}):
                    continue
                items.append(Item(r.rid, r.num_computed, 1, True))
                budget -= 1
            else:  # partially prefilled (chunked)
                n = min(n_left, budget)
                if n <= 0 or len(items) >= cfg.max_num_seqs:
                    continue
                if not self.bm.can_grow(r.rid, r.num_computed + n):
                    continue
                self.bm.grow(r.rid, r.num_computed + n)
                items.append(Item(r.rid, r.num_computed, n, r.num_computed + n == r.total_len))
                budget -= n
        # 2. new prefills
        while self.waiting and len(items) < cfg.max_num_seqs:
            r = self.waiting[0]
            n_all = r.total_len
            if cfg.chunked_prefill:
                n = min(n_all, budget)
                if n <= 0:
                    break
            else:
                n = n_all
                if n > budget and items:
                    break
            if not self.bm.can_grow(r.rid, n + (1 if n == n_all else 0)):
                break
            self.waiting.popleft()
            self.bm.grow(r.rid, n)
            self._admit_req(r)
            items.append(Item(r.rid, 0, n, n == n_all))
            budget -= n
        kinds = {("decode" if it.n == 1 and it.start > 0 else "prefill") for it in items}
        return self._make(items, kinds.pop() if len(kinds) == 1 else "mixed")


class SequentialScheduler(InterleavedScheduler):
    """Continuous batching in one process: the same policy with one micro-batch in flight."""

    name = "sequential"

    @property
    def depth(self) -> int:
        return 1


def make_scheduler(
    cfg: SchedulerConfig,
    blocks: BlockManager,
    num_stages: int,
    costs: CostTable | None = None,
    *,
    max_model_len: int = MAX_MODEL_LEN,
    ignore_eos: bool = False,
    clock: Callable[[], float] | None = None,
) -> Scheduler:
    """The scheduler of ``cfg.kind`` (``sequential``, ``interleaved``, ``tdpipe``); the
    keywords are :class:`~convergent.serve.scheduler_base.Scheduler`'s."""
    name = cfg.kind
    cls = {
        "sequential": SequentialScheduler,
        "interleaved": InterleavedScheduler,
        "tdpipe": TDPipeScheduler,
    }.get(name)
    if cls is None:
        raise ValueError(f"unknown scheduler {name!r} (sequential, interleaved, tdpipe)")
    p = 1 if name == "sequential" else num_stages
    return cls(
        cfg, blocks, p, costs, max_model_len=max_model_len, ignore_eos=ignore_eos, clock=clock
    )
