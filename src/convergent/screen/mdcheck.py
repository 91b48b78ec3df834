"""Does the surrogate keep molecules bonded in MD? Langevin runs from G2 geometries.

A surrogate can fit held-out energies and still let a molecule collapse once dynamics
take it where no training structure went (two H atoms of one heavy atom fused at
0.5-0.7 Å, found on the demo's model before the repulsive prior). :func:`md_check` runs
``seeds`` Langevin trajectories of each molecule at ``temperature_K`` for ``time_fs`` and
calls a run stable when every check passes :class:`StabilityMonitor`'s :class:`Criteria`
(the MD-stability bench's, bench/models/md_stability.py: no bond of the start stretched past 1.5x,
no two atoms closer than 0.7 Å, no energy blow-up past 1 eV/atom, nothing non-finite).

Every run moves in one batch (:mod:`convergent.screen.batchmd`): each step is one model
call for all molecules and seeds; each run has its own random stream and is checked on
its own atoms, and a run that fails stops there while the others go on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convergent.core.elements import covalent_bonds
from convergent.screen.batchmd import BatchMD, MDSettings

#: G2 molecules with two or three H atoms on one heavy atom (where the demo's model failed).
MOLECULES = ("H2O", "NH3", "CH4", "C2H6", "CH3OH", "H3CNH2")


@dataclass
class MDRun:
    """One molecule's trajectory: stable, or when and how its bonds changed."""

    molecule: str
    seed: int
    stable: bool
    time_fs: float  # simulated until the first change, or the whole run
    event: str | None = None  # e.g. "atoms 1-2 at 0.58 Å" (StabilityMonitor.check's reason)


@dataclass
class MDCheck:
    """The result of :func:`md_check` (JSON-ready with :meth:`to_dict`)."""

    temperature_K: float
    time_fs: float
    timestep_fs: float
    friction_per_fs: float
    runs: list[MDRun] = field(default_factory=list)

    @property
    def stable(self) -> int:
        return sum(r.stable for r in self.runs)

    def line(self) -> str:
        bad = [f"{r.molecule} seed {r.seed}: {r.event} at {r.time_fs:.0f} fs"
               for r in self.runs if not r.stable]
        head = (f"MD check (Langevin {self.temperature_K:g} K, {self.time_fs / 1000:g} ps, "
                f"{len({r.seed for r in self.runs})} seeds): {self.stable}/{len(self.runs)} "
                "runs stay bonded")
        return head + ("; " + "; ".join(bad[:4]) if bad else "")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stable_runs": self.stable, "total_runs": len(self.runs)}


@dataclass(frozen=True)
class Criteria:
    """What counts as physical (defaults: the issue's 1.5x / 0.7 Å, blow-up 1 eV/atom)."""

    stretch: float = 1.5  # a start bond longer than this x its start length fails
    min_distance: float = 0.7  # Å: any pair closer fails
    energy_per_atom: float = 1.0  # eV/atom: |E_pot - E_pot(start)| / n_atoms above fails
    bond_scale: float = 1.2  # bonded at the start: d < bond_scale x (r_cov,i + r_cov,j)


class StabilityMonitor:
    """Checks frames of one trajectory against :class:`Criteria` relative to its start."""

    def __init__(self, numbers: np.ndarray, positions: np.ndarray, energy: float,
                 criteria: Criteria | None = None) -> None:
        self.c = criteria or Criteria()
        self.n = len(numbers)
        self.bonds = covalent_bonds(numbers, np.asarray(positions, float), self.c.bond_scale)
        self.d0 = self._lengths(np.asarray(positions, float))
        self.e0 = float(energy)
        self.iu = np.triu_indices(self.n, k=1)

    def _lengths(self, pos: np.ndarray) -> np.ndarray:
        b = self.bonds
        return np.linalg.norm(pos[b[:, 0]] - pos[b[:, 1]], axis=1)

    def check(self, positions: np.ndarray, energy: float) -> str | None:
        """None when the frame is physical, else the reason (one line)."""
        pos = np.asarray(positions, float)
        if not (np.isfinite(pos).all() and np.isfinite(energy)):
            return "non-finite positions or energy"
        if len(self.bonds):
            ratio = self._lengths(pos) / self.d0
            k = int(np.argmax(ratio))
            if ratio[k] > self.c.stretch:
                i, j = self.bonds[k]
                return f"bond {i}-{j} stretched to {ratio[k]:.2f}x its start length"
        if self.n > 1:
            d = np.linalg.norm(pos[:, None] - pos[None], axis=-1)[self.iu]
            k = int(np.argmin(d))
            if d[k] < self.c.min_distance:
                return f"atoms {self.iu[0][k]}-{self.iu[1][k]} at {d[k]:.2f} Å"
        de = abs(float(energy) - self.e0) / self.n
        if de > self.c.energy_per_atom:
            return f"energy blow-up: |E - E0| = {de:.2f} eV/atom"
        return None


