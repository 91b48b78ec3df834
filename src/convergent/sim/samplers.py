"""Samplers: Gaussian rattle and Langevin molecular dynamics, both seeded and reproducible.

Randomness always comes from ``numpy.random.default_rng`` seeded by a stable hash of
(campaign seed, molecule id, temperature, replica/frame), so a frame is the same in any
process, chunking, order or retry. Units: Å, eV, K, fs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from convergent.sim.molecules import Molecule, stable_int


def rattle_positions(
    positions: np.ndarray, sigma: float, seed: int, molecule_id: str, frame: int
) -> np.ndarray:
    """``positions`` plus i.i.d. Gaussian displacements of std ``sigma`` Å (frame 0 too).

    The displacement depends only on (seed, molecule_id, frame).
    """
    rng = np.random.default_rng(stable_int("rattle", seed, molecule_id, frame))
    return np.asarray(positions, dtype=np.float64) + rng.normal(0.0, sigma, size=np.shape(positions))


@dataclass
class MDFrame:
    """One saved MD frame: positions (Å), potential energy (eV), forces (eV/Å)."""

    index: int  # frame index within the trajectory
    step: int  # MD step number
    positions: np.ndarray
    energy: float
    forces: np.ndarray
    wall_s: float  # seconds of MD since the previous saved frame


def md_seed(seed: int, molecule_id: str, temperature: float, replica: int) -> int:
    """The RNG seed of one Langevin trajectory."""
    return stable_int("md", seed, molecule_id, f"{float(temperature):g}", replica)


def thermalise(atoms, temperature: float, rng: np.random.Generator) -> None:  # noqa: ANN001
    """Hold ``atoms``' centre of mass (``FixCom``: ASE's advice over Langevin's deprecated
    ``fixcm``) and draw seeded Maxwell-Boltzmann velocities at ``temperature`` K with no
    net momentum or rotation."""
    from ase.constraints import FixCom
    from ase.md import velocitydistribution as vd

    atoms.set_constraint(FixCom())
    draw = getattr(vd, "thermalize_momenta", None) or vd.MaxwellBoltzmannDistribution
    draw(atoms, temperature_K=temperature, rng=rng)
    vd.Stationary(atoms)
    if len(atoms) > 2:
        with np.errstate(invalid="ignore", divide="ignore"):  # linear molecules: Ip = 0
            vd.ZeroRotation(atoms)


def langevin_frames(
    mol: Molecule,
    calculator,
    temperature: float,
    n_frames: int,
    interval: int = 10,
    warmup: int = 20,
    timestep_fs: float = 0.5,
    friction: float = 0.01,
    seed: int = 0,
    replica: int = 0,
) -> Iterator[MDFrame]:
    """Run Langevin MD at ``temperature`` K with ``calculator``; yield every ``interval`` steps.

    Velocities start from a seeded Maxwell-Boltzmann distribution (no net momentum or
    rotation); ``warmup`` steps run before the first saved frame. ``friction`` in 1/fs.
    A failing force call raises the calculator's exception; frames yielded before stay valid.
    """
    from ase.md.langevin import Langevin
    from ase.units import fs

    atoms = mol.to_atoms()
    atoms.calc = calculator
    rng = np.random.default_rng(md_seed(seed, mol.molecule_id, temperature, replica))
    thermalise(atoms, temperature, rng)  # the same rng then drives Langevin's noise
    dyn = Langevin(
        atoms,
        timestep=timestep_fs * fs,
        temperature_K=temperature,
        friction=friction / fs,
        fixcm=False,
        rng=rng,
    )
    t0 = time.perf_counter()
    if warmup > 0:
        dyn.run(warmup)
    for j in range(n_frames):
        dyn.run(interval)
        t1 = time.perf_counter()
        yield MDFrame(
            index=j,
            step=int(dyn.nsteps),
            positions=atoms.get_positions().astype(np.float64),
            energy=float(atoms.get_potential_energy()),
            forces=np.asarray(atoms.get_forces(apply_constraint=False), dtype=np.float64).copy(),
            wall_s=t1 - t0,
        )
        t0 = t1
