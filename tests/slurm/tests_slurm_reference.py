"""The uninterrupted reference of the requeue test: the same training, 2 local processes."""

from __future__ import annotations

from pathlib import Path


def reference_losses(run_dir: Path, overrides: list[str]) -> dict[int, float]:
    from convergent.config import load_config
    from convergent.runsdb.rundir import open_run
    from convergent.runsdb.trainrecords import read_train_records
    from convergent.train.launch import launch_training

    cfg = load_config(None, overrides)
    run = open_run(cfg, run_dir)
    launch_training(cfg, run, nproc=2)
    steps, _ = read_train_records(run.metrics, last_attempt=True)
    return {r.step: r.loss for r in steps}
