"""Timings of one engine's life: per-stage busy intervals, KV use, per-batch log."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EngineStats"]


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
