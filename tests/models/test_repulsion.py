"""Issue 37, finding 1: the ZBL repulsive prior (convergent.models.repulsion).

Its formula against the published ZBL constants, its envelope, its place in the model's
energy and forces (autograd and direct), and its record in the checkpoint."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from ase.data import covalent_radii

from convergent.models.batching import collate_records
from convergent.models.config import ModelConfig
from convergent.models.io import load_model, save_model
from convergent.models.molecular import build_model, energy_and_forces
from convergent.models.repulsion import envelope, zbl_pair_energy

EPS64 = torch.finfo(torch.float64).eps


def _zbl_by_hand(z1: int, z2: int, r: float) -> float:
    """Ziegler, Biersack & Littmark (1985), the universal screening function."""
    a = 0.46850 / (z1**0.23 + z2**0.23)
    x = r / a
    phi = (0.18175 * math.exp(-3.19980 * x) + 0.50986 * math.exp(-0.94229 * x)
           + 0.28022 * math.exp(-0.40290 * x) + 0.02817 * math.exp(-0.20162 * x))
    return 14.399645 * z1 * z2 / r * phi


def _pair(z1: int, z2: int, r: float) -> dict:
    return {"numbers": np.array([z1, z2]), "positions": np.array([[0, 0, 0], [r, 0, 0]], float),
            "energy": 0.0, "forces": np.zeros((2, 3))}


@pytest.mark.parametrize(("z1", "z2", "r"), [(1, 1, 0.3), (6, 1, 0.5), (8, 8, 0.6), (7, 6, 0.9)])
def test_pair_energy_is_the_zbl_formula_times_the_envelope(z1, z2, r):
    got = float(zbl_pair_energy(torch.tensor([z1]), torch.tensor([z2]),
                                torch.tensor([r], dtype=torch.float64))[0])
    x = r / (covalent_radii[z1] + covalent_radii[z2])
    env = 1 - 28 * x**6 + 48 * x**7 - 21 * x**8 if x < 1 else 0.0
    want = _zbl_by_hand(z1, z2, r) * env
    assert got == pytest.approx(want, rel=64 * EPS64)
    assert got > 0


def test_envelope_is_one_at_zero_and_vanishes_smoothly_at_one():
    x = torch.tensor([0.0, 0.5, 1.0, 1.2], dtype=torch.float64, requires_grad=True)
    f = envelope(x)
    (g,) = torch.autograd.grad(f.sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    f, g = f.detach(), g.detach()
    assert f[0] == 1 and f[2] == 0 and f[3] == 0 and 0 < f[1] < 1
    assert abs(float(g[2])) < 1e-12 and abs(float(h[2])) < 1e-9  # C2 at the cut


def test_a_bonded_pair_at_its_length_gets_nothing_a_collapsing_pair_a_wall():
    ch = float(zbl_pair_energy(torch.tensor([6]), torch.tensor([1]), torch.tensor([1.09]))[0])
    assert ch == 0.0  # C-H at its bond length: beyond the covalent sum (1.07 Å)
    hh = zbl_pair_energy(torch.tensor([1] * 3), torch.tensor([1] * 3),
                         torch.tensor([0.5, 0.4, 0.3]))
    assert (hh[1:] > hh[:-1]).all() and float(hh[2]) > 5.0  # eV: rises steeply inwards


@pytest.mark.parametrize("forces", ["autograd", "direct"])
def test_the_model_energy_and_forces_include_the_prior(forces):
    torch.manual_seed(0)
    on = build_model(ModelConfig(hidden=16, layers=1, forces=forces)).double()
    off = build_model(ModelConfig(hidden=16, layers=1, forces=forces, repulsion="none")).double()
    off.load_state_dict(on.state_dict())
    r = 0.45
    batch = collate_records([_pair(1, 1, r)])
    batch = batch.with_positions(batch.positions.double())
    e_on, f_on = energy_and_forces(on, batch, training=False)
    e_off, f_off = energy_and_forces(off, batch, training=False)
    # the difference is the prior: its energy, and its force -dE/dr along the pair (at the
    # distance the batch holds: collate stores positions in float32)
    r = float(batch.positions[1, 0] - batch.positions[0, 0])
    pair = torch.tensor([r], dtype=torch.float64, requires_grad=True)
    e_pair = zbl_pair_energy(torch.tensor([1]), torch.tensor([1]), pair)
    (de_dr,) = torch.autograd.grad(e_pair.sum(), pair)
    e_pair = e_pair.detach()
    # plus the model's sqrt(r^2 + 1e-12) guard, a shift of 1e-12 / 2r in the distance
    tol = 64 * EPS64 * max(1.0, float(e_pair)) + abs(float(de_dr)) * 1e-12 / r
    assert float(e_on - e_off) == pytest.approx(float(e_pair), abs=tol)
    df = (f_on - f_off).double()
    f32 = torch.finfo(torch.float32).eps  # forces are returned in float32
    ftol = 64 * f32 * max(1.0, abs(float(de_dr)))
    assert float(df[1, 0]) == pytest.approx(-float(de_dr), abs=ftol)  # pushed apart
    assert float(df[0, 0]) == pytest.approx(float(de_dr), abs=ftol)


def test_the_checkpoint_records_the_prior_and_an_old_one_loads_without_it(tmp_path):
    model = build_model(ModelConfig(hidden=16, layers=1))
    d = save_model(model, ModelConfig(hidden=16, layers=1), tmp_path / "m")
    meta = json.loads((d / "model_config.json").read_text())
    assert meta["model"]["repulsion"] == "zbl" and meta["model"]["repulsion_scale"] == 1.0
    assert load_model(d)[1].repulsion == "zbl"
    # a checkpoint written before the prior existed: no key -> the network alone
    for k in ("repulsion", "repulsion_scale"):
        del meta["model"][k]
    (d / "model_config.json").write_text(json.dumps(meta))
    assert load_model(d)[1].repulsion == "none"
