"""Config of LLM serving (``serve`` section)."""

from __future__ import annotations

from typing import Literal

from convergent.configbase import Section


class ServeConfig(Section):
    """Pipeline-parallel serving settings."""

    scheduler: Literal["sequential", "interleaved", "tdpipe"] = "tdpipe"
    stages: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    kv_budget_bytes: int = 256 * 2**20
