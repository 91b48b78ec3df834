"""Config of the simulation campaign (``simulate`` section) and the Dask cluster (``cluster``)."""

from __future__ import annotations

from typing import Literal

from convergent.configbase import Section


class ClusterConfig(Section):
    """Where Dask work runs. ``local``: one single-threaded worker per usable core."""

    kind: Literal["local", "slurm", "address"] = "local"
    n_workers: int | None = None  # None: one per usable core
    threads_per_worker: int = 1
    address: str | None = None  # for kind=address, e.g. tcp://10.0.0.1:8786


class SimulateConfig(Section):
    """A high-throughput labelling campaign: source -> sampler -> calculator."""

    source: str = "g2"  # g2 | s22 | smiles:<file> | nci | <xyz/extxyz path>
    elements: list[str] = ["C", "H", "N", "O"]
    max_atoms: int = 12
    sampler: Literal["rattle", "md"] = "rattle"
    frames: int = 2000
    rattle_sigma: float = 0.05  # Å
    temperatures: list[float] = [300.0]  # K, for md
    calculator: Literal["xtb", "dft", "emt"] = "xtb"
    method: str = "GFN2-xTB"
    chunk_size: int = 25  # frames per Dask task
    timeout_s: float = 300.0
    retries: int = 2
    seed: int = 0
