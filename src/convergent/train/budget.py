"""A time budget for a training run: ``train.time_budget_s`` seconds of ``train.budget_clock``.

With a budget the run stops after the optimizer step at which the budget is spent
(``train.steps`` is then only a cap), and the LR schedule runs over the budget's fraction
instead of the step count (warm-up stays in steps). This is how equal-time comparisons
train — the benches' sides at equal CPU or GPU seconds — through the one training loop.

Clocks: ``wall`` (time.monotonic; on CUDA kernels still queued at a step's end are counted
at the next step), ``process_cpu`` (every thread of the process: fair on a CPU shared with
other jobs), ``thread_cpu`` (the training thread only: with ``train.threads: 1`` and no
prefetch thread, the CPU time of the model's own work).

Ranks must stop at the same step and use the same learning rate, so with more than one
rank the fraction is all-reduced (max) once per step — one small collective and one host
sync per step, only when a budget is set. The time spent before a resume is carried in
the checkpoint.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
import torch.distributed as dist

Clock = Literal["wall", "process_cpu", "thread_cpu"]
_CLOCKS = {"wall": time.monotonic, "process_cpu": time.process_time,
           "thread_cpu": time.thread_time}


class TimeBudget:
    """The fraction of the budget spent, agreed across ranks at each :meth:`update`;
    ``seconds=None``: no budget (fraction 0, never spent)."""

    def __init__(self, seconds: float | None, clock: Clock = "wall") -> None:
        self.seconds = seconds
        self._now = _CLOCKS[clock]
        self.clock = clock
        self.spent_before = 0.0  # seconds spent by earlier attempts (restored on resume)
        self.fraction = 0.0
        self._t0 = self._now()

    def start(self, spent_before: float = 0.0) -> None:
        """Start counting now, ``spent_before`` seconds already used (a resumed run)."""
        self.spent_before = spent_before
        self._t0 = self._now()

    def elapsed(self) -> float:
        return self.spent_before + self._now() - self._t0

    def update(self, device: torch.device) -> None:
        """Measure the fraction spent; with several ranks, the largest of theirs."""
        if self.seconds is None:
            return
        frac = self.elapsed() / self.seconds
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([frac], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            frac = float(t.item())
        self.fraction = frac

    @property
    def spent(self) -> bool:
        return self.seconds is not None and self.fraction >= 1.0

    def state(self) -> dict[str, float | str | None]:
        return {"seconds": self.seconds, "clock": self.clock, "elapsed": self.elapsed()}
