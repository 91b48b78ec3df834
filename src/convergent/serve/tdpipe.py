"""The TD-Pipe scheduler: prefill and decode separated in time (see
:mod:`convergent.serve.scheduler` for the policy), and the predicted peak KV use its
admission is bounded by."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from convergent.serve.costs import BatchShape
from convergent.serve.scheduler_base import Item, MicroBatch, Request, RequestStatus, Scheduler

__all__ = ["TDPipeScheduler", "predicted_peak_blocks", "predicted_peak_tokens"]


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
        self.aged_switches = 0  # switches to prefill forced by the wait bound
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
        return self.cfg.tdpipe_memory_fraction * self.bm.num_blocks

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
        elif self._waited_too_long():
            self.aged_switches += 1
            self._switch(True)
        elif self._decode_intensity(cands) < self._prefill_intensity(cands):
            self._switch(True)

    def _waited_too_long(self) -> bool:
        """The head of the queue has waited ``tdpipe_max_wait_s`` (on the scheduler's clock)."""
        if self.clock is None or not self.waiting:
            return False
        return self.clock() - self.waiting[0].queued_at >= self.cfg.tdpipe_max_wait_s

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
            if r.state != RequestStatus.RUNNING:
                continue
            if not self._reserve_decode(r, pool, {it.rid for it in items}):
                break
            items.append(Item(r.rid, r.num_computed, 1, True))
        self.decode_count += 1
        return self._make(items, "decode")
