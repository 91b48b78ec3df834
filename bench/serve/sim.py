"""Discrete-event replay of the schedulers, driven by a stage cost table.

The same scheduler classes as the real engine decide every micro-batch; the simulator
replaces the stages by their predicted times (:class:`~convergent.serve.costs.CostTable`):
a micro-batch enters stage ``s`` when it left stage ``s-1`` and stage ``s`` is free, and
the engine submits a new one whenever fewer than ``depth`` are in flight — exactly the
engine's rule. Output lengths are taken from the trace (generation ignores EOS), so
token counts are exact and only time is modelled.

:func:`project_gpu` replays a trace with a published-spec GPU cost table (4 stages) for a
projection next to the TD-Pipe paper's reported speed-ups (:data:`PAPER_FIGURES`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from convergent.serve.costs import CostTable
from convergent.serve.kv_cache import BlockManager
from convergent.serve.scheduler import Request, SchedulerConfig, make_scheduler
from convergent.serve.scheduler_base import MAX_MODEL_LEN

__all__ = ["SimResult", "simulate", "project_gpu", "PAPER_FIGURES"]

# What the paper reports (arXiv 2506.10470, abstract): up to these throughput ratios.
PAPER_FIGURES = {
    "source": "Zhang et al., TD-Pipe, ICPP'25 (arXiv 2506.10470), abstract",
    "tdpipe_over_pipeline_parallel_max": 2.73,
    "tdpipe_over_tensor_parallel_max": 1.91,
    "setting": "PCIe GPU nodes (L20 / A100-class), Llama-2-13B/70B-class models, ShareGPT",
}


@dataclass
class SimResult:
    scheduler: str
    makespan_s: float
    output_tokens: int
    input_tokens: int
    requests: int
    busy_s: list[float] = field(default_factory=list)
    micro_batches: int = 0
    kv_peak_blocks: int = 0
    preemptions: int = 0
    kv_timeline: list[tuple[float, int]] = field(default_factory=list)
    engine_s: float = 0.0  # scheduler decision time charged to the engine (time_decisions)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s

    def to_dict(self) -> dict:
        return {
            "scheduler": self.scheduler,
            "makespan_s": self.makespan_s,
            "output_tok_s": self.output_tok_s,
            "total_tok_s": (self.output_tokens + self.input_tokens) / self.makespan_s,
            "req_s": self.requests / self.makespan_s,
            "busy_fraction": [b / self.makespan_s for b in self.busy_s],
            "micro_batches": self.micro_batches,
            "kv_peak_blocks": self.kv_peak_blocks,
            "preemptions": self.preemptions,
            "engine_s": self.engine_s,
        }


def _stage_turnaround(costs: CostTable, p: int) -> list[float]:
    """Per-stage turnaround of the table; one mean value per stage for a table of another split."""
    turn = list(costs.turnaround or [0.0] * p)
    if len(turn) != p:  # a table of another stage split: one mean value for every stage
        turn = [sum(turn) / len(turn)] * p
    return turn


@dataclass
class _Replay:
    """The simulated clock of one replay: engine time, stage occupancy, micro-batches in flight."""

    sched: Any
    bm: BlockManager
    costs: CostTable
    engine_overhead: float
    wall: Callable[[], float] | None  # times the scheduler's decisions (time_decisions)
    p: int
    turn: list[float]
    t: float = 0.0
    engine_s: float = 0.0
    n_batches: int = 0
    stage_free: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    heap: list[tuple[float, int]] = field(default_factory=list)
    inflight: dict[int, object] = field(default_factory=dict)
    timeline: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stage_free = [0.0] * self.p
        self.busy = [0.0] * self.p

    def decide(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a scheduler method, charging its wall time to the engine when timed."""
        t0 = self.wall() if self.wall else 0.0
        out = fn(*args)
        if self.wall:
            dt = self.wall() - t0
            self.t += dt
            self.engine_s += dt
        return out

    def launch(self, b: Any) -> None:
        """Send a micro-batch through the stages and schedule its return to the engine."""
        costs = self.costs
        self.n_batches += 1
        shape = self.sched.batch_shape(b)
        ts = self.t + self.engine_overhead + costs.dispatch
        for s in range(self.p):
            if s > 0:
                ts += costs.hop
            start = max(ts, self.stage_free[s] + self.turn[s])
            dur = costs.stage_time(shape, s)
            self.stage_free[s] = start + dur
            self.busy[s] += dur
            ts = start + dur
        self.inflight[b.bid] = b
        heapq.heappush(self.heap, (ts + costs.ret, b.bid))
        self.timeline.append((self.t, self.bm.num_used))

    def fill(self) -> None:
        """Submit micro-batches while fewer than the scheduler's depth are in flight."""
        while len(self.inflight) < self.sched.depth:
            b = self.decide(self.sched.schedule)
            if b is None:
                break
            self.launch(b)

    def retire(self) -> None:
        """Complete the micro-batch that returns first."""
        t_done, bid = heapq.heappop(self.heap)
        self.t = max(self.t, t_done)  # the engine may still be busy deciding
        b = self.inflight.pop(bid)
        self.decide(self.sched.complete, b, {it.rid: -1 for it in b.items if it.sample}, self.t)
        self.timeline.append((self.t, self.bm.num_used))

    def run(self) -> None:
        """Replay until every request is finished (or the scheduler cannot go on)."""
        sched = self.sched
        while sched.has_unfinished() or self.inflight:
            self.fill()
            if not self.inflight:
                if sched.resolve_stall() is None:
                    break
                continue
            self.retire()


