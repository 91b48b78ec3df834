"""The units of work of a campaign: frames to label, chunked tasks, and what a task returns.

A :class:`FramesTask` is a chunk of independent single points (rattle frames,
relabelling); an :class:`MDTask` is one seeded Langevin trajectory whose frames are
labelled by the MD force calls. Tasks are plain data, cheap to ship to Dask workers.
Units: Å, K, fs, s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convergent.sim.calculators import CalcSpec
from convergent.sim.molecules import Molecule
from convergent.sim.samplers import distort_positions, rattle_positions


@dataclass
class FrameItem:
    """One single point to compute: a structure and its record key."""

    key: str
    molecule_id: str
    numbers: np.ndarray  # int64[N]
    positions: np.ndarray  # float64[N, 3], Å
    charge: int = 0
    multiplicity: int = 1
    meta: dict[str, Any] = field(default_factory=dict)  # sampler provenance
    # (sigma Å, seed, frame): the worker adds a seeded Gaussian rattle to ``positions``,
    # so the driver keeps one shared array per molecule instead of one per frame
    rattle: tuple[float, int, int] | None = None

    def structure(self) -> np.ndarray:
        """The positions to compute (Å), with the rattle applied if there is one."""
        if self.rattle is None:
            return self.positions
        sigma, seed, frame = self.rattle
        pos = self.positions
        if self.meta.get("distort"):
            pos = distort_positions(self.numbers, pos, seed, self.molecule_id, frame)[0]
        return rattle_positions(pos, sigma, seed, self.molecule_id, frame)


@dataclass
class FramesTask:
    """A chunk of independent single points (rattle frames, relabelling)."""

    task_id: str
    items: list[FrameItem]
    calc: CalcSpec
    min_distance: float = 0.5
    timeout_s: float = 300.0
    splittable: bool = True

    @property
    def keys(self) -> list[str]:
        return [it.key for it in self.items]

    def molecule_of(self, key: str) -> str:
        for it in self.items:
            if it.key == key:
                return it.molecule_id
        return ""

    def split(self) -> list[FramesTask]:
        """One task per frame (used after the chunk failed ``retries + 1`` times)."""
        return [
            FramesTask(f"{self.task_id}.{i}", [it], self.calc, self.min_distance,
                       self.timeout_s, splittable=False)
            for i, it in enumerate(self.items)
        ]


@dataclass
class MDTask:
    """One seeded Langevin trajectory; its frames are labelled by the MD force calls."""

    task_id: str
    molecule: Molecule
    temperature: float  # K
    replica: int
    frame_keys: list[str]
    calc: CalcSpec
    seed: int = 0
    interval: int = 10
    warmup: int = 20
    timestep_fs: float = 0.5
    friction: float = 0.01  # 1/fs
    min_distance: float = 0.5
    timeout_s: float = 300.0
    splittable: bool = False

    @property
    def keys(self) -> list[str]:
        return list(self.frame_keys)

    def molecule_of(self, key: str) -> str:
        return self.molecule.molecule_id


Task = FramesTask | MDTask


@dataclass
class TaskResult:
    """What a task sends back: records, per-frame quarantine entries and timings."""

    task_id: str
    records: list[Any]  # record dicts; PackedRecord when it comes back through the farm
    quarantined: list[dict[str, Any]]
    calc_s: float  # seconds inside calculator calls
    n_calcs: int  # calculator calls (MD: every step)
    wall_s: float  # seconds of the whole task on the worker
    host: str
    pid: int
    cpus: list[int] = field(default_factory=list)  # the worker's affinity mask
    slurm_job_id: str | None = None  # the Slurm job the worker ran in

