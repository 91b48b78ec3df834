"""Planning: a campaign's molecules -> deterministic record keys, grouped into tasks.

Every frame depends only on (seed, molecule, frame index), never on chunking or order, so
the same config always gives the same keys (what makes resume work).
"""

from __future__ import annotations

import numpy as np

from convergent.sim.calculators import CalcSpec
from convergent.sim.config import SimulateConfig
from convergent.sim.molecules import Molecule, stable_int
from convergent.sim.samplers import dimer_positions, distort_positions
from convergent.sim.tasks import FrameItem, FramesTask, MDTask, Task


def frame_key(seed: int, molecule_id: str, tag: str, index: int) -> str:
    """The record key of frame ``index`` of ``molecule_id`` (deterministic)."""
    return f"s{seed}/{molecule_id}/{tag}/{index:05d}"


def _draw(seed: int, molecule_id: str, frame: int) -> float:
    return stable_int("distorted", seed, molecule_id, frame) % 10_000 / 10_000


def distorted(seed: int, molecule_id: str, frame: int, fraction: float) -> bool:
    """Whether rattle frame ``frame`` of ``molecule_id`` is distorted first (seeded; frame 0
    never, so every molecule keeps an undistorted frame)."""
    return frame > 0 and _draw(seed, molecule_id, frame) < fraction


def dimerised(sim: SimulateConfig, mol: Molecule, frame: int) -> bool:
    """Whether rattle frame ``frame`` of ``mol`` is a dimer (seeded, on a share
    ``sim.dimer_fraction`` of the frames that are not distorted; frame 0 never; only
    molecules with multiplicity 1, whose pairs are then singlets too)."""
    u = _draw(sim.seed, mol.molecule_id, frame)
    lo = sim.distort_fraction
    return frame > 0 and mol.multiplicity == 1 and lo <= u < lo + sim.dimer_fraction


def partner(sim: SimulateConfig, mol: Molecule, frame: int, singlets: list[Molecule]) -> Molecule:
    """The partner of dimer frame ``frame`` of ``mol``: a seeded pick among the campaign's
    singlet molecules (``mol`` itself included), so pairs of unlike molecules are sampled
    too. The frame keeps ``mol``'s id; its ``meta`` names the partner."""
    return singlets[stable_int("partner", sim.seed, mol.molecule_id, frame) % len(singlets)]


def rattle_item(sim: SimulateConfig, mol: Molecule, j: int, singlets: list[Molecule]) -> FrameItem:
    """Rattle frame ``j`` of ``mol``: distorted or a dimer first where the draw says so."""
    meta = {"sampler": "rattle", "sigma": sim.rattle_sigma, "frame": j, "seed": sim.seed,
            "origin": mol.origin}
    key = frame_key(sim.seed, mol.molecule_id, "rattle", j)
    rattle = (sim.rattle_sigma, sim.seed, j)
    if distorted(sim.seed, mol.molecule_id, j, sim.distort_fraction):
        meta["distort"] = distort_positions(mol.numbers, mol.positions, sim.seed,
                                            mol.molecule_id, j)[1]
    elif dimerised(sim, mol, j):
        other = partner(sim, mol, j, singlets)
        pos, contact = dimer_positions(mol.positions, other.positions, sim.seed, mol.molecule_id, j)
        meta["dimer"] = {"partner": other.molecule_id, "contact": round(contact, 4)}
        return FrameItem(key, mol.molecule_id, np.concatenate([mol.numbers, other.numbers]), pos,
                         mol.charge + other.charge, 1, meta, rattle=rattle)
    return FrameItem(key, mol.molecule_id, mol.numbers, mol.positions, mol.charge,
                     mol.multiplicity, meta, rattle=rattle)


def plan_tasks(sim: SimulateConfig, molecules: list[Molecule]) -> list[Task]:
    """Split the campaign into tasks, deterministically (same config -> same tasks/keys)."""
    calc = CalcSpec.from_simulate(sim)
    n_mol = len(molecules)
    tasks: list[Task] = []
    if sim.sampler == "rattle":
        base, extra = divmod(sim.frames, n_mol)
        singlets = [m for m in molecules if m.multiplicity == 1]
        items = [rattle_item(sim, mol, j, singlets) for m_idx, mol in enumerate(molecules)
                 for j in range(base + (1 if m_idx < extra else 0))]
        for c in range(0, len(items), sim.chunk_size):
            tasks.append(FramesTask(f"r{c // sim.chunk_size:05d}", items[c:c + sim.chunk_size],
                                    calc, sim.min_distance, sim.timeout_s))
        return tasks
    # md: trajectory t -> (molecule, temperature) combination, replica
    temps = list(sim.temperatures)
    n_combo = n_mol * len(temps)
    n_traj = -(-sim.frames // sim.md_frames)
    for t in range(n_traj):
        combo, replica = t % n_combo, t // n_combo
        mol = molecules[combo // len(temps)]
        temp = float(temps[combo % len(temps)])
        n = min(sim.md_frames, sim.frames - t * sim.md_frames)
        tag = f"md{temp:g}K-r{replica}"
        keys = [frame_key(sim.seed, mol.molecule_id, tag, j) for j in range(n)]
        tasks.append(MDTask(f"m{t:05d}", mol, temp, replica, keys, calc, sim.seed,
                            sim.md_interval, sim.md_warmup, sim.md_timestep_fs,
                            sim.md_friction, sim.min_distance, sim.timeout_s))
    return tasks

