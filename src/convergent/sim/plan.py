"""Planning: a campaign's molecules -> deterministic record keys, grouped into tasks.

Every frame depends only on (seed, molecule, frame index), never on chunking or order, so
the same config always gives the same keys (what makes resume work).
"""

from __future__ import annotations

from convergent.sim.calculators import CalcSpec
from convergent.sim.config import SimulateConfig
from convergent.sim.molecules import Molecule, stable_int
from convergent.sim.samplers import distort_positions
from convergent.sim.tasks import FrameItem, FramesTask, MDTask, Task


def frame_key(seed: int, molecule_id: str, tag: str, index: int) -> str:
    """The record key of frame ``index`` of ``molecule_id`` (deterministic)."""
    return f"s{seed}/{molecule_id}/{tag}/{index:05d}"


def distorted(seed: int, molecule_id: str, frame: int, fraction: float) -> bool:
    """Whether rattle frame ``frame`` of ``molecule_id`` is distorted first (seeded; frame 0
    never, so every molecule keeps an undistorted frame)."""
    return frame > 0 and stable_int("distorted", seed, molecule_id, frame) % 10_000 < fraction * 10_000


def plan_tasks(sim: SimulateConfig, molecules: list[Molecule]) -> list[Task]:
    """Split the campaign into tasks, deterministically (same config -> same tasks/keys)."""
    calc = CalcSpec.from_simulate(sim)
    n_mol = len(molecules)
    tasks: list[Task] = []
    if sim.sampler == "rattle":
        base, extra = divmod(sim.frames, n_mol)
        items: list[FrameItem] = []
        tag = "rattle"
        for m_idx, mol in enumerate(molecules):
            for j in range(base + (1 if m_idx < extra else 0)):
                meta = {"sampler": "rattle", "sigma": sim.rattle_sigma, "frame": j,
                        "seed": sim.seed, "origin": mol.origin}
                if distorted(sim.seed, mol.molecule_id, j, sim.distort_fraction):
                    meta["distort"] = distort_positions(mol.numbers, mol.positions, sim.seed,
                                                        mol.molecule_id, j)[1]
                items.append(FrameItem(frame_key(sim.seed, mol.molecule_id, tag, j),
                                       mol.molecule_id, mol.numbers, mol.positions, mol.charge,
                                       mol.multiplicity, meta,
                                       rattle=(sim.rattle_sigma, sim.seed, j)))
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

