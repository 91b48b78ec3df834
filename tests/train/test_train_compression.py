"""DDP gradient compression hooks with real torchrun (gloo, 2 processes).

* top-k with ``topk_ratio=1`` sends every entry, so it must reproduce plain all-reduce
  (tolerance 1e-5: the all-gather + index_add sums in another order);
* top-k at 5% with error feedback, fp16 and PowerSGD still train (loss falls) and
  communicate fewer bytes than the uncompressed run.
"""

from __future__ import annotations

import math

import pytest
from trainhelpers import LM_BASE, run_training

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
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        ["parallel.compression=topk", "parallel.topk_ratio=0.05"],
        pytest.param(["parallel.compression=fp16"], marks=pytest.mark.slow),
    ],
)
def test_compressed_training_learns_with_fewer_bytes(plain, tmp_path, extra):
    _, recs, _ = run_training(tmp_path, [*BASE, *extra], 2, "c")
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert 0 < recs[-1]["comm_bytes"] < plain[-1]["comm_bytes"]


@pytest.mark.slow
def test_powersgd_learns_with_fewer_bytes(plain, tmp_path):
    _, recs, _ = run_training(
        tmp_path,
        [*BASE, "parallel.compression=powersgd", "parallel.powersgd_start_iter=2"],
        2,
        "psgd",
    )
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert recs[-1]["comm_bytes"] < plain[-1]["comm_bytes"]
