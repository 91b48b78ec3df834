"""Per-step metrics of the training loop: cross-rank sums to typed records to the sinks.

Each step leaves its sum statistics (floats, or float64 0-d tensors still on the device
so the step never waits for them) and the rest of its record with :meth:`StepLog.add`;
:meth:`StepLog.flush` reduces the pending steps' sums across ranks in one all-reduce
(``metrics.reduce_every`` steps at a time, and before validation, checkpoints and the
end), completes each :class:`~convergent.runsdb.trainrecords.TrainStep` and writes it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from convergent.monitor.flops import Peak, mfu
from convergent.monitor.timers import StepTiming
from convergent.runsdb.trainrecords import TIME_PARTS, TrainStep
from convergent.train.taskapi import Task

log = logging.getLogger("convergent.train")


def stats_rows(rows: list[list[Any]]) -> torch.Tensor:
    """Steps' sums (floats, or float64 0-d tensors left on the device so that the step
    never waits for them) as one float64 CPU matrix: a single device->host copy."""
    dev = [v for r in rows for v in r if isinstance(v, torch.Tensor)]
    vals = iter(torch.stack(dev).cpu().tolist()) if dev else iter(())
    return torch.tensor(
        [[next(vals) if isinstance(v, torch.Tensor) else float(v) for v in r] for r in rows],
        dtype=torch.float64,
    )


def reduce_sums(sums: dict[str, float], keys: list[str]) -> dict[str, float]:
    """``sums[keys]`` added over all ranks (missing keys count 0)."""
    t = torch.tensor([float(sums.get(k, 0.0)) for k in keys], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return dict(zip(keys, t.tolist(), strict=True))


class StepLog:
    """Pending steps of rank 0's (and every rank's share of the) metrics.

    ``flops_per_unit``/``peak`` give the MFU (None: not counted); ``sinks`` is None off
    rank 0, where :meth:`flush` still joins the all-reduce.
    """

    def __init__(self, task: Task, sinks: Any, device: torch.device, world: int,
                 flops_per_unit: float | None, peak: Peak, steps: int,
                 log_every: int) -> None:
        self.task, self.sinks, self.device, self.world = task, sinks, device, world
        self.flops_per_unit, self.peak = flops_per_unit, peak
        self.steps, self.log_every = steps, max(1, log_every)
        self.sum_keys: list[str] | None = None
        self.pending: list[tuple[list[Any], TrainStep, StepTiming]] = []
        self.history: list[TrainStep] = []

    def add(self, sums: dict[str, Any], rec: TrainStep, timing: StepTiming) -> None:
        """One step's sums and record (times resolved and throughput filled at flush)."""
        if self.sum_keys is None:
            self.sum_keys = sorted(sums)
        self.pending.append(([sums.get(k, 0.0) for k in self.sum_keys], rec, timing))

    def flush(self) -> None:
        """Reduce the pending steps' sums in one all-reduce and write their records."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        stats = stats_rows([row for row, _, _ in pending])
        if dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                stats = stats.to(self.device)
            dist.all_reduce(stats)
            stats = stats.cpu()
        assert self.sum_keys is not None
        for row, (_, rec, timing) in zip(stats.tolist(), pending, strict=True):
            self._write(dict(zip(self.sum_keys, row, strict=True)), rec, timing)

    def _write(self, tot: dict[str, float], rec: TrainStep, timing: StepTiming) -> None:
        """Complete one step's record from its global sums and send it to the sinks."""
        task = self.task
        times = timing.resolve()
        step_s = times["step_s"]
        for key in TIME_PARTS:
            setattr(rec, key, times.get(key.removesuffix("_s"), 0.0))
        rec.step_s = step_s
        rec.grad_norm = float(rec.grad_norm) if rec.grad_norm is not None else None
        rec.set_metrics(task.finalize_stats(tot))
        rec.samples_per_s = tot["samples"] / step_s
        rec.unit, rec.units_per_s = task.unit, tot["units"] / step_s
        rec.mfu = (mfu(self.flops_per_unit * tot["units"], step_s, (self.peak.flops or 0.0) * self.world)
                   if self.flops_per_unit else None)
        rec.peak_flops, rec.peak_source = self.peak.flops, self.peak.source
        self.history.append(rec)
        if self.sinks is None:
            return
        self.sinks.write(rec.to_dict())
        if rec.step % self.log_every == 0 or rec.step == self.steps:
            log.info(
                "step %d/%d loss %.5g %s/s %.0f mfu %s",
                rec.step, self.steps, rec.loss, task.unit, rec.units_per_s,
                f"{rec.mfu:.3%}" if rec.mfu is not None else "n/a",
            )
