"""Worker side of a campaign: run one task and return its records and quarantine entries.

A failure that belongs to one structure (SCF not converged, bad geometry) is quarantined
inside the task; anything else fails the task as a whole, and the driver retries it.
Energies in eV, forces in eV/Å, positions in Å, times in s.
"""

from __future__ import annotations

import os
import pickle
import socket
import time

import numpy as np

from convergent.sim.calculators import (
    CalculationError,
    Labeller,
    check_geometry,
    make_calculator,
)
from convergent.sim.guards import watchdog
from convergent.sim.quarantine import quarantine_entry
from convergent.sim.records import make_record, pack_records
from convergent.sim.samplers import langevin_frames
from convergent.sim.tasks import FramesTask, MDTask, Task, TaskResult

_HOST = socket.gethostname()


def _placement() -> tuple[list[int], str | None]:
    """(affinity mask, Slurm job id) of this worker process."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cpus, os.environ.get("SLURM_JOB_ID")


def _run_frames(task: FramesTask) -> TaskResult:
    t0 = time.perf_counter()
    lab = Labeller(task.calc, task.min_distance)
    prov = task.calc.provenance()
    records, quarantined = [], []
    calc_s = 0.0
    for it in task.items:
        positions = it.structure()
        try:
            energy, forces, wall = lab.label(it.numbers, positions, it.charge, it.multiplicity)
        except CalculationError as exc:
            quarantined.append(quarantine_entry(it.key, it.molecule_id, str(exc),
                                                 kind=type(exc).__name__))
            continue
        calc_s += wall
        meta = {**prov, "wall_s": round(wall, 6), "host": _HOST, **it.meta}
        records.append(make_record(it.key, it.molecule_id, it.numbers, positions, it.charge,
                               it.multiplicity, energy, forces, meta))
    return TaskResult(task.task_id, records, quarantined, calc_s, len(task.items),
                      time.perf_counter() - t0, _HOST, os.getpid(), *_placement())


def _run_md(task: MDTask) -> TaskResult:
    t0 = time.perf_counter()
    mol = task.molecule
    prov = task.calc.provenance()
    records, quarantined = [], []
    calc_s = 0.0
    n_done = 0
    try:
        check_geometry(mol.numbers, mol.positions, task.min_distance)
        calc = make_calculator(task.calc, mol.charge, mol.multiplicity)
        frames = langevin_frames(
            mol, calc, task.temperature, len(task.frame_keys), task.interval, task.warmup,
            task.timestep_fs, task.friction, task.seed, task.replica,
        )
        for fr in frames:
            key = task.frame_keys[fr.index]
            calc_s += fr.wall_s
            n_done += 1
            check_geometry(mol.numbers, fr.positions, task.min_distance)
            if not np.isfinite(fr.energy) or not np.all(np.isfinite(fr.forces)):
                raise CalculationError("non-finite energy or forces")
            meta = {**prov, "wall_s": round(fr.wall_s, 6), "host": _HOST, "sampler": "md",
                    "temperature": task.temperature, "replica": task.replica, "step": fr.step,
                    "frame": fr.index, "timestep_fs": task.timestep_fs,
                    "friction": task.friction, "seed": task.seed, "origin": mol.origin}
            records.append(make_record(key, mol.molecule_id, mol.numbers, fr.positions, mol.charge,
                                   mol.multiplicity, fr.energy, fr.forces, meta))
    except Exception as exc:  # the trajectory cannot go on: quarantine its remaining frames
        from ase.calculators.calculator import CalculationFailed

        if not isinstance(exc, CalculationError | CalculationFailed | RuntimeError | ValueError):
            raise
        reason = f"md at {task.temperature:g} K stopped after {len(records)} frames: {exc}"
        for key in task.frame_keys[len(records):]:
            quarantined.append(quarantine_entry(key, mol.molecule_id, reason,
                                                 kind=type(exc).__name__))
    steps = task.warmup + task.interval * max(n_done, 1)
    return TaskResult(task.task_id, records, quarantined, calc_s, steps,
                      time.perf_counter() - t0, _HOST, os.getpid(), *_placement())


def execute_task(task: Task, dask_key: str = "") -> TaskResult:
    """Run one task on a worker (also usable in-process). Guarded by a timeout watchdog."""
    timer = watchdog(dask_key, task.timeout_s) if dask_key else None
    try:
        if isinstance(task, MDTask):
            return _run_md(task)
        return _run_frames(task)
    finally:
        if timer is not None:
            timer.cancel()


def execute_task_packed(task: Task, dask_key: str = "", compression: str = "zstd") -> bytes:
    """:func:`execute_task` with its records encoded, compressed and framed here, on the
    worker (:class:`~convergent.sim.records.PackedRecord`), and the result pickled into
    one in-band blob.

    The driver then only appends bytes to the open shard, and its event loop (which also
    runs the scheduler of a LocalCluster) handles one bytes frame per task instead of
    hundreds of small numpy frames. A record the dataset would refuse is quarantined.
    """
    res = execute_task(task, dask_key)
    t0 = time.perf_counter()
    res.records, refused = pack_records(res.records, compression)
    res.quarantined.extend(refused)
    res.wall_s += time.perf_counter() - t0
    return pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)
