"""Timings of one engine's life (per-stage busy intervals, KV use, per-batch log) and the
snapshots the HTTP layer reads: KV usage, load, serving stats."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EngineLoad", "EngineStats", "KVUsage", "ServingStats"]


@dataclass
class EngineStats:
    """Timings (seconds, monotonic clock) of one engine's life."""

    num_stages: int
    busy: list[list[tuple[float, float]]] = field(default_factory=list)
    kv_timeline: list[tuple[float, int]] = field(default_factory=list)  # (t, used blocks)
    batches: int = 0
    # per micro-batch: bid -> {"submit": t, "shape": [features], "stages": {s: (t0, t1)}}
    batch_log: dict[int, dict] = field(default_factory=dict)
    t_start: float = 0.0
    t_end: float = 0.0
    decide_s: float = 0.0  # engine time in the scheduler's schedule()/complete() calls

    def summary(self, num_blocks: int) -> dict:
        span = max(1e-9, self.t_end - self.t_start)
        per_stage = []
        for s, iv in enumerate(self.busy):
            b = sum(t1 - t0 for t0, t1 in iv)
            per_stage.append(
                {
                    "stage": s,
                    "busy_s": b,
                    "busy_fraction": b / span,
                    "bubble_s": span - b,
                    "batches": len(iv),
                }
            )
        return {
            "wall_s": span,
            "micro_batches": self.batches,
            "stages": per_stage,
            "kv_peak_blocks": max((u for _, u in self.kv_timeline), default=0),
            "kv_blocks": num_blocks,
            "engine_decide_s": self.decide_s,
        }


@dataclass(frozen=True)
class KVUsage:
    """An engine's KV cache in blocks: all of them, in use now, the most ever in use."""

    blocks: int
    used: int
    peak: int

    @property
    def fraction(self) -> float:
        """Blocks in use over all blocks (0 when there are none)."""
        return self.used / max(1, self.blocks)


@dataclass(frozen=True)
class EngineLoad:
    """What the dispatcher routes by (``GET /load``): requests, tokens, KV use."""

    healthy: bool  # accepting requests
    waiting: int  # requests not yet admitted
    running: int  # admitted requests (holding KV)
    queued_tokens: int  # prompt + max_tokens of the waiting requests
    kv_used_fraction: float


@dataclass(frozen=True)
class ServingStats:
    """An online engine's state for ``GET /stats``."""

    scheduler: str
    num_stages: int
    kv_blocks: int
    kv_used_blocks: int
    kv_peak_blocks: int
    kv_budget_bytes: int
    kv_allocated_bytes: int
    context_limit: int  # tokens (prompt + output) of one request
    preemptions: int
    restarts: int
    last_failure: str | None