def first_failure(numbers: np.ndarray, positions: np.ndarray, energies: np.ndarray,
                  criteria: Criteria | None = None) -> tuple[int, str] | None:
    """(index, reason) of the first unphysical frame of ``positions`` [F, N, 3] with
    potential ``energies`` [F] (frame 0 is the start), or None when all are physical."""
    mon = StabilityMonitor(numbers, positions[0], energies[0], criteria)
    for k in range(1, len(positions)):
        why = mon.check(positions[k], energies[k])
        if why is not None:
            return k, why
    return None


def md_check(model: Any, molecules: tuple[str, ...] = MOLECULES, seeds: int = 4,
             temperature_K: float = 300.0, time_fs: float = 500.0, timestep_fs: float = 0.5,
             friction_per_fs: float = 0.01, check_every: int = 10,
             criteria: Criteria | None = None) -> MDCheck:
    """Langevin MD of each of ``molecules`` (ASE G2 names) with the surrogate ``model`` (a
    model directory or a loaded model), ``seeds`` runs of each (:func:`stability_runs`)."""
    from ase.build import molecule

    from convergent.models.io import load_model

    net = load_model(model)[0] if isinstance(model, str | Path) else model
    g2 = {name: molecule(name) for name in molecules}
    structures = [(name, a.numbers, a.positions) for name, a in g2.items()]
    settings = MDSettings(temperature_K, timestep_fs, friction_per_fs, fix_com=True)
    return stability_runs([net], structures, seeds, settings, time_fs, check_every, criteria)[0]


def stability_runs(models: list[Any], structures: list[tuple[str, Any, Any]], seeds: int,
                   settings: MDSettings, time_fs: float, check_every: int = 10,
                   criteria: Criteria | None = None) -> tuple[MDCheck, BatchMD]:
    """``seeds`` runs of each ``(name, numbers, positions)`` structure with the committee
    ``models``, all in one batch (:class:`~convergent.screen.batchmd.BatchMD`: one model
    call a step for all, each run with its own random stream), each checked by its
    :class:`StabilityMonitor` every ``check_every`` steps; the result and the runs."""
    from ase import Atoms
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

    runs = [(s, seed) for seed in range(seeds) for s in structures]
    atoms = [Atoms(numbers=z, positions=x) for (_, z, x), _ in runs]
    rngs = [np.random.default_rng([seed, k]) for k, (_, seed) in enumerate(runs)]
    for a, rng in zip(atoms, rngs, strict=True):
        MaxwellBoltzmannDistribution(a, temperature_K=settings.temperature_K, rng=rng)
        Stationary(a)
    mons: dict[int, StabilityMonitor] = {}
    md = BatchMD(models, [a.numbers for a in atoms], [a.positions for a in atoms], settings, rngs,
                 check=lambda i, pos, energy: mons[i].check(pos, energy),
                 velocities=[a.get_velocities() for a in atoms])
    for i, t in enumerate(md.traj):  # the start frame, with the model's energy
        mons[i] = StabilityMonitor(t.numbers, t.positions[0], t.energy[0], criteria)
    md.run(int(round(time_fs / settings.timestep_fs)), interval=check_every)
    out = MDCheck(settings.temperature_K, time_fs, settings.timestep_fs, settings.friction_per_fs)
    for ((name, _, _), seed), t in zip(runs, md.traj, strict=True):
        out.runs.append(MDRun(name, seed, True, time_fs) if t.stable
                        else MDRun(name, seed, False, t.failed_step * settings.timestep_fs, t.failure))
    return out, md
