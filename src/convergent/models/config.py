"""Config of the molecular surrogate (``model`` section)."""

from __future__ import annotations

from typing import Literal

from convergent.configbase import Section


class ModelConfig(Section):
    """Sparse-attention molecular Transformer hyper-parameters (distances in Å)."""

    kind: Literal["molecular", "llama"] = "molecular"
    hidden: int = 64
    layers: int = 3
    heads: int = 4
    cutoff: float = 5.0  # Å
    max_neighbors: int | None = None
    attention: Literal["neighbor", "topk", "dense"] = "neighbor"
