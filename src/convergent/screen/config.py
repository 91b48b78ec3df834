"""Config of screening / active learning (``screen`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from convergent.configbase import Count, Count0, PathStr, Section


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
