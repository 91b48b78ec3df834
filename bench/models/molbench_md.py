"""Molecular dynamics with a trained potential, and what makes a trajectory physical.

Used by bench/models/md_stability.py. The pieces, each testable on its own:

* :class:`Criteria` / :class:`StabilityMonitor` — when a trajectory stops being physical:
  a covalent bond of the starting geometry (two atoms closer than ``bond_scale`` x the sum
  of their covalent radii) stretched beyond ``stretch`` x its start length, any pair of
  atoms closer than ``min_distance`` Å, a potential energy more than ``energy_per_atom``
  eV/atom away from the start's (an energy blow-up), or a non-finite value;
* :func:`first_failure` — the first failing frame of a recorded trajectory;
* :func:`drift_per_atom_ps` — NVE energy drift: slope of a linear fit of total energy per
  atom vs time (eV/atom/ps);
* :func:`pair_distance_density` / :func:`rdf_distance` — the radial distribution of all
  intramolecular pair distances (a density over r normalised by the number of pairs, so it
  integrates to 1 when every pair lies inside ``r_max``), averaged over frames and then over
  molecules, and the integrated absolute difference of two of them (0: identical, 2: disjoint);
* :func:`run_md` — seeded Langevin (or Langevin-thermalised NVE VelocityVerlet) MD with
  ASE, monitored every ``record_every`` steps and stopped at the first failure (the xTB
  reference: one tblite calculator per molecule);
* :func:`run_batched` — the same runs for a trained convergent model, every molecule in one
  :class:`convergent.screen.batchmd.BatchMD` (one model call a step for all of them; each
  molecule's trajectory is the one :func:`run_md` gives, to float tolerance).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# the stability criteria are the library's (convergent.screen.mdcheck, the demo's MD check)
from convergent.screen.mdcheck import (  # noqa: F401 - re-exported for the bench and tests
    Criteria,
    StabilityMonitor,
    covalent_bonds,
    first_failure,
)


def drift_per_atom_ps(times_ps: np.ndarray, total_energy: np.ndarray, n_atoms: int) -> float:
    """Slope (eV/atom/ps) of a least-squares line through total energy per atom vs time."""
    t, e = np.asarray(times_ps, float), np.asarray(total_energy, float) / n_atoms
    if len(t) < 2:
        raise ValueError("an energy drift needs at least two points")
    return float(np.polyfit(t, e, 1)[0])


def rdf_edges(r_max: float = 8.0, dr: float = 0.05) -> np.ndarray:
    return np.arange(0.0, r_max + dr / 2, dr)


def pair_distance_density(frames: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Histogram density of all pair distances of ``frames`` [F, N, 3] over ``edges``:
    counts / (pairs x frames x bin width), so it integrates to the fraction of pairs
    inside the last edge (1 when all are)."""
    frames = np.asarray(frames, float)
    n = frames.shape[1]
    i, j = np.triu_indices(n, k=1)
    d = np.linalg.norm(frames[:, i] - frames[:, j], axis=-1).ravel()
    counts, _ = np.histogram(d, bins=edges)
    return counts / (max(len(d), 1) * np.diff(edges))


def mean_density(per_molecule: list[np.ndarray]) -> np.ndarray:
    """The radial distribution of a set of molecules: their densities averaged (each
    molecule weighs the same, whatever its size or trajectory length)."""
    return np.mean(np.stack(per_molecule), axis=0)


def rdf_distance(g1: np.ndarray, g2: np.ndarray, edges: np.ndarray) -> float:
    """Integrated absolute difference of two densities over ``edges`` (0..2)."""
    return float(np.sum(np.abs(np.asarray(g1) - np.asarray(g2)) * np.diff(edges)))


@dataclass
class Trajectory:
    """One monitored trajectory (frames every ``record_every`` steps; frame 0 the start)."""

    times_ps: list[float] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    potential: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    failed_at_ps: float | None = None
    reason: str | None = None
    steps: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def stable(self) -> bool:
        return self.reason is None


