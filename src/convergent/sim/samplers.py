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

from convergent.core.elements import covalent_bonds
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


DISTORTIONS = ("compress", "angle", "bond")
def _angles(pos: np.ndarray, bonds: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(centre, j, k) of every bond angle that can close: j and k both bonded to the
    centre, not in a line (a linear X-C-Y has no plane to close in)."""
    nbrs: dict[int, list[int]] = {}
    for a, b in bonds:
        nbrs.setdefault(a, []).append(b)
        nbrs.setdefault(b, []).append(a)
    out = []
    for c, n in nbrs.items():
        for j in n:
            for k in n:
                u, w = pos[j] - pos[c], pos[k] - pos[c]
                if j < k and u @ w > -0.95 * np.linalg.norm(u) * np.linalg.norm(w):
                    out.append((c, j, k))
    return out


def _close_angle(pos: np.ndarray, c: int, j: int, k: int, target: float) -> np.ndarray:
    """``pos`` with ``k`` swung towards ``j`` about ``c`` (|c-k| kept) until |j-k| <= target."""
    out = pos.copy()
    u, w = pos[j] - pos[c], pos[k] - pos[c]
    lw = np.linalg.norm(w)
    for t in np.linspace(0.0, 1.0, 41)[1:]:
        v = (1 - t) * w / lw + t * u / np.linalg.norm(u)
        out[k] = pos[c] + lw * v / max(np.linalg.norm(v), 1e-9)
        if np.linalg.norm(out[k] - pos[j]) <= target:
            break
    return out


def distort_positions(numbers: np.ndarray, positions: np.ndarray, seed: int, molecule_id: str,
                      frame: int, min_distance: float = 0.6) -> tuple[np.ndarray, str]:
    """A seeded distortion where energies rise steeply, so a model learns the short range:
    ``compress`` (the molecule scaled by 0.80-0.92 about its centre), ``angle`` (a
    neighbour of an atom swung towards another neighbour, bond length kept, until the two
    are 0.75-1.3 Å apart) or ``bond`` (a bond shortened to 0.72-0.88 of its length or
    stretched to 1.15-1.5 of it).
    No pair ends closer than ``min_distance`` Å (the step is halved until none does).
    Returns (positions, kind)."""
    rng = np.random.default_rng(stable_int("distort", seed, molecule_id, frame))
    pos = np.array(positions, dtype=np.float64)
    z = np.asarray(numbers)
    bonds = [(int(a), int(b)) for a, b in covalent_bonds(z, pos)]
    angles = _angles(pos, bonds)
    kind = DISTORTIONS[int(rng.integers(len(DISTORTIONS)))]
    if kind == "angle" and not angles:
        kind = "bond" if bonds else "compress"
    if kind == "bond" and not bonds:
        kind = "compress"
    if kind == "compress":
        c = pos.mean(0)
        out = c + (pos - c) * rng.uniform(0.80, 0.92)
    elif kind == "bond":
        a, b = bonds[int(rng.integers(len(bonds)))]
        if z[a] < z[b]:
            a, b = b, a  # move the lighter atom
        out = pos.copy()
        # shortened or stretched: energies rise on both sides of the bond length
        f = rng.uniform(0.72, 0.88) if rng.random() < 0.5 else rng.uniform(1.15, 1.5)
        out[b] = pos[a] + (pos[b] - pos[a]) * f
    else:
        out = _close_angle(pos, *angles[int(rng.integers(len(angles)))], rng.uniform(0.75, 1.3))
    for back in (1.0, 0.5, 0.25, 0.0):
        trial = pos + (out - pos) * back
        d = np.linalg.norm(trial[:, None] - trial[None], axis=-1) + np.eye(len(trial)) * 1e9
        if d.min() >= min_distance:
            break
    return trial, kind


def _rotation(rng: np.random.Generator) -> np.ndarray:
    """A uniformly random rotation matrix (QR of a Gaussian matrix, signs fixed)."""
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def dimer_positions(positions: np.ndarray, partner: np.ndarray, seed: int, molecule_id: str,
                    frame: int, contact: tuple[float, float] = (1.4, 4.5)) -> tuple[np.ndarray, float]:
    """A seeded dimer: the molecule at ``positions`` and a randomly rotated ``partner``
    (positions of another molecule or a copy of the same) brought in along a random
    direction until the closest pair between them is ``d`` Å, ``d`` drawn uniformly in
    ``contact`` — so a model sees where two molecules repel and, farther out, that they
    hardly interact. Returns (positions: the molecule's atoms then the partner's, d)."""
    rng = np.random.default_rng(stable_int("dimer", seed, molecule_id, frame))
    a = np.asarray(positions, dtype=np.float64)
    a = a - a.mean(0)
    b = np.asarray(partner, dtype=np.float64)
    b = (b - b.mean(0)) @ _rotation(rng).T
    u = rng.normal(size=3)
    u /= np.linalg.norm(u)
    d = float(rng.uniform(*contact))
    reach = float(np.linalg.norm(a, axis=1).max() + np.linalg.norm(b, axis=1).max())
    t = reach + d + 1.0  # the partner starts beyond any contact and approaches
    while t > 0.0:
        gap = np.linalg.norm(a[:, None] - (b + t * u)[None], axis=-1).min()
        if gap <= d:
            break
        # no distance shrinks by more than the step: coarse steps stay outside d
        t -= 0.01 if gap - d < 0.2 else gap - d - 0.1
    return np.concatenate([a, b + t * u]), float(gap)
