"""Config of the training engine (``train``, ``parallel``, ``precision``, ``checkpoint``).

Every default works on a 2-core laptop: 2 processes x 1 torch thread, DDP over gloo,
fp32, a checkpoint every 100 steps, the last 2 kept.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from convergent.core.configbase import (
    Count,
    Count0,
    Endpoint,
    Fraction,
    NonNegative,
    PathStr,
    Positive,
    Section,
    Seed,
)


def _nproc(v: Any) -> Any:
    """``auto`` or a whole number >= 1 (one error naming the field, not the union arms)."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    try:
        n = int(v) if not isinstance(v, bool | float) or float(v).is_integer() else None
    except (TypeError, ValueError):
        n = None
    if n is None or isinstance(v, bool):
        raise ValueError("input should be a whole number >= 1 or 'auto'")
    if n < 1:
        raise ValueError("input should be greater than or equal to 1, or 'auto'")
    return n


Nproc = Annotated[int | Literal["auto"], BeforeValidator(_nproc)]


class TrainConfig(Section):
    """Optimisation loop settings.

    The molecular task reads ``dataset``/``val_dataset`` (convergent.data stores); the LM
    task (``model.kind: llama``) trains on ``dataset`` if it holds token records, else on
    a seeded synthetic token stream. Batches are planned *globally* (the same sequence of
    global batches for any number of ranks), then split between ranks and micro-steps,
    so runs with different process counts see identical data per optimizer step.
    """

    dataset: PathStr | None = None  # training dataset directory (convergent.data store)
    val_dataset: PathStr | None = None  # held-out dataset directory (split by molecule)
    extra_datasets: list[PathStr] = []  # more training datasets, read after ``dataset``
    # record order before the seeded batch plan: as stored, or sorted by record key (a
    # dataset filled in arrival order, as learn's labels are, then plans the same batches)
    record_order: Literal["stored", "key"] = "stored"
    bootstrap: bool = False  # train on a resample with replacement (seeded by ``seed``)
    init_from: PathStr | None = None  # warm start: a saved model directory (models.io)
    # with init_from, the element references: refit on this data (offsets, scale, shift),
    # refit the offsets only and keep the network's scale (fine-tuning to another level of
    # theory), or keep the warm model's
    init_reference: Literal["refit", "offsets", "keep"] = "refit"
    # the element reference energies fitted on the training data: one per element (the
    # default), or one energy per atom shared by every element (the science bench's ablation)
    reference_fit: Literal["per_element", "per_atom"] = "per_element"
    # fine-tuning: parameters whose names match a pattern here (fnmatch, e.g. "embedding.*")
    # are frozen; param_lr maps patterns to LR multipliers (first match wins; others 1)
    freeze: list[str] = []
    param_lr: dict[str, Annotated[float, Field(gt=0)]] = {}
    # > 0: keep an exponential moving average of the weights (decay ramped as
    # (1+step)/(10+step) early on) and end with it; mid-run checkpoints hold the raw weights
    ema_decay: float = Field(0.0, ge=0.0, lt=1.0)
    steps: Count = 300  # optimizer steps (with time_budget_s: the most steps)
    # a time budget (train/budget.py): stop after the step at which this many seconds of
    # budget_clock are spent, the LR schedule running over the budget instead of the steps
    time_budget_s: Positive | None = None
    budget_clock: Literal["wall", "process_cpu", "thread_cpu"] = "wall"
    lr: Positive = 1e-3
    min_lr_ratio: Fraction = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: Count0 = 10
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: NonNegative = 0.0
    batch_atoms: Count = 512  # atom budget per micro-batch per rank (molecular)
    global_batch_atoms: Count | None = None  # fixed global atom budget per step (overrides)
    batch_seqs: Count = 8  # sequences per micro-batch per rank (LM)
    global_batch_seqs: Count | None = None  # fixed global sequences per step (LM, overrides)
    seq_len: Count = 64  # tokens per sequence (LM)
    vocab_size: int = Field(256, ge=2)  # synthetic LM vocabulary when no token dataset is given
    grad_accum: Count = 1  # micro-steps per optimizer step (no gradient sync until the last)
    grad_clip: Positive | None = 10.0  # max global grad norm; None disables clipping
    force_weight: NonNegative = 10.0  # weight of the force term (eV/Å)^2 vs energy (eV)^2
    seed: Seed = 0
    threads: Count = 1  # torch intra-op threads per process
    activation_checkpointing: bool = False  # recompute each block in backward
    # torch.compile: off | blocks (each repeated block) | model (the whole model, one graph)
    # | auto (model for the LM on CUDA, off otherwise: the surrogate's forces need a double
    # backward). A graph that fails to compile runs eagerly (dynamo's suppress_errors) with
    # a warning. true / false (the old switch) read as blocks / off.
    compile: Annotated[Literal["auto", "off", "blocks", "model"],
                       BeforeValidator(lambda v: {True: "blocks", False: "off"}.get(v, v)
                                       if isinstance(v, bool) else v)] = "auto"
    val_every: Count0 = 50  # validate every N steps (and at the end); 0 = only at the end
    val_max_batches: Count = 20  # cap validation cost
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when a GPU is visible
    tf32: bool = True  # CUDA: TF32 tensor cores for fp32 matmuls/convolutions
    prefetch: int = Field(2, ge=0, le=16)  # steps of batches prepared ahead (0: inline)