def run_md(numbers: np.ndarray, positions: np.ndarray, calc: Any, temperature: float,
           steps: int, seed: int, ensemble: str = "langevin", timestep_fs: float = 0.5,
           friction_per_fs: float = 0.01, record_every: int = 10, thermalise_steps: int = 0,
           criteria: Criteria | None = None) -> Trajectory:
    """Seeded MD from ``positions`` with velocities drawn at ``temperature`` (no net
    momentum or rotation). ``ensemble`` ``langevin``: ``steps`` Langevin steps at
    ``temperature``; ``nve``: ``thermalise_steps`` Langevin steps first, then ``steps``
    VelocityVerlet steps, monitored and recorded from the start of NVE. Stops at the first
    unphysical frame (checked every ``record_every`` steps) or calculator error. The centre
    of mass is held by ``FixCom`` (Langevin's ``fixcm`` is deprecated in ASE 3.28+)."""
    from ase import Atoms, units
    from ase.md.langevin import Langevin
    from ase.md.verlet import VelocityVerlet

    from convergent.sim.samplers import thermalise

    if ensemble not in ("langevin", "nve"):
        raise ValueError(f"ensemble must be langevin or nve, not {ensemble!r}")
    atoms = Atoms(numbers=numbers, positions=positions)
    atoms.calc = calc
    rng = np.random.default_rng(seed)
    thermalise(atoms, temperature, rng)  # the same rng then drives Langevin's noise
    traj = Trajectory()
    w0, c0 = time.perf_counter(), time.thread_time()
    lang = Langevin(atoms, timestep_fs * units.fs, temperature_K=temperature,
                    friction=friction_per_fs / units.fs, fixcm=False, rng=rng)
    try:
        if ensemble == "nve" and thermalise_steps > 0:
            lang.run(thermalise_steps)
        dyn = lang if ensemble == "langevin" else VelocityVerlet(atoms, timestep_fs * units.fs)
        epot = atoms.get_potential_energy()
        mon = StabilityMonitor(atoms.numbers, atoms.positions, epot, criteria)
        done = 0

        def record() -> None:
            ep = float(atoms.get_potential_energy())
            traj.times_ps.append(done * timestep_fs / 1000.0)
            traj.positions.append(atoms.get_positions())
            traj.potential.append(ep)
            traj.total.append(ep + float(atoms.get_kinetic_energy()))

        record()
        while done < steps:
            k = min(record_every, steps - done)
            with np.errstate(all="ignore"):
                dyn.run(k)
            done += k
            record()
            why = mon.check(traj.positions[-1], traj.potential[-1])
            if why is not None:
                traj.reason, traj.failed_at_ps = why, traj.times_ps[-1]
                break
    except Exception as exc:  # noqa: BLE001 - a calculator that breaks down is a failure
        traj.reason = f"calculator error: {type(exc).__name__}: {exc}"[:200]
        traj.failed_at_ps = traj.times_ps[-1] if traj.times_ps else 0.0
    traj.steps = (thermalise_steps if ensemble == "nve" else 0) + round(
        (traj.times_ps[-1] if traj.times_ps else 0.0) * 1000.0 / timestep_fs)
    traj.wall_s, traj.cpu_s = time.perf_counter() - w0, time.thread_time() - c0
    return traj


def run_batched(model: Any, starts: list[dict[str, Any]], temperature: float, steps: int,
                seeds: list[int], *, timestep_fs: float, friction_per_fs: float,
                record_every: int, criteria: Criteria | None = None, ensemble: str = "langevin",
                thermalise_steps: int = 0, device: str = "cpu") -> list[Trajectory]:
    """:func:`run_md` for every start at once with ``model`` (a convergent surrogate):
    velocities drawn as run_md draws them (seed ``seeds[i]``, the same stream then drives
    the Langevin noise), the centre of mass held, each molecule checked every
    ``record_every`` steps and frozen at its first failure while the others go on."""
    from ase import Atoms

    from convergent.screen.batchmd import BatchMD, MDSettings
    from convergent.sim.samplers import thermalise

    if ensemble not in ("langevin", "nve"):
        raise ValueError(f"ensemble must be langevin or nve, not {ensemble!r}")
    zs = [np.asarray(s["numbers"], dtype=np.int64) for s in starts]
    xs = [np.asarray(s["positions"], dtype=np.float64) for s in starts]
    rngs, vel = [np.random.default_rng(s) for s in seeds], []
    for z, x, rng in zip(zs, xs, rngs, strict=True):
        atoms = Atoms(numbers=z, positions=x)
        thermalise(atoms, temperature, rng)
        vel.append(atoms.get_velocities())
    w0, c0 = time.perf_counter(), time.thread_time()
    lang = MDSettings(temperature, timestep_fs, friction_per_fs, fix_com=True)
    if ensemble == "nve" and thermalise_steps > 0:
        warm = BatchMD([model], zs, xs, lang, rngs, velocities=vel, device=device)
        warm.run(thermalise_steps, interval=thermalise_steps)
        xs, vel = warm.x, warm.v
    monitors: dict[int, StabilityMonitor] = {}
    settings = lang if ensemble == "langevin" else MDSettings(temperature, timestep_fs, 0.0, True)
    md = BatchMD([model], zs, xs, settings, rngs, velocities=vel, device=device,
                 check=lambda i, pos, e: monitors[i].check(pos, e))
    for i, bt in enumerate(md.traj):
        monitors[i] = StabilityMonitor(zs[i], bt.positions[0], bt.energy[0], criteria)
    md.run(steps, interval=record_every)
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    out = []
    for bt in md.traj:
        ps = timestep_fs / 1000.0
        out.append(Trajectory(
            times_ps=[s * ps for s in bt.steps], positions=bt.positions, potential=bt.energy,
            total=[e + k for e, k in zip(bt.energy, bt.kinetic, strict=True)],
            failed_at_ps=None if bt.failed_step is None else bt.failed_step * ps,
            reason=bt.failure, steps=thermalise_steps + (bt.steps[-1] if bt.steps else 0),
            wall_s=wall / len(starts), cpu_s=cpu / len(starts)))
    return out
