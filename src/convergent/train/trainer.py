"""The training loop (one process of a torchrun job, or a plain single process).

One optimizer step:

1. **data** — this rank's micro-batches of the global batch (``data_wait_s``);
2. **forward/backward** per micro-step under autocast, gradient sync skipped on all
   but the last micro-step (``no_sync`` / FSDP ``set_requires_gradient_sync``);
   ``compute_s`` is forward+backward minus the exposed communication ``comm_s``
   (DDP: time from the last gradient bucket being ready to ``backward()`` returning;
   FSDP/HSDP/pipeline: time the training thread is blocked in all-gathers,
   reduce-scatters and pipeline send/recv waits, :mod:`convergent.monitor.commtime` —
   such time inside the optimizer section, e.g. the sharded gradient-norm reduction,
   moves to ``comm_s`` as well), so data wait + compute + comm + optimizer = step;
3. **optimizer** — unscale (fp16), clip, step, LR schedule (``optimizer_s``);
4. metrics to metrics.jsonl / TensorBoard / Prometheus (rank 0; the cross-rank sums of
   ``metrics.reduce_every`` steps go in one all-reduce, outside the timed step),
   validation and DCP checkpoints at their intervals (and at the end).

Throughput and MFU are global: samples (molecules or sequences) and units (atoms or
tokens) of the global batch per second; MFU = counted model FLOPs of the step / step
time / (peak FLOP/s per process x processes).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from contextlib import nullcontext as _null
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from convergent.cluster.placement import placement_record
from convergent.monitor import commtime
from convergent.monitor.flops import Peak, count_flops, device_peak
from convergent.monitor.sinks import MetricSinks
from convergent.monitor.timers import StepTimer, peak_memory_bytes
from convergent.runsdb.records import next_attempt
from convergent.runsdb.trainrecords import TrainStep, ValRecord
from convergent.train import precision
from convergent.train.affinity import ranks_record
from convergent.train.budget import TimeBudget
from convergent.train.checkpoint import CheckpointManager, latest_checkpoint
from convergent.train.ema import WeightAverage
from convergent.train.parallel import Parallelized, clip_grad_norm, parallelize
from convergent.train.preempt import Preempted, Preemption
from convergent.train.prefetch import Prefetcher
from convergent.train.runtime import lr_lambda, maybe_fault, param_groups, pick_device
from convergent.train.steplog import StepLog, reduce_sums
from convergent.train.taskapi import MicroBatch, Task
from convergent.train.tasks import make_task

if TYPE_CHECKING:
    from convergent.config import ConvergentConfig
    from convergent.runsdb.rundir import RunDir


log = logging.getLogger("convergent.train")

class Trainer:
    """Builds everything from the config and runs ``train.steps`` optimizer steps."""

    def __init__(self, cfg: ConvergentConfig, run: RunDir) -> None:
        self.cfg = cfg
        self.run = run
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = pick_device(cfg.train.device, local_rank, cfg.train.tf32)
        # launches of this run so far (a resume or an elastic restart is a new attempt);
        # readers keep the last attempt of a step that a resumed job replayed
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.rank == 0:
            self.attempt = max(self.attempt, next_attempt(run.metrics))
        torch.manual_seed(cfg.train.seed)
        self.task: Task = make_task(cfg)
        torch.manual_seed(cfg.train.seed)
        model = self.task.build_model().to(self.device)
        self.flops_per_unit = self._count_flops(model) if cfg.metrics.mfu else None
        self.par: Parallelized = parallelize(model, self.task, cfg, self.device)
        self.comm_clock = commtime.install(self.par.strategy) if self.world > 1 else None
        t = cfg.train
        self.optims = [
            torch.optim.AdamW(
                param_groups(p, t.lr, t.param_lr), lr=t.lr, weight_decay=t.weight_decay,
                **_adamw_kernel(self.device, self.par.strategy),
            )
            for p in self.par.parts
        ]
        self.ema = WeightAverage(self.par.parts, t.ema_decay) if t.ema_decay > 0 else None
        self.budget = TimeBudget(t.time_budget_s, t.budget_clock)
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(cfg, self.budget))
                       for o in self.optims]
        self.scaler = precision.grad_scaler(
            cfg.precision.dtype, self.device.type, cfg.precision.init_scale
        )
        self.ckpt = CheckpointManager(
            run.ckpt, cfg.checkpoint.keep, cfg.checkpoint.async_save, self.rank, self.world
        )
        self.start_step = 0
        self.resumed_from: str | None = None
        if cfg.checkpoint.resume:
            self._resume()
        self.sinks = None
        if self.rank == 0:
            self.sinks = MetricSinks(
                jsonl=run.metrics,
                tensorboard_dir=(run.logs / "tensorboard") if cfg.metrics.tensorboard else None,
                prometheus_port=cfg.metrics.prometheus_port,
                mlflow=(cfg, run.path) if cfg.tracking.mlflow else None,
            )
        self.placement = placement_record(
            self.device, dist.get_backend() if dist.is_initialized() else None, self.world,
            cfg.precision.dtype, cfg.train.tf32,
        )
        if self.sinks is not None and self.start_step == 0:
            self.sinks.write(self.placement)
            if self.par.comm_plan is not None:  # the gradient all-reduce algorithm chosen
                self.sinks.write(self.par.comm_plan)
        ranks = ranks_record(self.par.mesh)  # collective: every rank
        if self.sinks is not None:
            self.sinks.write(ranks)
        self.preempt = Preemption.from_env()
        peak = (device_peak(self.device, cfg.precision.dtype, cfg.metrics.peak_flops)
                if cfg.metrics.mfu else Peak(None, "off"))
        self.timer = StepTimer(self.device)
        # per-step sums are reduced across ranks in batches of metrics.reduce_every steps
        # (and before validation / checkpoints / the end): no collective in every step
        self.steps = StepLog(self.task, self.sinks, self.device, self.world,
                             self.flops_per_unit, peak, cfg.train.steps, cfg.metrics.log_every)
        self.val_history: list[ValRecord] = []

    @property
    def history(self) -> list[TrainStep]:
        """The written train_step records (``to_dict`` gives their metrics.jsonl lines)."""
        return list(self.steps.history)

    # -- setup helpers

    def _count_flops(self, model: torch.nn.Module) -> float | None:
        """FLOPs per atom/token of one training micro-step, counted on a model copy."""
        try:
            rng = torch.get_rng_state()
            mb = self.task.micro_batches(0, 0, 1, 1)[0]
            mb = self.task.to(mb, self.device)
            clone = copy.deepcopy(model)

            def step() -> None:
                with precision.autocast(self.cfg.precision.dtype, self.device.type):
                    loss, _ = self.task.loss(clone, mb, 1)
                loss.backward()

            _, flops = count_flops(step)
            clone = None  # free the copy
            torch.set_rng_state(rng)
            return flops / max(mb.units, 1)
        except Exception as exc:  # noqa: BLE001 - MFU is optional, training is not
            log.warning("FLOP counting failed (%s); MFU will be null", exc)
            return None

    def _resume(self) -> None:
        path = latest_checkpoint(self.run.ckpt) if self.rank == 0 else None
        box = [str(path) if path else None]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        extra = self.ckpt.load(Path(box[0]), self.par.parts, self.optims)
        self.start_step = int(extra["step"])
        self.budget.spent_before = float((extra.get("budget") or {}).get("elapsed") or 0.0)
        for s, sd in zip(self.scheds, extra["schedulers"], strict=True):
            s.load_state_dict(sd)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        comp = (extra.get("local") or {}).get("compression")
        if comp is not None and hasattr(self.par.hook_state, "load_state_dict"):
            self.par.hook_state.load_state_dict(comp)
        self.resumed_from = box[0]
        log.info("resumed from %s at step %d", box[0], self.start_step)

    def _extra(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "schedulers": [s.state_dict() for s in self.scheds],
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "data": {"step": step, "seed": self.cfg.train.seed},  # global plan position
            "strategy": self.cfg.parallel.strategy,
            "world": self.world,
            "budget": self.budget.state(),
        }

    def _local(self) -> dict[str, Any]:
        """This rank's own checkpoint state: gradient-compression error feedback."""
        hs = self.par.hook_state
        return {"compression": hs.state_dict() if hasattr(hs, "state_dict") else None}

    def _comm_clock(self) -> float:
        """Seconds blocked in communication so far (FSDP/HSDP/pipeline; else 0)."""
        return self.comm_clock.seconds if self.comm_clock is not None else 0.0

    # -- one step

    def _forward_backward(self, mbs: list[MicroBatch]) -> dict[str, float]:
        par, task, cfg = self.par, self.task, self.cfg
        sums: dict[str, float] = {}
        on_device = self.timer.on_device  # CUDA: event-timed, nothing synchronised
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            with par.no_sync(not last), self.timer.section("compute") if on_device else _null():
                t0 = time.perf_counter()
                with precision.autocast(cfg.precision.dtype, self.device.type, par.autocast):
                    loss, stats = task.loss(par.forward_model, mb, par.loss_scale)
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
                t1 = time.perf_counter()
            if not on_device:
                exposed = 0.0
                if last and par.comm.last_ready is not None:
                    exposed = max(0.0, t1 - max(par.comm.last_ready, t0))
                self.timer.add("compute", (t1 - t0) - exposed)
                self.timer.add("comm", exposed)
            for k, v in stats.items():  # float64 sums; GPU tensors stay on the GPU
                cuda = isinstance(v, torch.Tensor) and v.device.type == "cuda"
                v = v.detach().double() if cuda else float(v)
                sums[k] = sums[k] + v if k in sums else v
            sums["samples"] = sums.get("samples", 0.0) + mb.samples
            sums["units"] = sums.get("units", 0.0) + mb.units
        return sums

    def _pipeline_step(self, mbs: list[MicroBatch]) -> dict[str, float]:
        sums: dict[str, float] = {}
        t0 = time.perf_counter()
        for mb in mbs:
            for k, v in self._pipeline_run(mb, training=True).items():
                sums[k] = sums.get(k, 0.0) + v
        self.timer.add("compute", time.perf_counter() - t0)
        return sums

    def _pipeline_run(self, mb: MicroBatch, training: bool) -> dict[str, float]:
        """Run ``mb`` through the schedule (``step`` or ``eval``); its sum statistics."""
        par, task = self.par, self.task
        first = 0 in par.stage_ids
        last = par.n_stages - 1 in par.stage_ids
        losses: list[torch.Tensor] = []  # per micro-batch, from the last stage
        for args, target in task.pipeline_rounds(mb, par.hook_state, training):
            kwargs: dict[str, Any] = {"target": target, "losses": []} if last else {}
            with precision.autocast(self.cfg.precision.dtype, self.device.type):
                if training:
                    par.schedule.step(*(args if first else ()), **kwargs)
                else:
                    with torch.no_grad():
                        par.schedule.eval(*(args if first else ()), **kwargs)
            losses += kwargs.get("losses", [])
        return task.pipeline_sums(par.hook_state, mb, last, losses)

    def _optimizer_step(self) -> float | torch.Tensor:
        with self.timer.section("optimizer"):
            if self.scaler is not None:
                for o in self.optims:
                    self.scaler.unscale_(o)
            norm = clip_grad_norm(self.par, self.cfg.train.grad_clip)
            for o in self.optims:
                if self.scaler is not None:
                    self.scaler.step(o)
                else:
                    o.step()
                o.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()
            for s in self.scheds:
                s.step()
        return norm

    def validate(self, step: int) -> ValRecord | None:
        """Validation metrics over the held-out set (all ranks share the batches)."""
        mbs = self.task.val_batches(self.par.dp_rank, self.par.dp_world)
        if self.par.strategy == "pipeline":
            return self._pipeline_validate(step)
        if not mbs and self.task.kind == "molecular" and self.task.val is None:
            return None
        model = self.par.parts[0] if self.par.strategy == "ddp" else self.par.forward_model
        sums: dict[str, float] = {}
        n = len(mbs)
        if self.par.fsdp and dist.is_initialized():
            # sharded forwards are collective: every rank runs the same number of them
            t = torch.tensor([n])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            n = int(t)
        filler = mbs[0] if mbs else (self.task.val_batches(0, 1) or [None])[0]
        for i in range(n):
            mb = self.task.to(mbs[i] if i < len(mbs) else filler, self.device)
            with precision.autocast(self.cfg.precision.dtype, self.device.type, self.par.autocast):
                stats = self.task.val_stats(model, mb)
            if i >= len(mbs):
                continue  # padding forward, not counted
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        sums = reduce_sums(sums, list(self.task.stat_keys))
        return self._val_record(step, sums)

    def _pipeline_validate(self, step: int) -> ValRecord | None:
        mbs = self.task.val_batches(0, 1)  # every stage sees every validation batch
        if not mbs:
            return None
        sums: dict[str, float] = {}
        for mb in mbs:
            for k, v in self._pipeline_run(self.task.to(mb, self.device), training=False).items():
                sums[k] = sums.get(k, 0.0) + v
        return self._val_record(step, reduce_sums(sums, sorted(sums)))

    def _val_record(self, step: int, sums: dict[str, float]) -> ValRecord:
        rec = ValRecord(step=step, attempt=self.attempt)
        rec.set_metrics(self.task.finalize_stats(sums))
        return rec

    # -- the loop

    def train(self) -> dict[str, Any]:
        cfg, task, par = self.cfg, self.task, self.par
        t_start = time.time()
        steps = cfg.train.steps
        accum = 1 if par.strategy == "pipeline" else cfg.train.grad_accum
        last_ckpt = self.start_step
        feed = Prefetcher(
            lambda s: task.micro_batches(s, par.dp_rank, par.dp_world, accum),
            range(self.start_step, steps), self.device, cfg.train.prefetch,
        )
        self.budget.start(self.budget.spent_before)
        try:
            return self._loop(feed, t_start, steps, last_ckpt)
        finally:
            feed.close()

    def _step(self, feed: Prefetcher, step: int, steps: int) -> bool:
        """One optimizer step: data, forward/backward, optimizer, EMA, its record; whether
        it is the last (``train.steps`` reached or the time budget spent)."""
        par = self.par
        maybe_fault(self.rank, step)
        self.timer.reset()
        start_time = time.time()
        par.comm.reset()
        with self.timer.section("data_wait"):  # CUDA: the time the device waited
            mbs = feed.get(step)
        blocked = self._comm_clock()
        if par.strategy == "pipeline":
            sums = self._pipeline_step(mbs)
        else:
            sums = self._forward_backward(mbs)
        feed.ahead()  # the next batch's copy overlaps this step's GPU work
        self.timer.move("compute", "comm", self._comm_clock() - blocked)
        lr = self.scheds[0].get_last_lr()[0]
        self.budget.update(self.device)  # before the schedule's step reads its fraction
        blocked = self._comm_clock()
        grad_norm = self._optimizer_step()
        self.timer.move("optimizer", "comm", self._comm_clock() - blocked)
        final = step + 1 == steps or self.budget.spent
        if self.ema is not None:
            self.ema.update(step)
            if final:
                self.ema.install()  # the final checkpoint and export are the average
        timing = self.timer.snapshot()  # resolved when the record is written
        rec = TrainStep(
            step=step + 1, attempt=self.attempt, lr=lr,
            grad_norm=grad_norm,  # type: ignore[arg-type]  # a device tensor until written
            start_time=start_time,  # unix s at step start (wall-clock throughput)
            peak_mem_bytes=peak_memory_bytes(self.device),
            # gradient payload counted by the DDP comm hook (None: not instrumented)
            comm_bytes=par.comm.bytes if par.strategy == "ddp" else None,
            strategy=par.strategy, world=self.world,
            loss_scale=float(self.scaler.get_scale()) if self.scaler is not None else None,
        )
        self.steps.add(sums, rec, timing)
        return final

    def _after_step(self, done: int, final: bool) -> bool:
        """Metrics flush, validation, checkpoint and preemption after step ``done``;
        whether a checkpoint was saved. Raises :class:`Preempted` when asked to stop."""
        cfg, par = self.cfg, self.par
        val_every = cfg.train.val_every
        is_val = final or (val_every and done % val_every == 0)
        is_ckpt = (final and cfg.checkpoint.at_end) or bool(
            cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0)
        if is_val or is_ckpt or len(self.steps.pending) >= max(1, cfg.metrics.reduce_every):
            self.steps.flush()
        if is_val:
            vrec = self.validate(done)
            if vrec is not None:
                self.val_history.append(vrec)
                if self.sinks is not None:
                    self.sinks.write(vrec.to_dict())
        if is_ckpt:
            self.ckpt.save(done, par.parts, self.optims, self._extra(done), self._local())
            if self.sinks is not None:
                self.sinks.commit(done)  # steps up to here are never replayed
        if not final and self.preempt.requested():  # collective when enabled
            self.steps.flush()
            if not is_ckpt:
                self.ckpt.save(done, par.parts, self.optims, self._extra(done), self._local())
            self.ckpt.wait()
            if self.sinks is not None:
                self.sinks.write({"kind": "train.preempted", "step": done,
                                  "signal": self.preempt.signal_name})
                self.sinks.close()
            raise Preempted(done)
        return is_ckpt

    def _loop(self, feed: Prefetcher, t_start: float, steps: int, last_ckpt: int) -> dict[str, Any]:
        done = self.start_step
        for step in range(self.start_step, steps):
            final = self._step(feed, step, steps)
            done = step + 1
            if self._after_step(done, final):
                last_ckpt = done
            if final:
                break
        self.steps.flush()
        self.ckpt.wait()
        if self.sinks is not None:
            self.sinks.close()
        return {
            "steps": done,
            "start_step": self.start_step,
            "budget": self.budget.state() if self.budget.seconds is not None else None,
            "resumed_from": self.resumed_from,
            "last_checkpoint": str(self.ckpt.path_for(self.run.ckpt, last_ckpt)),
            "seconds": time.time() - t_start,
            "final": self.history[-1].to_dict() if self.history else None,
            "val": self.val_history[-1].to_dict() if self.val_history else None,
            "world": self.world,
            "strategy": self.par.strategy,
            "placement": self.placement,
        }


def _adamw_kernel(device: torch.device, strategy: str) -> dict[str, bool]:
    """AdamW's implementation: on CUDA the fused kernel (one launch for every parameter)
    where the parameters are plain tensors, foreach (one kernel per op group) where FSDP
    shards them; the per-parameter loop on the CPU."""
    if device.type != "cuda":
        return {}
    return {"fused": True} if strategy in ("single", "ddp") else {"foreach": True}
