"""Batched MD (convergent.screen.batchmd) against ASE's one-molecule loop: the same
trajectory per molecule (Langevin, Langevin with a fixed centre of mass, NVE), one model
call a step for all molecules, and a failed molecule frozen and flagged while the rest run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from convergent.screen.batchmd import BatchMD, MDSettings, too_close_or_apart

NAMES = ("H2O", "CH4", "NH3")
STEPS, EVERY = 24, 6
# float32 forces: one molecule alone or packed with others differs by summation order only
# (a few float32 ulps of each force); over 24 steps at 0.5 fs that moves atoms by far less
# than 1e-5 Å, while a wrong integrator coefficient or random draw moves them by ~1e-3 Å.
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    from convergent.models.config import ModelConfig
    from convergent.models.molecular import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(hidden=16, layers=1, heads=2)).eval()


def _molecules():
    from ase.build import molecule

    return [molecule(n) for n in NAMES]


def _ase(model, atoms, settings: MDSettings, seed: int, velocities=None):
    """ASE's own loop on one molecule: positions every EVERY steps (frame 0 first)."""
    from ase import units
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet

    from convergent.models.calculator import SurrogateCalculator

    atoms = atoms.copy()
    atoms.calc = SurrogateCalculator(model)
    rng = np.random.default_rng(seed)
    if settings.fix_com:
        atoms.set_constraint(FixCom())
    if velocities is None:
        MaxwellBoltzmannDistribution(atoms, temperature_K=settings.temperature_K, rng=rng)
    else:
        atoms.set_velocities(velocities)
    dt = settings.timestep_fs * units.fs
    dyn = (VelocityVerlet(atoms, dt) if settings.friction_per_fs == 0 else
           Langevin(atoms, dt, temperature_K=settings.temperature_K,
                    friction=settings.friction_per_fs / units.fs, rng=rng, fixcm=False))
    frames = [atoms.get_positions()]
    kinetic = [atoms.get_kinetic_energy()]
    for _ in range(STEPS // EVERY):
        dyn.run(EVERY)
        frames.append(atoms.get_positions())
        kinetic.append(atoms.get_kinetic_energy())
    return np.stack(frames), np.asarray(kinetic)


@pytest.mark.numerics
@pytest.mark.parametrize("settings", [
    MDSettings(temperature_K=600.0, friction_per_fs=0.02),
    MDSettings(temperature_K=300.0, friction_per_fs=0.01, fix_com=True),
    MDSettings(temperature_K=300.0, friction_per_fs=0.0)], ids=["langevin", "fixcom", "nve"])
def test_each_molecule_follows_ases_own_loop(model, settings):
    mols = _molecules()
    seeds = [11, 12, 13]
    vel = None
    if settings.fix_com or settings.friction_per_fs == 0:  # ASE draws them under the constraint
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

        vel = []
        for a, s in zip(mols, seeds, strict=True):
            b = a.copy()
            MaxwellBoltzmannDistribution(b, temperature_K=settings.temperature_K,
                                         rng=np.random.default_rng(100 + s))
            Stationary(b)
            vel.append(b.get_velocities())
    md = BatchMD([model], [a.numbers for a in mols], [a.positions for a in mols], settings,
                 [np.random.default_rng(s) for s in seeds], velocities=vel)
    traj = md.run(STEPS, interval=EVERY)
    for i, (a, s) in enumerate(zip(mols, seeds, strict=True)):
        ref, ref_kinetic = _ase(model, a, settings, s, None if vel is None else vel[i])
        got = np.stack(traj[i].positions)
        # the kinetic energy at each frame is ASE's (end-of-step velocities): a few float32
        # ulps of the forces over 24 steps stay far below 1e-4 of it, while recording the
        # half-kick velocities instead would be off by percents
        np.testing.assert_allclose(traj[i].kinetic, ref_kinetic, rtol=1e-4)
        assert got.shape == ref.shape == (STEPS // EVERY + 1, len(a), 3)
        assert traj[i].steps == list(range(0, STEPS + 1, EVERY)) and traj[i].stable
        assert np.abs(got - ref).max() <= ATOL, (NAMES[i], np.abs(got - ref).max())
        assert np.abs(got[-1] - got[0]).max() > 100 * ATOL  # the molecule did move
        if settings.fix_com:
            m = a.get_masses()[:, None]
            com = (got * m).sum(1) / m.sum()
            assert np.abs(com - com[0]).max() < 1e-9


class _Counting(torch.nn.Module):
    """A committee member that counts its forward calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_one_call_a_step_and_a_failed_molecule_is_frozen_and_flagged(model):
    mols = _molecules()
    a, b = _Counting(model), _Counting(model)
    base = too_close_or_apart()

    def check(i, pos, energy):  # NH3 "fails" from step 10 on (seen at the frame of step 12)
        return "test failure" if i == 2 and md.step_no >= 10 else base(i, pos, energy)

    md = BatchMD([a, b], [m.numbers for m in mols], [m.positions for m in mols],
                 MDSettings(), [np.random.default_rng(s) for s in range(3)], check=check)
    traj = md.run(STEPS, interval=EVERY)
    assert a.calls == b.calls == STEPS + 1  # the start, then one per step, all molecules packed
    assert traj[2].failure == "test failure" and traj[2].failed_step == 12
    assert traj[2].steps == [0, 6, 12] and md.active == [0, 1]
    assert all(traj[i].stable and traj[i].steps[-1] == STEPS for i in (0, 1))
    # two identical members: no spread
    assert max(traj[0].energy_std) == 0.0 and max(traj[0].force_std_max) == 0.0
