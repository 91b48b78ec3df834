"""Fault tolerance and checkpoints with real torchrun (gloo, 2 processes).

* SIGKILL of one rank mid-run under ``--max-restarts 1``: torchrun restarts the workers,
  they resume from the last complete DCP checkpoint, and the per-step losses (and the
  final loss) equal the uninterrupted run **bit for bit** (same world size, same global
  batches, restored model/optimizer/scheduler/RNG state, deterministic gloo reductions).
* A checkpoint written by 2 FSDP ranks resumes on 1 rank (N -> M resharding by DCP);
  losses after the resume agree with the 2-rank run to 1e-5 (summation order only).
"""

from __future__ import annotations

import math
import shutil

import pytest

from convergent.runsdb.trainrecords import read_train_records
from convergent.train.checkpoint import complete_checkpoints
from tests.train.trainhelpers import clean_and_killed, mol_overrides, run_training


def test_sigkill_one_rank_resumes_bit_for_bit(moldata, tmp_path, monkeypatch):
    over = mol_overrides(moldata, "parallel.strategy=ddp", "train.steps=8", "checkpoint.interval=3")
    # rank 1 SIGKILLs itself at the start of step index 4 (after the checkpoint at 3);
    # the helper checks the restart resumed there
    clean, faulty, run = clean_and_killed(tmp_path, over, 4)
    assert [r.loss for r in faulty] == [r.loss for r in clean]
    assert faulty[-1].loss == clean[-1].loss
    # retention keeps the newest 2 complete checkpoints
    steps = [s for s, _ in complete_checkpoints(run.ckpt)]
    assert steps == [6, 8]


@pytest.mark.slow
def test_sigkill_without_restarts_fails_with_rank_log(moldata, tmp_path):
    from convergent.core.errors import ConvergentError

    over = mol_overrides(moldata, "parallel.strategy=ddp", "train.steps=4")
    with pytest.raises(ConvergentError, match="training failed"):
        run_training(
            tmp_path, over, 2, "dies", env={"CONVERGENT_TRAIN_FAULT": "rank=1,step=1"}
        )


@pytest.mark.slow
def test_fsdp_checkpoint_reshards_two_ranks_to_one(moldata, tmp_path):
    over = mol_overrides(moldata, "parallel.strategy=fsdp", "checkpoint.keep=3")
    _, full, run = run_training(tmp_path, over, 2, "two")
    # continue from the step-3 checkpoint with a single process
    resumed = tmp_path / "one"
    shutil.copytree(run.path, resumed)
    shutil.rmtree(resumed / "ckpt" / "step_00000006")
    shutil.rmtree(resumed / "ckpt" / "final", ignore_errors=True)
    (resumed / "metrics.jsonl").unlink()
    from convergent.config import load_config
    from convergent.runsdb.rundir import RunDir
    from convergent.train.launch import launch_training

    cfg = load_config(None, over)
    launch_training(cfg, RunDir(resumed), nproc=1)
    after, _ = read_train_records(RunDir(resumed).metrics)
    assert [r.step for r in after] == [4, 5, 6]
    assert all(r.world == 1 for r in after)
    for a, b in zip(after, full[3:], strict=True):
        assert math.isclose(a.loss, b.loss, rel_tol=1e-5)
