"""Config of the training engine (``train``, ``parallel``, ``precision``, ``checkpoint``)."""

from __future__ import annotations

from typing import Literal

from convergent.configbase import Section


class TrainConfig(Section):
    """Optimisation loop settings."""

    dataset: str | None = None  # training dataset directory (convergent.data store)
    val_dataset: str | None = None  # held-out dataset directory (split by molecule)
    steps: int = 300
    lr: float = 1e-3
    batch_atoms: int = 512  # atom budget per batch (molecular)
    grad_accum: int = 1
    grad_clip: float | None = 10.0
    force_weight: float = 10.0
    seed: int = 0


class ParallelConfig(Section):
    """Parallelism strategy and launch shape."""

    strategy: Literal["single", "ddp", "fsdp", "hsdp", "pipeline"] = "ddp"
    nproc: int = 2
    nnodes: int = 1


class PrecisionConfig(Section):
    """Autocast dtype; ``keep_fp32`` lists module name patterns kept in fp32."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    keep_fp32: list[str] = ["energy_head"]


class CheckpointConfig(Section):
    """DCP checkpoints: interval in steps, how many to keep."""

    interval: int = 100
    keep: int = 2
