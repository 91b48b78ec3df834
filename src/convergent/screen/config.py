"""Config of screening / active learning (``screen`` section)."""

from __future__ import annotations

from typing import Literal

from convergent.configbase import Section


class ScreenConfig(Section):
    """Batched prediction and uncertainty-driven selection.

    ``models``: one model directory, or several (an ensemble: its spread is the
    uncertainty). ``dataset``: a dataset directory (convergent.data store) or a structure
    file ASE reads (extxyz, xyz, ...). ``output``: directory for ``predictions.jsonl``,
    ``selected.json`` and ``selected.extxyz`` (default ``<run dir>/screen``).
    ``select_by``: ``energy_std`` (eV per atom) or ``force_std`` (mean per-atom force
    spread, eV/Å). ``max_per_molecule`` limits picks per molecule id (0 = no limit).
    """

    models: list[str] = []
    dataset: str | None = None
    output: str | None = None
    batch_atoms: int = 2048
    select: int = 50  # candidates sent back to simulation
    select_by: Literal["energy_std", "force_std"] = "force_std"
    max_per_molecule: int = 0
    device: str = "cpu"
