"""Parallelisms applied by small functions to a plain model (one per strategy).

* ``single``   — the model as is (one process, or every rank alone: no gradient sync).
* ``ddp``      — ``DistributedDataParallel`` + an instrumented comm hook
  (:mod:`convergent.train.compression`).
* ``fsdp``     — FSDP2 ``fully_shard`` on every block, on fp32-kept modules and at the
  root, over a 1-D mesh of all ranks; ``reshard_after_forward`` configurable.
* ``hsdp``     — the same on a 2-D ``DeviceMesh`` (replicate x shard) whose shard groups
  follow the node/rack topology (:mod:`convergent.train.topology`).

  Force training (the molecular task) needs a double backward, which FSDP2's hooks do
  not support (they free unsharded parameters after the first backward); for it the
  ``fully_shard``'ed parameters are gathered explicitly (:class:`GatheredForward`):
  sharded storage, sharded optimizer state and checkpoints are the same, the gradient
  reduce-scatter happens in every micro-step, and precision comes from autocast (the
  MixedPrecisionPolicy applies to the hook path used by the LM).
* ``pipeline`` — ``torch.distributed.pipelining``: the model's blocks are cut into
  stages (one per rank, or ``stages_per_rank`` per rank for the interleaved schedule),
  micro-batched with GPipe, 1F1B or interleaved 1F1B. The molecular model needs
  ``model.forces: direct`` for it (no double backward; fixed-shape padded micro-batches,
  :mod:`convergent.train.molpipe`).

Each returns a :class:`Parallelized` with the data-parallel rank/world the task uses to
pick its share of the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from convergent.core.errors import ConfigError
from convergent.train import hierarchy, precision
from convergent.train.compression import CommStats, register_compression
from convergent.train.taskapi import Task, find_blocks
from convergent.train.tasks import check_pipeline
from convergent.train.topology import gather_hostnames, group_ranks, read_topology_file

if TYPE_CHECKING:
    from convergent.config import ConvergentConfig
    from convergent.train.config import ParallelConfig


@dataclass
class Parallelized:
    """A model prepared for one strategy."""

    strategy: str
    forward_model: nn.Module  # what the loss calls (DDP wrapper, FSDP root, plain)
    parts: list[nn.Module]  # local model parts holding parameters (state dicts)
    dp_rank: int = 0
    dp_world: int = 1
    autocast: bool = True  # False when FSDP2's policy handles precision
    comm: CommStats = field(default_factory=CommStats)
    hook_state: Any = None
    schedule: Any = None  # pipeline schedule
    stage_ids: list[int] = field(default_factory=list)
    n_stages: int = 1
    mesh: Any = None
    fsdp: bool = False
    loss_world: int | None = None  # factor the task multiplies losses by (None: dp_world)
    comm_plan: dict[str, Any] | None = None  # DDP: the all-reduce algorithm record

    @property
    def loss_scale(self) -> int:
        return self.dp_world if self.loss_world is None else self.loss_world

    @contextlib.contextmanager
    def no_sync(self, active: bool) -> Iterator[None]:
        """Skip gradient synchronisation for a non-final micro-step when ``active``."""
        if not active:
            yield
            return
        if self.strategy == "ddp":
            with self.forward_model.no_sync():
                yield
        elif self.fsdp and isinstance(self.forward_model, GatheredForward):
            yield  # gradients reduce-scatter in each micro-step on this path
        elif self.fsdp:
            self.forward_model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.forward_model.set_requires_gradient_sync(True)
        else:
            yield

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.parts for p in m.parameters()]


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each block's activations in backward (non-reentrant); returns count."""
    from torch.utils.checkpoint import checkpoint

    blocks = find_blocks(model)
    for _, blk in blocks:
        orig = blk.forward

        def fwd(*args: Any, __orig: Any = orig, **kwargs: Any) -> Any:
            return checkpoint(__orig, *args, use_reentrant=False, **kwargs)

        blk.forward = fwd
    return len(blocks)


def compile_mode(cfg: ConvergentConfig, task: Task, device: torch.device, strategy: str) -> str:
    """``train.compile`` resolved: ``auto`` is ``model`` for a task without a double
    backward on CUDA, else ``off``; ``model`` under pipeline parallelism (each stage holds
    a slice) compiles its blocks."""
    mode = cfg.train.compile
    if mode == "auto":
        mode = "model" if device.type == "cuda" and not getattr(task, "double_backward", False) else "off"
    return "blocks" if mode == "model" and strategy == "pipeline" else mode


