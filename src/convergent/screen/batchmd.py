"""Batched molecular dynamics: many molecules advanced together, one model call a step.

:class:`BatchMD` packs the molecules that are still running into one batch, so each step
costs one forward and backward pass of each committee member over all of them, whatever
their number. The integrator is ASE's Langevin scheme (``ase.md.langevin.Langevin``, with
``fixcm=False``) applied per molecule: every molecule has its own random stream, drawn in
the order ASE draws it, so a molecule's trajectory is the one ASE's one-molecule loop gives
with the same generator (tests/screen/test_batchmd.py checks it to float32 tolerance).
``friction_per_fs = 0`` is velocity Verlet (NVE). ``fix_com`` keeps each molecule's centre
of mass where it is, as ASE's ``FixCom`` constraint does.

A molecule whose frame fails its check (``check(index, positions, energy) -> reason |
None``, at every kept frame: atoms too close, a bond broken, an energy blow-up) is frozen
there and flagged with the step and the reason; the others go on. Units: Å, eV, fs, K (ASE's internally).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["BatchMD", "MDSettings", "Trajectory", "committee_forces", "too_close_or_apart"]

Check = Callable[[int, np.ndarray, float], "str | None"]


@dataclass(frozen=True)
class MDSettings:
    """Langevin (or, with ``friction_per_fs`` 0, NVE) settings shared by every molecule."""

    temperature_K: float = 300.0
    timestep_fs: float = 0.5
    friction_per_fs: float = 0.01
    fix_com: bool = False


@dataclass
class Trajectory:
    """One molecule's run: frames kept every ``interval`` steps (frame 0: the start), the
    committee's energy and spreads at each, the kinetic energy (eV, the end-of-step
    velocities, as ASE's ``get_kinetic_energy``), and the failure, if any."""

    numbers: np.ndarray
    positions: list[np.ndarray] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    energy: list[float] = field(default_factory=list)
    energy_std: list[float] = field(default_factory=list)
    force_std_max: list[float] = field(default_factory=list)
    kinetic: list[float] = field(default_factory=list)
    failed_step: int | None = None
    failure: str | None = None

    @property
    def stable(self) -> bool:
        return self.failure is None


def too_close_or_apart(min_distance: float = 0.6, max_neighbour: float = 4.0) -> Check:
    """The exploration check: two atoms closer than ``min_distance`` Å, or an atom farther
    than ``max_neighbour`` Å from every other (the molecule flew apart)."""

    def check(_: int, pos: np.ndarray, energy: float) -> str | None:
        if not (np.isfinite(pos).all() and np.isfinite(energy)):
            return "non-finite positions or energy"
        if len(pos) < 2:
            return None
        d = np.sqrt(((pos[:, None] - pos[None]) ** 2).sum(-1)) + np.eye(len(pos)) * 1e3
        if d.min() < min_distance:
            return f"atoms at {d.min():.2f} Å"
        if d.min(1).max() > max_neighbour:
            return f"an atom {d.min(1).max():.1f} Å from the others"
        return None

    return check


def committee_forces(models: Sequence[Any], numbers: Sequence[np.ndarray],
                     positions: Sequence[np.ndarray], device: str = "cpu") -> dict[str, np.ndarray]:
    """Energies, forces and their committee spreads for molecules packed in one batch:
    ``energy`` [B] and ``energy_std`` [B] (eV), ``forces`` [N, 3] (eV/Å, float64) and
    ``force_std`` [N] (norm of the per-atom spread; zeros for one model)."""
    import torch

    from convergent.models.batching import collate_records
    from convergent.models.molecular import energy_and_forces

    recs = [{"numbers": z, "positions": p} for z, p in zip(numbers, positions, strict=True)]
    es, fs = [], []
    for m in models:
        batch = collate_records(recs, dtype=getattr(m, "input_dtype", torch.float32)).to(device)
        e, f = energy_and_forces(m, batch, training=False)
        es.append(e.double().cpu().numpy())
        fs.append(f.double().cpu().numpy())
    e_arr, f_arr = np.stack(es), np.stack(fs)
    k = len(models)
    return {"energy": e_arr.mean(0), "forces": f_arr.mean(0),
            "energy_std": e_arr.std(0, ddof=1) if k > 1 else np.zeros(e_arr.shape[1]),
            "force_std": (np.linalg.norm(f_arr.std(0, ddof=1), axis=1) if k > 1
                          else np.zeros(f_arr.shape[1]))}


