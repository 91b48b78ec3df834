"""DDP gradient compression hooks with real torchrun (gloo, 2 processes).

* top-k with ``topk_ratio=1`` sends every entry, so it must reproduce plain all-reduce
  (tolerance 1e-5: the all-gather + index_add sums in another order);
* top-k at 5% with error feedback, fp16 and PowerSGD still train (loss falls) and
  communicate fewer bytes than the uncompressed run;
* the error-feedback state (top-k residuals; PowerSGD error, Q factors, iteration, RNG)
  is checkpointed per rank: a run SIGKILLed after a checkpoint and restarted continues
  with bit-for-bit the uninterrupted run's losses.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.train.trainhelpers import LM_BASE, clean_and_killed, run_training

BASE = [*LM_BASE, "parallel.strategy=ddp", "train.steps=6"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    _, recs, _ = run_training(tmp_path_factory.mktemp("plain"), BASE, 2, "none")
    return recs


def test_topk_full_ratio_equals_allreduce(plain, tmp_path):
    _, recs, _ = run_training(
        tmp_path, [*BASE, "parallel.compression=topk", "parallel.topk_ratio=1.0"], 2, "topk1"
    )
    for a, b in zip(recs, plain, strict=True):
        assert math.isclose(a.loss, b.loss, rel_tol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        ["parallel.compression=topk", "parallel.topk_ratio=0.05"],
        pytest.param(["parallel.compression=fp16"], marks=pytest.mark.slow),
    ],
)
def test_compressed_training_learns_with_fewer_bytes(plain, tmp_path, extra):
    _, recs, _ = run_training(tmp_path, [*BASE, *extra], 2, "c")
    assert recs[-1].loss < recs[0].loss
    assert 0 < recs[-1].comm_bytes < plain[-1].comm_bytes


@pytest.mark.slow
def test_powersgd_learns_with_fewer_bytes(plain, tmp_path):
    _, recs, _ = run_training(
        tmp_path,
        [*BASE, "parallel.compression=powersgd", "parallel.powersgd_start_iter=2"],
        2,
        "psgd",
    )
    assert recs[-1].loss < recs[0].loss
    assert recs[-1].comm_bytes < plain[-1].comm_bytes


@pytest.mark.parametrize(
    "extra",
    [
        ["parallel.compression=topk", "parallel.topk_ratio=0.05"],
        pytest.param(
            ["parallel.compression=powersgd", "parallel.powersgd_start_iter=2"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["topk", "powersgd"],
)
def test_compressed_run_resumes_bit_for_bit(tmp_path, extra):
    """Error-feedback residuals / PowerSGD state are checkpointed: a SIGKILLed and
    restarted compressed run continues with exactly the uninterrupted run's losses."""
    over = [*BASE, *extra, "train.steps=7", "checkpoint.interval=3"]
    clean, faulty, run = clean_and_killed(tmp_path, over, 4)  # checkpoint at 3
    local = torch.load(next(run.ckpt.glob("step_*/rank_00001.pt")), weights_only=False)
    state = local["local"]["compression"]  # rank 1's own error-feedback state was saved
    buffers = state["residual"] if "residual" in state else state["error"]
    assert buffers and any(float(t.abs().sum()) > 0 for t in buffers.values())
    assert [r.loss for r in faulty] == [r.loss for r in clean]