def apply_compile(model: nn.Module, mode: str = "blocks") -> int:
    """torch.compile in place: each block (``blocks``) or the whole model (``model``);
    returns how many modules were compiled. A graph that fails to compile falls back to
    eager (dynamo's ``suppress_errors``, which logs the failure once) rather than ending
    the run."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    if mode == "model":
        model.compile()
        return 1
    blocks = find_blocks(model)
    for _, blk in blocks:
        blk.compile()
    return len(blocks)


def apply_fsdp(
    model: nn.Module, mesh: Any, pcfg: ParallelConfig, prec: Any, keep: list[str]
) -> nn.Module:
    """FSDP2: fp32-kept modules, then each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    policy = precision.fsdp_policy(prec.dtype, prec.reduce_dtype)
    blocks = find_blocks(model)
    block_names = {n for n, _ in blocks}
    if prec.dtype != "fp32":
        for name, mod in precision.kept_modules(model, keep):
            if name in block_names or any(name.startswith(b + ".") for b in block_names):
                continue  # lives inside a block unit; autocast-free fp32 handled by hook
            fully_shard(
                mod, mesh=mesh, reshard_after_forward=pcfg.reshard_after_forward,
                mp_policy=precision.fsdp_fp32_policy(),
            )
    n = len(blocks)
    for i, (_, blk) in enumerate(blocks):
        # the last block is needed right away in backward: keep it unsharded
        reshard = pcfg.reshard_after_forward and i < n - 1
        fully_shard(blk, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=pcfg.reshard_after_forward,
                mp_policy=policy)
    return model


