"""``model.kind: schnet | painn``: schnetpack's SchNet and PaiNN trained by the one training
loop (train/fit.py, the Trainer of `convergent train`), exported by models.io and loaded
back as an ASE calculator whose forces are -dE/dx — the peers of the benches as choices
of one stage, like MACE. Tiny models on the EMT set of moldataset.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from convergent.config import load_config
from convergent.core.errors import ConfigError
from convergent.models.schnetpack import schnetpack_installed
from tests.train.moldataset import make_dataset

needs_spk = pytest.mark.skipif(not schnetpack_installed(),
                               reason="schnetpack not installed (pip install 'convergent[schnetpack]')")

TINY = ["model.hidden=16", "model.layers=2", "model.num_rbf=8", "train.device=cpu",
        "train.steps=20", "train.global_batch_atoms=512", "train.lr=1e-2", "train.warmup_steps=0",
        "train.val_every=0", "train.threads=1", "train.prefetch=0", "metrics.tensorboard=false",
        "metrics.mfu=false", "checkpoint.interval=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    return make_dataset(tmp_path_factory.mktemp("spkdata"), n_train=24, n_val=8)


@needs_spk
@pytest.mark.parametrize("kind", ["schnet", "painn"])
def test_fit_trains_the_schnetpack_kind_and_its_calculator_forces_are_minus_the_gradient(
        tmp_path, data, kind):
    from ase.build import molecule

    from convergent.models.calculator import SurrogateCalculator
    from convergent.models.io import load_model
    from convergent.models.schnetpack import SpkModel
    from convergent.runsdb.trainrecords import read_train_records
    from convergent.train.fit import fit

    cfg = load_config(None, [f"model.kind={kind}", *TINY, f"train.dataset={data[0]}"])
    summary = fit(cfg, tmp_path / "run")
    steps, _ = read_train_records(tmp_path / "run" / "metrics.jsonl", last_attempt=True)
    losses = [s.loss for s in steps]
    assert len(losses) == 20 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    model, mcfg = load_model(summary["final_dir"])
    assert isinstance(model, SpkModel) and mcfg.kind == kind
    assert model.trained_elements == (1, 6, 7, 8) and float(model.atomref[8]) != 0.0
    calc = SurrogateCalculator(summary["final_dir"])
    atoms = molecule("H2CO")
    atoms.positions += np.random.default_rng(1).normal(0, 0.05, atoms.positions.shape)
    atoms.calc = calc
    f = atoms.get_forces()
    e0 = atoms.get_potential_energy()
    eps, h = float(torch.finfo(torch.float32).eps), 1e-2
    net = abs(e0 - model.atomref.numpy()[atoms.numbers].sum())  # the float32 part
    for atom, axis in ((0, 0), (2, 1), (3, 2)):
        es = []
        for sign in (1, -1):
            moved = atoms.copy()
            moved.positions[atom, axis] += sign * h
            moved.calc = calc
            es.append(moved.get_potential_energy())
        fd = -(es[0] - es[1]) / (2 * h)
        # truncation ~h^2 f''' (the 2e-3 relative term) + float32 rounding of E over the step
        assert abs(fd - f[atom, axis]) <= 2e-3 * max(1.0, abs(f[atom, axis])) + 100 * eps * max(net, 1.0) / h


@pytest.mark.parametrize("kind", ["schnet", "painn"])
def test_what_the_schnetpack_kinds_cannot_run_is_refused_in_one_line(kind):
    from convergent.train.tasks import check_before_launch

    with pytest.raises(ConfigError, match=f"model.forces.*autograd with model.kind={kind}"):
        load_config(None, [f"model.kind={kind}", "model.forces=direct"])
    cfg = load_config(None, [f"model.kind={kind}", "parallel.strategy=pipeline"])
    with pytest.raises(ConfigError, match=f"pipeline is not supported for model.kind={kind}"):
        check_before_launch(cfg, data=False)
