"""Pipeline parallelism for the molecular surrogate (``model.forces: direct``) with real
torchrun (gloo, 2 processes, 2 stages) against a single-process run of the same model,
data and config.

Tolerance: the pipeline splits each global batch into padded micro-batches whose losses
are the global-batch loss's shares, so it differs from the single process only in
floating-point summation order (per-part sums, gradient accumulation over micro-batches,
molecule order inside attention/energy sums): per-step losses agree to a relative 1e-5
over these few steps, validation metrics too.
"""

from __future__ import annotations

import pytest

from convergent.core.errors import ConfigError
from tests.train.trainhelpers import mol_overrides, run_training, val_records

RTOL = 1e-5
DIRECT = ["model.forces=direct", "train.force_weight=1.0"]


def _close(a, b, rtol):
    assert a == pytest.approx(b, rel=rtol, abs=0)


@pytest.mark.numerics
@pytest.mark.parametrize("vectors", [False, True])
def test_padded_stages_reproduce_the_full_model(vectors):
    """Two stages chained in one process on padded micro-batches give the full model's
    energies and forces on the unpadded molecules (padding changes nothing); with
    ``model.vectors`` the stages pass the packed scalar+vector state."""
    import torch
    from ase.build import molecule

    from convergent.models.batching import atoms_to_record, collate_records
    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model
    from convergent.train.molpipe import Budget, Feed, micro_groups, stage_module

    torch.manual_seed(0)
    full = build_model(ModelConfig(hidden=32, layers=3, heads=4, forces="direct", vectors=vectors))
    names = ["CH3OH", "H2O", "C2H6", "NH3", "CH4", "HCN", "N2"]
    batch = collate_records([atoms_to_record(molecule(n), key=n) for n in names])
    budget = Budget.plan(batch.num_atoms, int(batch.n_atoms.max()), 3, None)
    feed = Feed(budget)
    stages = [stage_module(full, s, 2, feed) for s in range(2)]
    assert [list(s.layers) for s in stages] == [["0", "1"], ["2"]]
    feed.load(batch, micro_groups(batch, 3, budget, training=True))
    e_ref, f_ref = full(batch, with_forces=True)
    seen = 0
    for i, item in enumerate(feed.items):
        idx = torch.tensor([i])
        h, _ = stages[0](idx)
        assert h.shape == (budget.atoms, full.state_width) == (budget.atoms, 32 * (4 if vectors else 1))
        energy, forces = stages[1](h, idx)
        assert energy.shape == (budget.atoms,) and forces.shape == (budget.atoms, 3)
        sub = item.batch
        keys = [batch.keys.index(k) for k in sub.keys]
        torch.testing.assert_close(energy[: sub.n_molecules], e_ref[keys], rtol=1e-6, atol=1e-6)
        starts = (torch.cumsum(batch.n_atoms, 0) - batch.n_atoms).tolist()
        atoms = [a for k in keys for a in range(starts[k], starts[k] + int(batch.n_atoms[k]))]
        torch.testing.assert_close(forces[: sub.num_atoms], f_ref[atoms], rtol=1e-5, atol=1e-6)
        seen += sub.n_molecules
    assert seen == len(names)


def test_budget_bounds_every_split():
    import random

    from convergent.train.molpipe import Budget
    from convergent.train.tasks import split_evenly

    for t in range(500):
        r = random.Random(t)
        max_atoms, budget_atoms, n = r.randint(1, 30), r.randint(1, 400), r.randint(1, 8)
        counts = [r.randint(1, max_atoms)]
        while sum(counts) + (c := r.randint(1, max_atoms)) <= budget_atoms:
            counts.append(c)
        b = Budget.plan(budget_atoms, max_atoms, n, None)
        assert max(sum(counts[i] for i in g) for g in split_evenly(counts, n)) <= b.atoms - 1


@pytest.fixture(scope="module")
def direct_reference(moldata, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("directref")
    _, recs, run = run_training(
        tmp, mol_overrides(moldata, *DIRECT, "parallel.strategy=single"), 1, "single"
    )
    return recs, val_records(run)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_molecular_pipeline_matches_single(moldata, direct_reference, tmp_path, schedule):
    ref, ref_val = direct_reference
    assert ref[-1].loss < ref[0].loss  # the reference learns
    res, recs, run = run_training(
        tmp_path,
        mol_overrides(moldata, *DIRECT, "parallel.strategy=pipeline",
                      f"parallel.schedule={schedule}", "parallel.microbatches=4"),
        2,
        schedule,
    )
    assert all(r.strategy == "pipeline" and r.world == 2 for r in recs)
    _close([r.loss for r in recs], [r.loss for r in ref], RTOL)
    _close([r.force_mae for r in recs], [r.force_mae for r in ref], RTOL)
    assert all(r.unit == "atoms" and r.units_per_s > 0 for r in recs)
    vals = val_records(run)
    assert [v.step for v in vals] == [v.step for v in ref_val]
    for key in ("loss", "energy_mae", "force_mae"):
        _close([getattr(v, key) for v in vals], [getattr(v, key) for v in ref_val], RTOL)
    # the stages' parameters reassemble into the full model (checkpoint + export)
    from convergent.models.io import load_model

    model, mcfg = load_model(res.final_dir)
    assert mcfg.forces == "direct" and model.force_head is not None


def test_pipeline_refuses_autograd_forces(moldata, tmp_path):
    with pytest.raises(ConfigError, match="model.forces=direct"):
        run_training(tmp_path, mol_overrides(moldata, "parallel.strategy=pipeline"), 2, "pp")
    assert not (tmp_path / "pp" / "metrics.jsonl").exists()  # refused before launching


@pytest.mark.slow
def test_molecular_interleaved_pipeline_matches_single(moldata, tmp_path):
    base = mol_overrides(moldata, *DIRECT, "model.layers=4")
    _, ref, _ = run_training(tmp_path, [*base, "parallel.strategy=single"], 1, "ref")
    _, recs, _ = run_training(
        tmp_path,
        [*base, "parallel.strategy=pipeline", "parallel.schedule=interleaved",
         "parallel.microbatches=4"],
        2,
        "pp",
    )
    _close([r.loss for r in recs], [r.loss for r in ref], RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_direct_forces_train_with_data_parallel_strategies(
    moldata, direct_reference, tmp_path, strategy
):
    # no double backward: FSDP2 runs its own hooks here instead of the gathered path
    ref, _ = direct_reference
    _, recs, _ = run_training(
        tmp_path, mol_overrides(moldata, *DIRECT, f"parallel.strategy={strategy}"), 2, strategy
    )
    _close([r.loss for r in recs], [r.loss for r in ref], RTOL)
