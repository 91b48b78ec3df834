"""Helpers of the training-engine tests: config overrides and a real torchrun launcher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from convergent.runsdb.trainrecords import TrainStep, ValRecord, read_train_records

# multi-process tests pin the device they mean (gloo on CPU), on any machine
MOL_BASE = [
    "train.device=cpu",
    "model.hidden=32",
    "model.layers=2",
    "model.heads=4",
    "train.steps=6",
    "train.global_batch_atoms=96",
    "train.val_every=3",
    "train.val_max_batches=2",
    "train.warmup_steps=2",
    "checkpoint.interval=3",
    "metrics.tensorboard=false",
]

LM_BASE = [
    "train.device=cpu",
    "model.kind=llama",
    "model.hidden=32",
    "model.layers=2",
    "model.heads=2",
    "train.steps=5",
    "train.seq_len=16",
    "train.vocab_size=64",
    "train.global_batch_seqs=8",
    "train.val_every=0",
    "train.val_max_batches=2",
    "train.warmup_steps=2",
    "train.lr=3e-3",
    "checkpoint.interval=5",
    "metrics.tensorboard=false",
]


def mol_overrides(moldata: tuple[Path, Path], *extra: str) -> list[str]:
    train, val = moldata
    return [f"train.dataset={train}", f"train.val_dataset={val}", *MOL_BASE, *extra]


def run_training(
    tmp: Path, overrides: list[str], nproc: int, name: str, **kw: Any
) -> tuple[Any, list[TrainStep], Any]:
    """Launch a real torchrun job; returns (TrainResult, last train step record per step,
    run)."""
    from convergent.config import load_config
    from convergent.runsdb.rundir import open_run
    from convergent.train.launch import launch_training

    cfg = load_config(None, overrides)
    run = open_run(cfg, tmp / name)
    result = launch_training(cfg, run, nproc=nproc, **kw)
    steps, _ = read_train_records(run.metrics, last_attempt=True)
    return result, steps, run


def val_records(run: Any) -> list[ValRecord]:
    """The run's validation records, as written (every attempt)."""
    return read_train_records(run.metrics)[1]


def clean_and_killed(
    tmp: Path, overrides: list[str], kill_step: int
) -> tuple[list[TrainStep], list[TrainStep], Any]:
    """Run 2 ranks twice: uninterrupted, and with rank 1 SIGKILLed at the start of step
    index ``kill_step`` under ``--max-restarts 1`` (a checkpoint must precede it).

    Checks that the job restarted once and resumed at ``kill_step``; returns (clean
    records, killed-run records, killed run).
    """
    _, clean, _ = run_training(tmp, overrides, 2, "clean")
    res, faulty, run = run_training(
        tmp, overrides, 2, "faulty", max_restarts=1,
        env={"CONVERGENT_TRAIN_FAULT": f"rank=1,step={kill_step}"},
    )
    assert res.restarts == 1
    raw, _ = read_train_records(run.metrics)
    assert min(r.step for r in raw if r.attempt == 1) == kill_step
    return clean, faulty, run