class TrainSlurmConfig(Section):
    """Job options of ``convergent train --submit`` (the sbatch script, train/sbatch.py)."""

    job_name: str | None = Field(None, min_length=1, max_length=128)  # default: run name
    partition: str | None = Field(None, min_length=1)
    account: str | None = Field(None, min_length=1)
    time: str = Field("01:00:00", pattern=r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")  # walltime
    cpus_per_task: int | None = Field(None, ge=1, le=4096)  # None: nproc * train.threads
    signal_s: int = Field(60, ge=10, le=3600)  # --requeue: USR1 this long before the end
    rdzv_port: int | None = Field(None, ge=1024, le=65535)  # None: a free port at job start
    python: str | None = None  # python on the compute nodes (default: this one)
    extra_directives: list[str] = []  # more '#SBATCH' options, e.g. ['--qos=debug']


class ParallelConfig(Section):
    """Parallelism strategy and launch shape.

    ``hsdp`` shards inside groups of ``shard_size`` ranks (default: the ranks of one node,
    or of one rack with ``topology_level: rack``, read from Slurm's environment or
    ``topology_file``) and replicates across groups. ``pipeline`` splits the model's
    blocks into ``nproc * stages_per_rank`` stages (interleaved) or ``nproc`` stages.
    """

    strategy: Literal["single", "ddp", "fsdp", "hsdp", "pipeline"] = "ddp"
    # processes per node; auto: one per visible GPU on CUDA, 2 on CPU
    nproc: Nproc = "auto"
    nnodes: Count = 1
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    rdzv_endpoint: Endpoint | None = None  # host:port; default first Slurm node:29500
    # FSDP / HSDP
    reshard_after_forward: bool = True  # free unsharded params after forward (ZeRO-3)
    shard_size: Count | None = None  # HSDP shard group size; None = from topology
    topology_file: PathStr | None = None  # YAML/JSON {hostname: {rack: name}} or rank lists
    topology_level: Literal["node", "rack"] = "node"
    # Pipeline
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    microbatches: Count = 4
    stages_per_rank: Count = 2  # for interleaved
    # DDP gradient compression (comm hook)
    compression: Literal["none", "fp16", "powersgd", "topk"] = "none"
    # gradient all-reduce: hierarchical = reduce-scatter in node, all-reduce across nodes
    # (compression on that hop only), all-gather in node; auto: hierarchical when the
    # topology has several nodes of several ranks (see convergent.train.hierarchy)
    allreduce: Literal["auto", "flat", "hierarchical"] = "auto"
    powersgd_rank: Count = 2
    powersgd_start_iter: Count0 = 10
    topk_ratio: float = Field(0.01, gt=0, le=1, allow_inf_nan=False)  # fraction of gradient entries sent per step
    bucket_cap_mb: Positive = 25.0
    slurm: TrainSlurmConfig = TrainSlurmConfig()


class PrecisionConfig(Section):
    """Autocast dtype; ``keep_fp32`` lists module-name substrings kept in fp32."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    keep_fp32: list[str] = ["energy_head", "norm"]
    reduce_dtype: Literal["fp32", "param"] = "fp32"  # FSDP gradient reduction dtype
    init_scale: Positive = 2.0**12  # fp16 GradScaler initial scale


class CheckpointConfig(Section):
    """DCP checkpoints: interval in steps, how many to keep, async writing, resume."""

    interval: Count0 = 100  # steps between checkpoints; 0: only the final one
    keep: Count = 2
    async_save: bool = False  # write in a background thread (separate gloo group)
    resume: bool = True  # resume from the latest complete checkpoint in the run dir
    export_final: bool = True  # safetensors export to ckpt/final at the end
    # a checkpoint after the last step; false: none (train/fit.py then exports the trained
    # model from memory: the same weights, without a DCP write and read per small model)
    at_end: bool = True
