"""Config of the dataset analytics commands (``analytics`` section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from convergent.core.configbase import Count, NonNegative, Section, Seed


class AnalyticsConfig(Section):
    """Defaults of ``convergent data stats|dedup|filter|split|merge``."""

    shard_bytes: int = Field(128 * 2**20, ge=4096, le=2**40)  # output shards roll at this size, bytes
    dedup_tolerance: NonNegative = 0.01  # near duplicate: max |Δ sorted distance| <= this, Å (0: exact only)
    partition_records: Count = 50_000  # records per dedup match partition (bounds a worker's memory)
    split_by: Literal["random", "molecule", "scaffold", "composition"] = "molecule"
    splits: str = Field("train=0.8,val=0.1,test=0.1", min_length=3)  # NAME=fraction|count|rest, comma-separated
    seed: Seed = 0  # split shuffle seed
    histogram_bins: Count = 2000  # fine bins of the energy-per-atom histogram (quantiles come from it)