def simulate(
    scheduler: str,
    requests: list[tuple[int, int, int]],
    costs: CostTable,
    num_blocks: int,
    block_size: int = 16,
    cfg: SchedulerConfig | None = None,
    engine_overhead: float = 0.0,
    time_decisions: bool = False,
    max_model_len: int = MAX_MODEL_LEN,
) -> SimResult:
    """Replay ``requests`` = ``[(input_len, output_len, predicted_len), ...]`` (all at t=0).

    ``costs.layers_per_stage`` sets the number of stages (``sequential`` sums them into
    one stage). Returns makespan, busy time per stage and KV peak.

    The engine is one thread: a finished micro-batch reaches it ``costs.ret`` seconds
    after the last stage ends, and each new micro-batch leaves it ``engine_overhead +
    costs.dispatch`` seconds after its decision. ``time_decisions``: also charge the
    measured wall time of every ``schedule``/``complete`` call of the scheduler (the
    same Python the real engine runs) to the engine's clock.

    ``cfg`` is the ``serve.scheduler`` section (its ``kind`` is set to ``scheduler``);
    ``max_model_len`` is ``serve.engine.max_model_len``. The scheduler reads the simulated
    clock where the engine reads ``time.monotonic``, so TD-Pipe's wait bound
    (``tdpipe_max_wait_s``) forces prefill phases in the replay as it does when served.
    """
    cfg = (cfg or SchedulerConfig()).model_copy(update={"kind": scheduler})
    if scheduler == "sequential" and len(costs.layers_per_stage) > 1:
        costs = costs.with_stages([sum(costs.layers_per_stage)])
        costs.stage_coef = None
    p = len(costs.layers_per_stage)
    bm = BlockManager(num_blocks, block_size)
    # the scheduler reads the simulated clock (TD-Pipe's wait bound, as the engine's
    # time.monotonic); the replay exists before the first request is added
    sched = make_scheduler(
        cfg, bm, p, costs, max_model_len=max_model_len, ignore_eos=True, clock=lambda: rep.t
    )
    wall = time.perf_counter if time_decisions else None
    rep = _Replay(sched, bm, costs, engine_overhead, wall, p, _stage_turnaround(costs, p))
    for i, (n_in, n_out, pred) in enumerate(requests):
        sched.add(Request(i, [0] * n_in, n_out, predicted_len=pred))
    rep.run()
    out_tok = sum(len(r.output) for r in sched.finished)
    in_tok = sum(len(r.prompt) for r in sched.finished)
    return SimResult(
        scheduler,
        max(rep.t, 1e-9),
        out_tok,
        in_tok,
        len(sched.finished),
        rep.busy,
        rep.n_batches,
        bm.peak_used,
        sched.num_preemptions,
        rep.timeline,
        rep.engine_s,
    )


def project_gpu(
    trace_lengths: list[tuple[int, int, int]],
    stages: int = 4,
    kv_gb_per_gpu: float = 20.0,
    cfg: SchedulerConfig | None = None,
) -> dict:
    """Project 4-GPU (L20, Llama-2-13B fp16) throughput of the schedulers from the
    roofline cost table (:func:`~convergent.serve.costs.published_l20_llama2_13b`).

    TD-Pipe runs as served, with ``cfg.tdpipe_max_wait_s`` (1 s by default) bounding a
    queued request's wait on the simulated clock; the paper's TD-Pipe has no such bound."""
    from convergent.serve.costs import published_l20_llama2_13b

    costs = published_l20_llama2_13b(stages)
    kv_per_token = 2 * 40 * 5120 * 2  # bytes, all layers
    block = 16
    num_blocks = int(kv_gb_per_gpu * stages * 1e9 // (kv_per_token * block))
    cfg = cfg or SchedulerConfig(max_num_seqs=256, max_batched_tokens=4096)
    out = {"cost_table": costs.source, "stages": stages, "kv_blocks": num_blocks, "results": {}}
    for name, c in (
        ("interleaved", cfg),
        ("interleaved_chunked", cfg.model_copy(update={"chunked_prefill": True})),
        ("tdpipe", cfg),
    ):
        sch = "interleaved" if name.startswith("interleaved") else name
        out["results"][name] = simulate(sch, trace_lengths, costs, num_blocks, block, c).to_dict()
    base = out["results"]["interleaved"]["output_tok_s"]
    out["tdpipe_over_interleaved"] = out["results"]["tdpipe"]["output_tok_s"] / base
    out["paper"] = PAPER_FIGURES
    return out
