"""What is trained: the molecular surrogate (energies + forces; ``model.kind`` molecular or
mace) or a Llama-style LM.

:func:`make_task` picks the task of a config; :func:`check_before_launch` raises the
config errors the ranks would hit at start-up before any process starts. The task
interface and the global batch plan are described in :mod:`convergent.train.taskapi`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from convergent.core.errors import ConfigError, NotAvailableError
from convergent.data.manifest import check_dataset
from convergent.models.mace import INSTALL_HINT, mace_installed
from convergent.models.schnetpack import INSTALL_HINT as SPK_HINT
from convergent.models.schnetpack import schnetpack_installed
from convergent.tracking.store import import_mlflow
from convergent.train.lmtask import LMTask
from convergent.train.moltask import MolecularTask
from convergent.train.taskapi import MicroBatch, Task, find_blocks, split_evenly
from convergent.train.texttask import TextLMTask

if TYPE_CHECKING:
    from convergent.config import ConvergentConfig


__all__ = [
    "LMTask", "MicroBatch", "MolecularTask", "Task", "check_before_launch", "check_model_kind",
    "check_pipeline",
    "find_blocks", "make_task", "split_evenly",
]


def check_model_kind(cfg: ConvergentConfig) -> None:
    """Refuse what the peer kinds (mace, schnet, painn) cannot train: pipeline stages
    (their forces are a double backward through every stage) and, for MACE,
    reduced-precision autocast (e3nn's tensor products take one dtype; MACE computes in
    ``model.mace.dtype``)."""
    kind = cfg.model.kind
    if kind not in ("mace", "schnet", "painn"):
        return
    if cfg.parallel.strategy == "pipeline":
        raise ConfigError(
            f"parallel.strategy=pipeline is not supported for model.kind={kind}",
            hint="its forces are -dE/dpositions (a double backward through every stage); "
                 "use parallel.strategy=ddp/fsdp/hsdp",
        )
    if kind == "mace" and cfg.precision.dtype != "fp32":
        raise ConfigError(
            f"precision.dtype={cfg.precision.dtype} is not supported for model.kind=mace",
            hint="e3nn's tensor products do not run under autocast; set precision.dtype=fp32 "
                 "(model.mace.dtype picks float32 or float64)",
        )


def check_pipeline(cfg: ConvergentConfig) -> None:
    """Refuse ``parallel.strategy=pipeline`` for models whose training it cannot run."""
    check_model_kind(cfg)
    if cfg.parallel.strategy != "pipeline" or cfg.model.kind != "molecular":
        return
    if cfg.model.forces != "direct":
        raise ConfigError(
            "parallel.strategy=pipeline needs model.forces=direct for the molecular model "
            f"(model.forces={cfg.model.forces})",
            hint="autograd forces (-dE/dpositions) need a double backward through every "
            "stage, which pipeline schedules cannot run; set model.forces=direct (not "
            "conservative) or use parallel.strategy=ddp/fsdp/hsdp",
        )


def check_before_launch(cfg: ConvergentConfig, data: bool = True) -> None:
    """Config errors the ranks would hit at start-up, raised before torchrun starts
    (``data=False``: skip the dataset paths, e.g. when only printing the command)."""
    check_pipeline(cfg)
    if cfg.tracking.mlflow:
        import_mlflow()  # tracking asked for but MLflow missing: one line, nothing created
    if cfg.model.kind == "mace" and not mace_installed():  # found without importing it
        raise NotAvailableError("model.kind=mace needs mace-torch, which is not installed",
                                hint=INSTALL_HINT)
    if cfg.model.kind in ("schnet", "painn") and not schnetpack_installed():
        raise NotAvailableError(f"model.kind={cfg.model.kind} needs schnetpack, which is not "
                                "installed", hint=SPK_HINT)
    if not data or cfg.model.kind == "llama":
        return
    for key in ("dataset", "val_dataset"):
        path = getattr(cfg.train, key)
        if key == "dataset" and not path:
            raise ConfigError(
                "train.dataset is not set",
                hint="point it at a dataset directory, e.g. -s train.dataset=runs/demo/data/train",
            )
        if path and not Path(path).exists():
            raise ConfigError(f"train.{key}: {path} does not exist")
        if path:  # a readable dataset (its manifest), before any process starts
            check_dataset(path, f"train.{key}")


def make_task(cfg: ConvergentConfig) -> Task:
    """The task for ``cfg.model.kind``: ``molecular`` and ``mace`` (the molecular task: the
    same data, batches, loss and export; the network is built by ``model.kind``) or
    ``llama``."""
    check_model_kind(cfg)  # also for train/fit.py's callers, which skip check_before_launch
    if cfg.model.kind == "llama" and cfg.text.source:  # a real text corpus
        return TextLMTask(cfg)
    return LMTask(cfg) if cfg.model.kind == "llama" else MolecularTask(cfg)
