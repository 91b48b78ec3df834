"""Config of the dataset store (``data`` section)."""

from __future__ import annotations

from typing import Literal

from convergent.configbase import Section


class DataConfig(Section):
    """Shard layout and reader settings."""

    shard_bytes: int = 128 * 2**20  # target shard size, bytes
    compression: Literal["none", "zstd"] = "zstd"
    val_fraction: float = 0.1  # fraction of *molecules* held out
    seed: int = 0
