"""Config of screening / active learning (``screen`` section)."""

from __future__ import annotations

from convergent.configbase import Section


class ScreenConfig(Section):
    """Batched prediction and uncertainty-driven selection."""

    batch_atoms: int = 2048
    select: int = 50  # candidates sent back to simulation
