"""Request state and the scheduler base class shared by every policy.

:class:`Request` (a request's tokens, KV progress and sampling settings, its
:class:`RequestStatus`), :class:`Item` / :class:`MicroBatch` (what one micro-batch
computes) and :class:`Scheduler` (queueing, admission, completion, preemption by
recompute, stall resolution), which takes the ``serve.scheduler`` section
(:class:`~convergent.serve.config.SchedulerConfig`: budgets and knobs) as it is. The policies are in
:mod:`convergent.serve.scheduler` (sequential, interleaved) and
:mod:`convergent.serve.tdpipe`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from convergent.serve.config import SchedulerConfig
from convergent.serve.costs import BatchShape, CostTable
from convergent.serve.kv_cache import BlockManager
from convergent.serve.sampling import SamplingParams, TokenLogprobs

__all__ = ["Item", "MicroBatch", "Request", "RequestStatus", "Scheduler", "SchedulerConfig"]

MAX_MODEL_LEN = 2048  # serve.engine.max_model_len's default


class RequestStatus(StrEnum):
    """Where a request is: queued, admitted (holding KV), or done (its value is the
    plain string, so JSON and comparisons with ``"finished"`` stay as they were)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request's state. ``tokens = prompt + output``; ``num_computed`` of them are in KV."""

    rid: int
    prompt: list[int]
    max_tokens: int
    predicted_len: int = 0  # predicted output tokens (tdpipe admission)
    stop_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0
    queued_at: float = 0.0  # the scheduler's clock when it last entered the queue
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    state: RequestStatus = RequestStatus.WAITING
    in_flight: bool = False
    finish_reason: str | None = None
    preemptions: int = 0
    admit_order: int = -1
    first_token_time: float | None = None
    finish_time: float | None = None
    # per output token where sampling.logprobs >= 0 (None where the stage sent none)
    token_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # per prompt token where sampling.prompt_logprobs >= 0, filled by the prefill (the
    # first token has none: [None] until the prefill's results arrive)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    error: str | None = None  # why it ended with finish_reason "error"
    retryable: bool = False  # ended by a failure before any of it reached the stages

    @property
    def finished(self) -> bool:
        return self.state == RequestStatus.FINISHED

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


class Scheduler:
    """Common request bookkeeping; subclasses implement :meth:`schedule`.

    ``max_model_len``: prompt + output tokens of one request (the engine's context limit
    without the KV capacity); ``ignore_eos``: requests end only at their ``max_tokens``.
    ``clock`` (seconds; the engine passes ``time.monotonic``) times how long requests wait
    in the queue (``Request.queued_at``; bench/serve/sim.py passes its simulated time);
    without one (unit tests) nothing is timed and TD-Pipe's wait bound is off.
    """

    name = "base"

    def __init__(
        self,
        cfg: SchedulerConfig,
        blocks: BlockManager,
        num_stages: int = 1,
        costs: CostTable | None = None,
        *,
        max_model_len: int = MAX_MODEL_LEN,
        ignore_eos: bool = False,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.cfg = cfg
        self.bm = blocks
        self.P = max(1, num_stages)
        self.costs = costs
        self.max_model_len = max_model_len
        self.ignore_eos = ignore_eos
        self.clock = clock
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
            len(req.prompt) >= self.max_model_len
            or self.bm.blocks_for(len(req.prompt) + 1) > self.bm.num_blocks
        ):
            self._finish(req, "length", None)
            return
        req.queued_at = self.now()
        self.waiting.append(req)

    def now(self) -> float:
        """The scheduler's clock (0.0 without one)."""
        return self.clock() if self.clock is not None else 0.0

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
            if r.state != RequestStatus.RUNNING:
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
            elif not self.ignore_eos and tok in r.stop_ids:
                self._finish(r, "stop", now)
            elif r.total_len >= self.max_model_len:
                self._finish(r, "length", now)
            if r.state == RequestStatus.FINISHED:
                done.append(r)
        return done

    def abort(self, rid: int) -> None:
        r = self.requests.get(rid)
        if r is None or r.state == RequestStatus.FINISHED:
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
        r.state = RequestStatus.FINISHED
        r.finish_reason = reason
        r.finish_time = now
        self.finished.append(r)

    def _admit_req(self, r: Request) -> None:
        r.state = RequestStatus.RUNNING
        r.admit_order = next(self._admit)
        self.running.append(r)

    def _preempt(self, victim: Request) -> None:
        """Free the victim's KV and put it back at the head of the queue (recompute)."""
        self.running.remove(victim)
        self.bm.free(victim.rid)
        victim.num_computed = 0
        victim.state = RequestStatus.WAITING
        victim.preemptions += 1
        self.num_preemptions += 1
        victim.queued_at = self.now()
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
                if v is not r
                and v.rid not in chosen
                and v.state == RequestStatus.RUNNING
                and not v.in_flight
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
