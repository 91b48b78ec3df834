"""Config of the simulation campaign (``simulate`` section).

Every default works on a 2-core laptop: a LocalCluster with one single-threaded worker per
usable core, GFN2-xTB (tblite) on rattled C/H/N/O molecules of ASE's G2 collection.
Units: distances in Å, energies in eV, forces in eV/Å, temperatures in K, times in s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

# The Dask cluster's section lives in the core layer (convergent.cluster.pool builds clusters from
# it); re-exported here, where it used to be defined, for existing imports.
from convergent.cluster.config import ClusterConfig, SlurmConfig
from convergent.core.configbase import (
    Count,
    Count0,
    NonNegative,
    Positive,
    Section,
    Seed,
)

__all__ = ["ClusterConfig", "RelabelConfig", "SimulateConfig", "SlurmConfig"]


class RelabelConfig(Section):
    """Multi-fidelity: relabel a fraction of frames at a higher level into a second dataset."""

    fraction: float = Field(0.1, ge=0.0, le=1.0)  # of frames, chosen by a seeded key hash
    calculator: Literal["xtb", "dft", "emt"] = "dft"
    method: str | None = "B3LYP"  # 'HF' or a PySCF xc functional
    basis: str = "6-31G*"
    density_fit: bool = True
    auxbasis: str | None = None  # None: PySCF's default for the basis
    conv_tol: Positive = 1e-8  # Hartree
    max_cycle: Count = 100
    chunk_size: Count = 2
    timeout_s: NonNegative = 1800.0  # 0: no timeout
    retries: Count0 = 1
    seed: Seed = 0


class SimulateConfig(Section):
    """A high-throughput labelling campaign: source -> sampler -> calculator.

    ``source``: ``g2`` | ``s22`` | ``nci`` (the NCI SMILES file shipped with RDKit) |
    ``smiles:<file>`` (one SMILES per line, optional name after it) | a path to an
    ``.xyz``/``.extxyz`` file (or ``xyz:<path>``).
    ``frames`` is the total number of labelled frames to produce. ``rattle``: Gaussian
    displacements of sigma ``rattle_sigma`` Å, on ``distort_fraction`` of the frames after
    a seeded distortion towards the short range and ``dimer_fraction`` as dimers at
    close contact; ``md``: Langevin trajectories with the
    chosen calculator at each of ``temperatures`` K, one trajectory of ``md_frames`` frames
    saved every ``md_interval`` steps per task.
    """

    source: str = Field("g2", min_length=1)  # g2 | s22 | nci | smiles:<file> | <xyz/extxyz path>
    elements: list[str] = ["C", "H", "N", "O"]  # empty list: any element
    max_atoms: Count = 12
    min_atoms: Count = 2
    max_molecules: Count | None = None  # cap after filtering (first n in source order)
    sampler: Literal["rattle", "md"] = "rattle"
    frames: int = Field(2000, ge=1)
    rattle_sigma: NonNegative = 0.05  # Å
    # rattle: this share of the frames is distorted first (compressed, an angle closed, a
    # bond shortened: sim.samplers.distort_positions), so the data reach the short range
    distort_fraction: float = Field(0.2, ge=0.0, le=1.0)
    # rattle: this share of the frames is a dimer first (the molecule and a rotated partner
    # from the campaign, 1.4-4.5 Å apart at their closest: sim.samplers.dimer_positions),
    # for the short range between molecules; distort_fraction + dimer_fraction <= 1
    dimer_fraction: float = Field(0.1, ge=0.0, le=1.0)
    temperatures: list[float] = [300.0]  # K, for md
    md_timestep_fs: Positive = 0.5
    md_friction: NonNegative = 0.01  # 1/fs
    md_interval: Count = 10  # MD steps between saved frames
    md_warmup: Count0 = 20  # MD steps before the first saved frame
    md_frames: Count = 25  # frames per trajectory (= one task)
    calculator: Literal["xtb", "dft", "emt"] = "xtb"
    method: str | None = "GFN2-xTB"  # xtb: GFN2-xTB|GFN1-xTB|IPEA1-xTB; dft: HF|<xc>
    basis: str = "6-31G*"  # dft only
    density_fit: bool = True  # dft only
    xtb_accuracy: Positive = 1.0
    xtb_max_iterations: Count = 250
    xtb_electronic_temperature: NonNegative = 300.0  # K
    min_distance: NonNegative = 0.5  # Å; closer atom pairs are quarantined as bad geometry
    chunk_size: int = Field(100, ge=1)  # frames per Dask task (rattle); bench/sim/throughput.py
    timeout_s: NonNegative = 300.0  # per task; 0: no timeout
    retries: int = Field(2, ge=0)  # per task, before it is split / quarantined
    max_in_flight: Count | None = None  # tasks submitted at once; None: 3 per worker
    flush_every_s: NonNegative = 10.0  # seal a shard + commit the manifest at most this often
    on_bad_input: Literal["error", "quarantine"] = "error"  # malformed xyz / invalid SMILES
    retry_quarantined: bool = False  # on resume, recompute previously quarantined frames
    seed: Seed = 0
    relabel: RelabelConfig = RelabelConfig()

    @field_validator("min_atoms")
    @classmethod
    def _atom_range(cls, v: int, info: ValidationInfo) -> int:
        hi = info.data.get("max_atoms")
        if hi is not None and v > hi:
            raise ValueError(f"must be <= simulate.max_atoms ({hi})")
        return v

    @field_validator("dimer_fraction")
    @classmethod
    def _shares(cls, v: float, info: ValidationInfo) -> float:
        lo = info.data.get("distort_fraction")
        if lo is not None and lo + v > 1.0:
            raise ValueError(f"distort_fraction + dimer_fraction must be <= 1 (got {lo} + {v})")
        return v

    @field_validator("temperatures")
    @classmethod
    def _positive_temperatures(cls, value: list[float]) -> list[float]:
        if not value or any(t <= 0 for t in value):
            raise ValueError("temperatures must be a non-empty list of positive kelvins")
        return value
