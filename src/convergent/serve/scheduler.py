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
  ``memory_fraction`` of the budget; (b) decode micro-batches are rebuilt every round from
  all ready sequences so the ``P`` batches stay balanced as requests finish (inter-batch
  work stealing); (c) at each round boundary it switches back to prefill when decode's
  computational intensity (throughput of its current per-batch size relative to a large
  batch, from the cost table) drops below the useful fraction of a prefill round (its
  prompts packed into budget-sized micro-batches) after its pipeline bubbles. While
  prefilling it keeps ``2P`` micro-batches in flight: prompt batches do not depend on
  each other, so stage 0 need not wait for the engine's round trip.

A KV shortage during decode preempts the most recently admitted idle request by
recompute (its blocks are freed; it is re-prefilled later with prompt + generated tokens).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convergent.serve.costs import BatchShape, CostTable
from convergent.serve.kv_cache import BlockManager

__all__ = [
    "Request",
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


@dataclass(eq=False)
class Request:
    """A request's state. ``tokens = prompt + output``; ``num_computed`` of them are in KV."""

    rid: int
    prompt: list[int]
    max_tokens: int
    predicted_len: int = 0  # predicted output tokens (tdpipe admission)
    stop_ids: frozenset[int] = frozenset()
    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    logprobs: int = -1  # -1: none; k >= 0: chosen token's logprob and the top k
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    state: str = "waiting"  # waiting | running | finished
    in_flight: bool = False
    finish_reason: str | None = None
    preemptions: int = 0
    admit_order: int = -1
    first_token_time: float | None = None
    finish_time: float | None = None
    token_logprobs: list = field(default_factory=list)  # per output token, where asked
    error: str | None = None  # why it ended with finish_reason "error"
    retryable: bool = False  # ended by a failure before any of it reached the stages

    @property
    def total_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def token(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    @property
    def remaining_predicted(self) -> int:
        return max(1, self.predicted_len - len(self.output))


@dataclass
class Item:
    """Compute tokens ``start .. start+n-1`` of request ``rid``; sample if it reaches the end."""

    rid: int
    start: int
    n: int
    sample: bool


@dataclass
class MicroBatch:
    bid: int
    items: list[Item]
    kind: str  # "prefill" | "decode" | "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(it.n for it in self.items)


@dataclass
class SchedulerConfig:
    """Budgets (tokens, sequences) and policy knobs; defaults fit a 2-core laptop."""

    max_num_seqs: int = 256
    max_batched_tokens: int = 1024
    chunked_prefill: bool = False
    max_model_len: int = 2048
    memory_fraction: float = 1.0  # tdpipe: predicted peak KV use allowed
    work_stealing: bool = True  # tdpipe
    ignore_eos: bool = False

    @classmethod
    def from_serve(cls, cfg: Any, ignore_eos: bool = False) -> SchedulerConfig:
        """The scheduler budgets and knobs of a ``serve`` config section."""
        return cls(
            max_num_seqs=cfg.max_num_seqs,
            max_batched_tokens=cfg.max_batched_tokens,
            chunked_prefill=cfg.chunked_prefill,
            max_model_len=cfg.max_model_len,
            memory_fraction=cfg.tdpipe_memory_fraction,
            work_stealing=cfg.work_stealing,
            ignore_eos=ignore_eos,
        )


class Scheduler:
    """Common request bookkeeping; subclasses implement :meth:`schedule`."""

    name = "base"

    def __init__(
        self,
        cfg: SchedulerConfig,
        blocks: BlockManager,
        num_stages: int = 1,
        costs: CostTable | None = None,
    ) -> None:
        self.cfg = cfg
        self.bm = blocks
        self.P = max(1, num_stages)
        self.costs = costs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted (hold KV), in admission order
        self.requests: dict[int, Request] = {}
        self.finished: list[Request] = []
        self._bid = itertools.count()
        self._admit = itertools.count()
        self.num_preemptions = 0

    # -- interface
    @property
    def depth(self) -> int:
        """Micro-batches allowed in flight."""
        return self.P

    def add(self, req: Request) -> None:
        """Queue a request; one that can never fit finishes at once with ``length``."""
        self.requests[req.rid] = req
        if (
            len(req.prompt) >= self.cfg.max_model_len
            or self.bm.blocks_for(len(req.prompt) + 1) > self.bm.num_blocks
        ):
            self._finish(req, "length", None)
            return
        self.waiting.append(req)

    def prune_finished(self) -> None:
        """Forget finished requests that no micro-batch still references (long-running servers)."""
        keep = []
        for r in self.finished:
            if r.in_flight:
                keep.append(r)
            else:
                self.requests.pop(r.rid, None)
        self.finished = keep

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> MicroBatch | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def complete(
        self, batch: MicroBatch, sampled: dict[int, int], now: float = 0.0
    ) -> list[Request]:
        """Apply a finished micro-batch: advance KV, append sampled tokens, finish requests."""
        done = []
        for it in batch.items:
            r = self.requests.get(it.rid)
            if r is None:  # dropped after it finished (aborted while in flight)
                continue
            r.in_flight = False
            if r.state != "running":
                continue
            r.num_computed = it.start + it.n
            if not it.sample:
                continue
            tok = sampled[it.rid]
            r.output.append(tok)
            if r.first_token_time is None:
                r.first_token_time = now
            if len(r.output) >= r.max_tokens:
                self._finish(r, "length", now)
            elif not self.cfg.ignore_eos and tok in r.stop_ids:
                self._finish(r, "stop", now)
            elif r.total_len >= self.cfg.max_model_len:
                self._finish(r, "length", now)
            if r.state == "finished":
                done.append(r)
        return done

    def abort(self, rid: int) -> None:
        r = self.requests.get(rid)
        if r is None or r.state == "finished":
            return
        if r in self.waiting:
            self.waiting.remove(r)
        self._finish(r, "abort", None)

    def resolve_stall(self) -> Request | None:
        """Nothing can be scheduled and nothing is in flight: the KV cache is too small for
        the newest running request (or the head of the queue). Finish it with ``length``."""
        if self.running:
            r = max(self.running, key=lambda x: x.admit_order)
        elif self.waiting:
            r = self.waiting.popleft()
        else:
            return None
        self._finish(r, "length", None)
        return r

    # -- helpers
    def _finish(self, r: Request, reason: str, now: float | None) -> None:
        if r in self.running:
            self.running.remove(r)
        self.bm.free(r.rid)
        r.state = "finished"
        r.finish_reason = reason
        r.finish_time = now
        self.finished.append(r)

    def _admit_req(self, r: Request) -> None:
        r.state = "running"
        r.admit_order = next(self._admit)
        self.running.append(r)

    def _preempt(self, victim: Request) -> None:
        """Free the victim's KV and put it back at the head of the queue (recompute)."""
        self.running.remove(victim)
        self.bm.free(victim.rid)
        victim.num_computed = 0
        victim.state = "waiting"
        victim.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _idle_running(self) -> list[Request]:
        return [r for r in self.running if not r.in_flight]

    def _reserve_decode(self, r: Request, pool: list[Request], chosen: set[int]) -> bool:
        """Make room for one more token of ``r``, preempting the newest idle request of ``pool``."""
        need = r.total_len
        while not self.bm.can_grow(r.rid, need):
            victims = [
                v
                for v in pool
                if v is not r and v.rid not in chosen and v.state == "running" and not v.in_flight
            ]
            if not victims:
                return False
            v = max(victims, key=lambda x: x.admit_order)
            pool.remove(v)
            self._preempt(v)
        self.bm.grow(r.rid, need)
        return True

    def _make(self, items: list[Item], kind: str) -> MicroBatch | None:
        if not items:
            return None
        for it in items:
            self.requests[it.rid].in_flight = True
        return MicroBatch(next(self._bid), items, kind)

    def batch_shape(self, batch: MicroBatch) -> BatchShape:
        """Token counts of a micro-batch (for the cost table)."""
        s = BatchShape()
        for it in batch.items:
            ctx = it.start + it.n
            if it.n == 1:
                s.decode_seqs += 1
                s.decode_ctx += ctx
            else:
                s.prefill_tokens += it.n
                s.prefill_pairs += it.n * ctx
            s.sampled += int(it.sample)
        return s


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
            if r.state != "running" or r.in_flight:
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


def predicted_peak_tokens(entries: Iterable[tuple[int, int]]) -> int:
    """Peak KV tokens of sequences ``(current_len, remaining_predicted)`` decoded together.

    At future step ``m`` the sequences still alive (``remaining >= m``) hold
    ``current_len + m`` tokens each; the peak is the max over ``m``.
    """
    ents = sorted(entries, key=lambda e: e[1])
    if not ents:
        return 0
    # suffix sums over sequences sorted by remaining length
    n = len(ents)
    suffix_len = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_len[i] = suffix_len[i + 1] + ents[i][0]
    best = suffix_len[0]  # m = 0
    for i, (_, rem) in enumerate(ents):
        alive = n - i  # sequences with remaining >= rem
        best = max(best, suffix_len[i] + alive * rem)
    return best


def predicted_peak_blocks(entries: Iterable[tuple[int, int]], block_size: int) -> int:
    """Peak KV blocks of sequences ``(current_len, remaining_predicted)`` decoded together.

    Like :func:`predicted_peak_tokens` but in whole blocks per sequence: at future step
    ``m`` each sequence still alive (``remaining >= m``) holds ``ceil((current_len + m) /
    block_size)`` blocks. The peak is at ``m = 0`` or just before a sequence finishes.
    """
    a = np.asarray(list(entries), dtype=np.int64).reshape(-1, 2)
    if not len(a):
        return 0
    cur, rem = a[:, :1], a[:, 1:]
    steps = np.unique(np.concatenate(([0], a[:, 1])))[None, :]
    blocks = (rem >= steps) * (-(-(cur + steps) // block_size))
    return int(blocks.sum(0).max())


class TDPipeScheduler(Scheduler):
    """Temporally-disaggregated pipeline: prefill phases and decode phases."""

    name = "tdpipe"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.prefill_mode = True
        self.decode_count = 0
        self.mode_switches = 0
        self.ref_batch = max(1, self.cfg.max_num_seqs // self.P)

    @property
    def depth(self) -> int:
        """``P`` micro-batches in flight; ``2P`` while prefilling: prefill micro-batches do
        not depend on each other, so queuing more hides the engine round trip (stage 0
        never waits for a result to get its next prompt batch)."""
        return 2 * self.P if self.prefill_mode and self.waiting else self.P

    # -- memory prediction
    def _peak_blocks(self, extra: list[Request]) -> int:
        ents = [(r.total_len, r.remaining_predicted) for r in (*self.running, *extra)]
        return predicted_peak_blocks(ents, self.bm.block_size)

    def _mem_cap(self) -> float:
        return self.cfg.memory_fraction * self.bm.num_blocks

    def _prefill_candidates(self) -> list[Request]:
        """The longest FIFO prefix of the waiting queue whose admission keeps the predicted
        peak KV use under the bound (at least one request when nothing runs).

        The peak only grows with more sequences, so a binary search over the prefix
        length needs ``log2(queue)`` peak evaluations.
        """
        if not self.waiting:
            return []
        queue = list(self.waiting)
        lo, hi = 0, len(queue)  # lo: known to fit
        cap = self._mem_cap()
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._peak_blocks(queue[:mid]) <= cap:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0 and not self.running:
            lo = 1
        return queue[:lo]

    # -- intensity-based switch (c)
    def _decode_rate(self, n: int) -> float:
        """Decode tokens/s with ``n`` running sequences split over ``P`` micro-batches."""
        if n <= 0:
            return 0.0
        per = -(-n // self.P)
        return n / (self.P * self.costs.decode_time(per, self._mean_ctx()))

    def _decode_intensity(self, cands: list[Request]) -> float:
        """Decode throughput now relative to after admitting ``cands`` (<= 1)."""
        b = len(self.running)
        after = self._decode_rate(b + len(cands))
        return self._decode_rate(b) / after if after > 0 else 1.0

    def _mean_ctx(self) -> float:
        if not self.running:
            return 128.0
        return sum(r.total_len for r in self.running) / len(self.running)

    def _prefill_intensity(self, cands: list[Request]) -> float:
        """Useful fraction of a prefill round: its stage work over work + bubbles.

        Switching drains the decode pipeline and refills it: about ``P - 1`` slots of the
        longer of a decode micro-batch and the largest prefill micro-batch are idle.
        """
        c = self.costs
        times = [c.max_stage_time(shape) for shape in self._prefill_shapes(cands)]
        useful = sum(times)
        t_dec = c.decode_time(max(1, len(self.running) // self.P), self._mean_ctx())
        bubble = (self.P - 1) * max(t_dec, max(times))
        return useful / (useful + bubble) if useful > 0 else 0.0

    def _prefill_shapes(self, cands: list[Request]) -> list[BatchShape]:
        """Shapes of the prefill micro-batches ``cands`` would be packed into."""
        shapes: list[BatchShape] = []
        for r in cands:
            n = r.total_len
            s = shapes[-1] if shapes else None
            if (
                s is None
                or s.prefill_tokens + n > self.cfg.max_batched_tokens
                or s.sampled >= self.cfg.max_num_seqs
            ):
                s = BatchShape()
                shapes.append(s)
            s.prefill_tokens += n
            s.prefill_pairs += n * n
            s.sampled += 1
        return shapes

    def update_mode(self) -> None:
        if self.prefill_mode:
            if not self.waiting:
                self.prefill_mode = False
            return
        if not self.waiting:
            return
        if not self.running:
            self._switch(True)
            return
        cands = self._prefill_candidates()
        if not cands:
            return
        if self.costs is None:  # no cost table: switch when memory allows
            self._switch(True)
            return
        if self._decode_intensity(cands) < self._prefill_intensity(cands):
            self._switch(True)

    def _switch(self, prefill: bool) -> None:
        if prefill != self.prefill_mode:
            self.mode_switches += 1
        self.prefill_mode = prefill

    # -- schedule
    def schedule(self) -> MicroBatch | None:
        if self.decode_count % self.P == 0 or not self.running:
            self.update_mode()
        if self.prefill_mode:
            b = self._schedule_prefill()
            if b is not None:
                self.decode_count = 0
                return b
            self._switch(False)
        b = self._schedule_decode()
        if b is None and self.waiting and not any(r.in_flight for r in self.running):
            # the pipeline is empty and decode has nothing to do: prefill now
            self._switch(True)
            b = self._schedule_prefill()
            if b is not None:
                self.decode_count = 0
        return b

    def _schedule_prefill(self) -> MicroBatch | None:
        items: list[Item] = []
        budget = self.cfg.max_batched_tokens
        admissible = len(self._prefill_candidates())
        while self.waiting and len(items) < min(self.cfg.max_num_seqs, admissible):
            r = self.waiting[0]
            n = r.total_len
            if items and n > budget:
                break
            if not self.bm.can_grow(r.rid, n + 1):
                break
            self.waiting.popleft()
            self.bm.grow(r.rid, n)
            self._admit_req(r)
            items.append(Item(r.rid, 0, n, True))
            budget -= n
        return self._make(items, "prefill")

    def _schedule_decode(self) -> MicroBatch | None:
        pool = sorted(
            (r for r in self.running if not r.in_flight and r.total_len - r.num_computed == 1),
            key=lambda x: x.admit_order,
        )
        if not pool:
            return None
        total = len(self.running)
        if self.cfg.work_stealing:
            target = total // self.P + (self.decode_count % self.P < total % self.P)
        else:
            target = len(pool)
        target = max(1, min(target, self.cfg.max_num_seqs))
        items: list[Item] = []
        for r in list(pool):
            if len(items) >= target:
                break
            if r.state != "running":
                continue
            if not self._reserve_decode(r, pool, {it.rid for it in items}):
                break
            items.append(Item(r.rid, r.num_computed, 1, True))
        self.decode_count += 1
        return self._make(items, "decode")


def make_scheduler(
    name: str,
    cfg: SchedulerConfig,
    blocks: BlockManager,
    num_stages: int,
    costs: CostTable | None = None,
) -> Scheduler:
    """Build a scheduler by name (``sequential``, ``interleaved``, ``tdpipe``)."""
    cls = {
        "sequential": SequentialScheduler,
        "interleaved": InterleavedScheduler,
        "tdpipe": TDPipeScheduler,
    }.get(name)
    if cls is None:
        raise ValueError(f"unknown scheduler {name!r} (sequential, interleaved, tdpipe)")
    return cls(cfg, blocks, 1 if name == "sequential" else num_stages, costs)
