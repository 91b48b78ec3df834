"""The one training loop, called in this process: ``convergent train``'s Trainer without
torchrun, for callers that train a model as one step of their own work — the active
learning committee, the benches, fine-tuning. Same optimizer, schedule, clipping,
precision, device and batch plan as a ``convergent train`` run with the same settings, so
the same seed and data give the same parameters.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from convergent.runsdb.rundir import RunDir
from convergent.train.checkpoint import load_full_model

if TYPE_CHECKING:
    from convergent.config import ConvergentConfig


def export_final(cfg: ConvergentConfig, task: Any, last_checkpoint: str | Path, directory: Path) -> Path:
    """The final weights of the DCP checkpoint ``last_checkpoint`` exported with the task's
    exporter (molecular: models.io, with config and elements) to ``directory``."""
    torch.manual_seed(cfg.train.seed)
    model = load_full_model(last_checkpoint, task.build_model())
    task.export(model, directory)
    return directory


def fit(cfg: ConvergentConfig, run_dir: str | Path, export_to: str | Path | None = None) -> dict[str, Any]:
    """Train ``cfg`` (a ConvergentConfig) in this process with the Trainer, writing metrics
    and checkpoints under ``run_dir``; export the final model to ``export_to`` (default
    ``<run_dir>/ckpt/final``). Sets this process's torch threads to ``train.threads``.
    Returns the Trainer's summary with ``final_dir``."""
    from convergent.cluster.resources import set_torch_threads
    from convergent.train.trainer import Trainer

    set_torch_threads(cfg.train.threads)  # as a `convergent train` process does
    run = RunDir(Path(run_dir))
    run.path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # DCP says it assumes one process: it is one here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        trainer = Trainer(cfg, run)
        summary = trainer.train()
        task = trainer.task
        if task.kind == "molecular":
            summary["train_records"] = len(task.data)
        dest = Path(export_to) if export_to is not None else run.ckpt / "final"
        if cfg.checkpoint.at_end:
            del trainer
            summary["final_dir"] = str(export_final(cfg, task, summary["last_checkpoint"], dest))
        else:  # no final checkpoint: the trained weights, from memory
            (model,) = trainer.par.parts
            task.export(model, dest)
            summary["final_dir"] = str(dest)
            summary["last_checkpoint"] = None
    return summary
