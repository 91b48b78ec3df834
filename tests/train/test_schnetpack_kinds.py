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
from tests.train.fdcheck import fd_check
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
    # F = -dE/dx of the trained network, checked in float64 (its float32 export rounds the
    # energy to ~eps32 x |E|, too coarse for a central difference): the same weights, doubled
    calc = SurrogateCalculator(model.double())
    atoms = molecule("H2CO")
    atoms.positions += np.random.default_rng(1).normal(0, 0.05, atoms.positions.shape)
    eps, h = float(torch.finfo(torch.float64).eps), 1e-5  # truncation ~h^2 f''' far below 1e-6
    fd_check(calc, atoms, h, lambda es, f: 1e-6 * max(1.0, abs(f)) + 100 * eps * max(map(abs, es)) / h)

@pytest.mark.parametrize("kind", ["schnet", "painn"])
def test_what_the_schnetpack_kinds_cannot_run_is_refused_in_one_line(kind):
    from convergent.train.tasks import check_before_launch

    with pytest.raises(ConfigError, match=f"model.forces.*autograd with model.kind={kind}"):
        load_config(None, [f"model.kind={kind}", "model.forces=direct"])
    cfg = load_config(None, [f"model.kind={kind}", "parallel.strategy=pipeline"])
    with pytest.raises(ConfigError, match=f"pipeline is not supported for model.kind={kind}"):
        check_before_launch(cfg, data=False)
