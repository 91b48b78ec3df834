"""Markdown and figure helpers shared by the run report and the learning report."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path) -> str:
    """Save a figure atomically as PNG; returns its file name."""
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    tmp.replace(path)
    pyplot().close(fig)
    return path.name


def md_table(rows: list[tuple[str, str]]) -> str:
    """A two-column (quantity, value) markdown table."""
    lines = ["| quantity | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def fmt(value: Any, spec: str = ".4g") -> str:
    """A number in ``spec`` format; anything else (None, text) as ``str``."""
    return format(value, spec) if isinstance(value, (int, float)) else str(value)
