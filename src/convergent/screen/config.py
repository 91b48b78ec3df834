"""Config of screening / active learning (``screen`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from convergent.core.configbase import Count, Count0, PathStr, Positive, Section


class MDCheckConfig(Section):
    """Langevin runs that must keep molecules bonded (:mod:`convergent.screen.mdcheck`):
    ``seeds`` per molecule of ``molecules`` (ASE G2 names), ``time_fs`` each."""

    molecules: list[str] = Field(["H2O", "NH3", "CH4", "C2H6", "CH3OH", "H3CNH2"], min_length=1)
    seeds: Count = 4
    temperature_K: Positive = 300.0
    time_fs: Positive = 500.0
    timestep_fs: float = Field(0.5, gt=0.0, le=2.0)
    friction_per_fs: float = Field(0.01, ge=0.0, le=1.0)


class ScreenConfig(Section):
    """Batched prediction and uncertainty-driven selection.

    ``models``: one model directory, or several (an ensemble: its spread is the
    uncertainty). ``dataset``: a dataset directory (convergent.data store) or a structure
    file ASE reads (extxyz, xyz, ...). ``output``: directory for ``predictions.jsonl``,
    ``selected.json`` and ``selected.extxyz`` (default ``<run dir>/screen``).
    ``select_by``: ``energy_std`` (eV per atom) or ``force_std`` (mean per-atom force
    spread, eV/Å). ``max_per_molecule`` limits picks per molecule id (0 = no limit).
    """

    models: list[PathStr] = []
    dataset: PathStr | None = None
    output: PathStr | None = None
    batch_atoms: Count = 2048
    select: Count0 = 50  # candidates sent back to simulation
    select_by: Literal["energy_std", "force_std"] = "force_std"
    max_per_molecule: Count0 = 0
    device: str = Field("cpu", pattern=r"^[a-z]+(:[0-9]+)?$")  # cpu, cuda, cuda:1
    # INT8 inference (convergent.compress): weight-only per-channel, or torch dynamic (CPU)
    quantize: Literal["none", "int8", "int8-dynamic"] = "none"
    md_check: MDCheckConfig = MDCheckConfig()  # the demo's MD stability check