class GatheredForward(nn.Module):
    """Forward of an FSDP2-sharded model through explicit, differentiable all-gathers.

    FSDP2's backward hooks free the unsharded parameters after the first backward, which
    breaks force training (energy -> autograd.grad(positions, create_graph=True) -> loss
    backward through the parameters again). This path keeps the ``fully_shard``'ed
    DTensor parameters (sharded storage, sharded optimizer state, same checkpoints) but
    never calls the FSDP forward: each step gathers every parameter with
    ``full_tensor(grad_placements=Partial)`` and runs a parameter-free skeleton of the
    model with ``torch.func.functional_call``. The backward of the gather is a
    reduce-scatter (sum) of the gradients into the shards; double backward works
    because nothing is freed behind autograd's back.
    """

    def __init__(self, sharded: nn.Module, skeleton: nn.Module, recompute: bool = False) -> None:
        super().__init__()
        self.sharded = sharded
        self._skeleton = [skeleton]  # hidden from parameters()/state_dict()
        self.recompute = recompute  # checkpoint the whole forward (see parallelize)

    def _call(self, tensors: dict[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
        from torch.func import functional_call

        return functional_call(self._skeleton[0], tensors, args, kwargs, strict=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Partial

        tensors: dict[str, torch.Tensor] = {}
        for name, p in self.sharded.named_parameters():
            if isinstance(p, DTensor):
                p = p.full_tensor(grad_placements=[Partial()] * p.device_mesh.ndim)
            tensors[name] = p
        for name, b in self.sharded.named_buffers():
            tensors[name] = b
        if self.recompute:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._call, tensors, args, kwargs, use_reentrant=False)
        return self._call(tensors, args, kwargs)


def build_hsdp_mesh(device: torch.device, pcfg: ParallelConfig, world: int) -> Any:
    """2-D (replicate, shard) DeviceMesh following the topology."""
    from torch.distributed.device_mesh import DeviceMesh

    topo = read_topology_file(pcfg.topology_file) if pcfg.topology_file else None
    hosts = gather_hostnames()
    layout = group_ranks(world, hosts, pcfg.shard_size, topo, pcfg.topology_level)
    return DeviceMesh(
        device.type, torch.tensor(layout.mesh), mesh_dim_names=("replicate", "shard")
    )


def register_ddp_hook(ddp: Any, pcfg: ParallelConfig, par: Parallelized) -> None:
    """Flat (compressed) or hierarchical gradient all-reduce, per ``parallel.allreduce``."""
    tiers = hierarchy.discover_tiers(pcfg, par.dp_world)
    algo = hierarchy.choose_algorithm(pcfg.allreduce, tiers)
    if algo == "hierarchical":
        par.hook_state = hierarchy.register_hierarchical(ddp, pcfg, par.comm, tiers)
    else:
        par.hook_state = register_compression(ddp, pcfg.compression, pcfg, par.comm)
    par.comm_plan = hierarchy.plan_record(algo, tiers, pcfg)


def parallelize(
    model: nn.Module, task: Task, cfg: ConvergentConfig, device: torch.device
) -> Parallelized:
    """Apply ``cfg.parallel.strategy`` to a plain model already on ``device``."""
    pcfg, prec = cfg.parallel, cfg.precision
    strategy = pcfg.strategy
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    keep = list(prec.keep_fp32)
    if strategy == "pipeline":
        return build_pipeline(model, task, cfg, device, world, rank)
    gathered = strategy in ("fsdp", "hsdp") and world > 1 and getattr(
        task, "double_backward", False
    )
    skeleton = None
    if gathered:  # the skeleton runs the compute; wrappers go on it (see GatheredForward)
        import copy

        skeleton = copy.deepcopy(model).to("meta")
    target = skeleton if skeleton is not None else model
    sharded = strategy in ("fsdp", "hsdp") and world > 1
    if prec.dtype != "fp32" and not sharded:
        precision.keep_in_fp32(model, keep, device.type)
    if cfg.train.activation_checkpointing and not gathered:
        apply_activation_checkpointing(target)
    mode = compile_mode(cfg, task, device, strategy)
    if mode != "off":
        apply_compile(target, mode)
    if strategy == "single" or world == 1:
        return Parallelized("single", model, [model], 0, 1)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=pcfg.bucket_cap_mb,
            broadcast_buffers=False,
        )
        par = Parallelized("ddp", ddp, [model], rank, world)
        register_ddp_hook(ddp, pcfg, par)
        return par
    if strategy in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        if pcfg.compression != "none":
            raise ConfigError(
                f"parallel.compression={pcfg.compression} is for DDP only",
                hint="use parallel.strategy=ddp or compression=none",
            )
        if prec.dtype != "fp32":
            precision.keep_in_fp32(target, keep, device.type)
        if strategy == "fsdp":
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
        else:
            mesh = build_hsdp_mesh(device, pcfg, world)
        if skeleton is not None:
            apply_fsdp(model, mesh, pcfg, prec, keep)
            par = Parallelized(
                strategy,
                GatheredForward(model, skeleton, cfg.train.activation_checkpointing),
                [model], rank, world,
                autocast=True, fsdp=True, loss_world=1,
            )
        else:
            apply_fsdp(model, mesh, pcfg, prec, keep)
            par = Parallelized(strategy, model, [model], rank, world, autocast=True, fsdp=True)
        par.mesh = mesh
        return par
    raise ConfigError(f"unknown parallel.strategy {strategy!r}")


def build_pipeline(
    model: nn.Module, task: Task, cfg: ConvergentConfig, device: torch.device, world: int, rank: int
) -> Parallelized:
    """Cut the model into stages and build the torch.distributed.pipelining schedule."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    pcfg = cfg.parallel
    check_pipeline(cfg)
    if not task.pipeline_capable:
        raise ConfigError(
            f"parallel.strategy=pipeline is not supported for model.kind={cfg.model.kind}"
        )
    per_rank = pcfg.stages_per_rank if pcfg.schedule == "interleaved" else 1
    n_stages = world * per_rank
    stage_ids = [rank + k * world for k in range(per_rank)]  # loop-around placement
    parts, stages = [], []
    for sid in stage_ids:
        mod = task.stage_module(model, sid, n_stages).to(device)
        if cfg.precision.dtype != "fp32":
            precision.keep_in_fp32(mod, list(cfg.precision.keep_fp32), device.type)
        if cfg.train.activation_checkpointing:
            apply_activation_checkpointing(mod)
        parts.append(mod)
        io = task.stage_io(sid, n_stages, device)  # None: metadata inferred at run time
        stages.append(PipelineStage(mod, sid, n_stages, device, *(io or ())))
    del model
    n_micro = pcfg.microbatches
    loss_holder: dict[str, Any] = {}  # per-step state the task's pipeline hooks share

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        return task.pipeline_loss(output, target, loss_holder)

    if pcfg.schedule == "gpipe":
        sched = ScheduleGPipe(stages[0], n_micro, loss_fn=loss_fn, scale_grads=False)
    elif pcfg.schedule == "1f1b":
        sched = Schedule1F1B(stages[0], n_micro, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = ScheduleInterleaved1F1B(stages, n_micro, loss_fn=loss_fn, scale_grads=False)
    par = Parallelized("pipeline", parts[0], parts, 0, 1)
    par.schedule = sched
    par.stage_ids = stage_ids
    par.n_stages = n_stages
    par.hook_state = loss_holder
    return par


def clip_grad_norm(par: Parallelized, max_norm: float | None) -> float | torch.Tensor:
    """Clip the global gradient norm (across stages for pipeline); returns the norm
    (a 0-d tensor, left on the device so the step need not wait for it; ``float()`` it)."""
    params = [p for p in par.parameters() if p.grad is not None]
    if par.strategy == "pipeline":
        sq = torch.zeros((), dtype=torch.float64)
        for p in params:
            sq += p.grad.detach().double().pow(2).sum().cpu()
        if dist.is_initialized():
            dist.all_reduce(sq)
        norm = float(sq.sqrt())
        if max_norm is not None and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for p in params:
                p.grad.detach().mul_(coef)
        return norm
    if max_norm is None:
        max_norm = float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach()

