"""The direct force head (``model.forces: direct``): symmetries, wiring, and that it learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from convergent.models.batching import atoms_to_record, collate_records
from convergent.models.config import ModelConfig
from convergent.models.losses import energy_force_loss
from convergent.models.molecular import ReferenceEnergies, build_model, energy_and_forces


def _model(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=32, layers=2, heads=4, forces="direct", **kw))
    m.set_reference(ReferenceEnergies({1: -13.6, 6: -1030.0, 7: -1480.0, 8: -2040.0}, scale=0.7))
    return m.double()


def _records(positions_shift=None) -> list[dict]:
    from ase.build import molecule

    rng = np.random.default_rng(1)
    recs = []
    for k, name in enumerate(["CH3OH", "H2O", "C2H6"]):
        atoms = molecule(name)
        atoms.positions += rng.normal(0.0, 0.1, atoms.positions.shape)
        recs.append(atoms_to_record(atoms, key=str(k)))
    return recs


def _predict(m, recs):
    b = collate_records(recs, dtype=torch.float64)
    e, f = energy_and_forces(m, b, training=False)
    return b, e, f


def _rotation(seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def test_forces_rotate_with_the_structure_and_energy_is_invariant():
    m = _model()
    recs = _records()
    _, e, f = _predict(m, recs)
    assert f.abs().max() > 1e-3  # a non-trivial prediction
    rot = _rotation(3)
    rotated = [{**r, "positions": r["positions"] @ rot.T} for r in recs]
    _, e2, f2 = _predict(m, rotated)
    torch.testing.assert_close(e2, e, rtol=0, atol=1e-9)
    torch.testing.assert_close(f2, f @ torch.from_numpy(rot).T, rtol=0, atol=1e-9)


def test_translation_and_permutation_invariance():
    m = _model()
    recs = _records()
    b, e, f = _predict(m, recs)
    moved = [{**r, "positions": r["positions"] + np.array([3.0, -7.5, 11.0])} for r in recs]
    _, e2, f2 = _predict(m, moved)
    torch.testing.assert_close(e2, e, rtol=0, atol=1e-9)
    torch.testing.assert_close(f2, f, rtol=0, atol=1e-9)
    perm = np.random.default_rng(5).permutation(len(recs[0]["numbers"]))
    first = {**recs[0], "numbers": recs[0]["numbers"][perm], "positions": recs[0]["positions"][perm]}
    _, e3, f3 = _predict(m, [first, *recs[1:]])
    n0 = len(perm)
    torch.testing.assert_close(e3, e, rtol=0, atol=1e-9)
    torch.testing.assert_close(f3[:n0], f[:n0][torch.from_numpy(perm)], rtol=0, atol=1e-9)
    torch.testing.assert_close(f3[n0:], f[n0:], rtol=0, atol=1e-9)


def test_net_force_vanishes_and_forces_are_not_the_energy_gradient():
    m = _model()
    b, e, f = _predict(m, _records())
    net = torch.zeros(b.n_molecules, 3, dtype=f.dtype).index_add(0, b.batch, f)
    torch.testing.assert_close(net, torch.zeros_like(net), rtol=0, atol=1e-9)
    # direct forces are a separate prediction, not -dE/dx of the predicted energy
    pos = b.positions.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(m(b.with_positions(pos)).sum(), pos)
    assert (f + g).abs().max() > 1e-3


def test_autograd_model_has_no_force_head():
    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=32, layers=2, heads=4))
    assert m.force_head is None
    b = collate_records(_records())
    e, f = m(b, with_forces=True)
    assert f is None and e.shape == (3,)
    assert not any(n.startswith("force_head") for n in m.state_dict())
    d = _model()
    assert any(n.startswith("force_head") for n in d.state_dict())


@pytest.fixture(scope="module")
def emt_records() -> list[dict]:
    from ase.build import molecule
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(0)
    out = []
    for i in range(24):
        atoms = molecule(["H2O", "CH4", "NH3", "CH3OH"][i % 4])
        atoms.positions += rng.normal(0.0, 0.1, atoms.positions.shape)
        atoms.calc = EMT()
        atoms.get_potential_energy()
        out.append(atoms_to_record(atoms, key=str(i)))
    return out


def test_training_steps_reduce_the_force_error(emt_records):
    from convergent.models.molecular import fit_reference_energies

    torch.manual_seed(0)
    m = build_model(ModelConfig(hidden=32, layers=2, heads=4, forces="direct"))
    m.set_reference(fit_reference_energies(emt_records))
    b = collate_records(emt_records)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)

    def force_mae() -> float:
        _, f = energy_and_forces(m, b, training=False)
        return float((f - b.forces).abs().mean())

    before = force_mae()
    for _ in range(40):
        e, f = energy_and_forces(m, b, training=True)
        loss, _ = energy_force_loss(e, f, b, force_weight=10.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = force_mae()
    assert after < 0.7 * before, (before, after)