class BatchMD:
    """Molecules advanced together (see the module doc). ``rngs[i]`` is molecule ``i``'s
    random stream; velocities start from ``velocities`` (Å/ASE time unit) or are drawn
    from Maxwell-Boltzmann at the temperature with that stream, as ASE draws them."""

    def __init__(self, models: Sequence[Any], numbers: Sequence[np.ndarray],
                 positions: Sequence[np.ndarray], settings: MDSettings,
                 rngs: Sequence[np.random.Generator], *, check: Check | None = None,
                 velocities: Sequence[np.ndarray] | None = None, device: str = "cpu") -> None:
        from ase.data import atomic_masses

        self.models, self.s, self.check, self.device = list(models), settings, check, device
        self.rngs = list(rngs)
        self.z = [np.asarray(z, dtype=np.int64) for z in numbers]
        self.x = [np.array(p, dtype=np.float64) for p in positions]
        self.m = [atomic_masses[z][:, None] for z in self.z]
        self.v = (list(velocities) if velocities is not None
                  else [self._thermal(i) for i in range(len(self.z))])
        self.traj = [Trajectory(z) for z in self.z]
        self.active = list(range(len(self.z)))
        self.step_no = 0
        self._coefficients()
        self.f = self._forces(record=True)
        self._record_kinetic()

    def _thermal(self, i: int) -> np.ndarray:
        from ase import Atoms
        from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

        a = Atoms(numbers=self.z[i], positions=self.x[i])
        MaxwellBoltzmannDistribution(a, temperature_K=self.s.temperature_K, rng=self.rngs[i])
        return a.get_velocities()

    def _coefficients(self) -> None:
        """ASE Langevin's c1..c5 per atom (updatevars), in ASE's units."""
        from ase import units

        dt, kt = self.s.timestep_fs * units.fs, self.s.temperature_K * units.kB
        fr = self.s.friction_per_fs / units.fs
        self.dt = dt
        self.c = []
        for m in self.m:
            sigma = np.sqrt(2 * kt * fr / m)
            c5 = dt**1.5 * sigma / (2 * np.sqrt(3))
            self.c.append((dt / 2.0 - dt * dt * fr / 8.0, dt * fr / 2 - dt * dt * fr * fr / 8.0,
                           np.sqrt(dt) * sigma / 2.0 - dt**1.5 * fr * sigma / 8.0, fr / 2.0 * c5, c5))

    def _forces(self, record: bool = False) -> dict[int, np.ndarray]:
        """Forces of every running molecule (one committee call); with ``record``, a frame."""
        out = committee_forces(self.models, [self.z[i] for i in self.active],
                               [self.x[i] for i in self.active], self.device)
        forces, at = {}, 0
        for b, i in enumerate(self.active):
            n = len(self.z[i])
            forces[i] = out["forces"][at:at + n]
            if record:
                t = self.traj[i]
                t.positions.append(self.x[i].copy())
                t.steps.append(self.step_no)
                t.energy.append(float(out["energy"][b]))
                t.energy_std.append(float(out["energy_std"][b]))
                t.force_std_max.append(float(out["force_std"][at:at + n].max()))
            at += n
        self._last_energy = {i: float(out["energy"][b]) for b, i in enumerate(self.active)}
        # (FixCom's force adjustment is not needed: it only adds the same acceleration to
        # every atom of a molecule, which the position and momentum fixes remove)
        return forces

    def _kick_drift(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """First half-kick and the drift of molecule ``i``; its random terms for the second
        half-kick."""
        c1, c2, c3, c4, c5 = self.c[i]
        n = len(self.z[i])
        if self.s.friction_per_fs > 0:
            xi = self.rngs[i].standard_normal(size=(n, 3))
            eta = self.rngs[i].standard_normal(size=(n, 3))
            rnd_pos, rnd_vel = c5 * eta, c3 * xi - c4 * eta
        else:
            rnd_pos = rnd_vel = np.zeros((n, 3))
        self.v[i] = self.v[i] + c1 * self.f[i] / self.m[i] - c2 * self.v[i] + rnd_vel
        x0 = self.x[i]
        new = x0 + self.dt * self.v[i] + rnd_pos
        if self.s.fix_com:  # FixCom.adjust_positions: the centre of mass stays
            w = self.m[i] / self.m[i].sum()
            new = new - ((new - x0) * w).sum(0)
        self.x[i] = new
        self.v[i] = (new - x0 - rnd_pos) / self.dt
        return rnd_vel, x0

    def run(self, steps: int, interval: int = 1) -> list[Trajectory]:
        """Advance ``steps`` steps, keeping a frame every ``interval``; returns the
        trajectories (also in ``self.traj``)."""
        for _ in range(steps):
            if not self.active:
                break
            rnd = {i: self._kick_drift(i)[0] for i in self.active}
            self.step_no += 1
            frame = self.step_no % interval == 0
            self.f = self._forces(record=frame)
            for i in self.active:
                c1, c2 = self.c[i][0], self.c[i][1]
                self.v[i] = self.v[i] + c1 * self.f[i] / self.m[i] - c2 * self.v[i] + rnd[i]
                if self.s.fix_com:  # FixCom.adjust_momenta: no net momentum
                    self.v[i] = self.v[i] - (self.v[i] * self.m[i]).sum(0) / self.m[i].sum()
            if frame:
                self._record_kinetic()
                self._flag()
        return self.traj

    def _record_kinetic(self) -> None:
        """The kinetic energy (eV) of each running molecule at the frame just kept."""
        for i in self.active:
            self.traj[i].kinetic.append(float(0.5 * (self.m[i] * self.v[i] ** 2).sum()))

    def _flag(self) -> None:
        """Freeze and flag the molecules whose current frame fails the check."""
        if self.check is None:
            return
        for i in list(self.active):
            why = self.check(i, self.x[i], self._last_energy[i])
            if why is not None:
                self.traj[i].failed_step, self.traj[i].failure = self.step_no, why
                self.active.remove(i)
