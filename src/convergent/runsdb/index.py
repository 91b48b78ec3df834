"""One summary per run directory: stage status, start, duration, key metrics, size.

A run directory is any folder with a ``config.yaml`` (what ``open_run`` writes);
:func:`find_run` resolves a name under the runs root or a path, :func:`list_runs` the
runs under a root, newest first.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from convergent.core.errors import RunDirError
from convergent.core.provenance import CodeVersion
from convergent.runsdb.records import read_records
from convergent.runsdb.rundir import RunDir
from convergent.runsdb.trainrecords import as_number, read_train_records

STAGE_ORDER = ("simulate", "data", "train", "screen")


@dataclass
class RunSummary:
    """What ``runs list`` shows for one run (``metrics``: the last attempt's values)."""

    name: str
    path: str
    stages: dict[str, str] = field(default_factory=dict)  # stage -> done | partial
    start: float | None = None  # unix seconds
    duration_s: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    size_bytes: int = 0
    code: str = "unknown"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def status(self) -> str:
        """``simulate data train screen`` with a ``~`` on partial stages."""
        return " ".join(k if v == "done" else f"{k}~" for k, v in self.stages.items()) or "-"


def dir_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            total += st.st_size
    return total


def is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def find_run(name: str | Path, root: str | Path = "runs") -> RunDir:
    """The run ``name``: a path to a run directory, or a name under ``root``."""
    for cand in (Path(name), Path(root) / str(name)):
        if cand.is_dir() and is_run(cand):
            return RunDir(cand)
    raise RunDirError(f"no run named '{name}' (looked for {Path(name)} and {Path(root) / str(name)})",
                      hint="`convergent runs list` shows the runs")


def load_config_dict(run: RunDir) -> dict[str, Any]:
    """The run's resolved config as a plain mapping (empty if unreadable)."""
    try:
        data = yaml.safe_load(run.config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def key_metrics(run: RunDir) -> dict[str, float]:
    """Final train loss, validation and screening MAEs, steps (last attempt)."""
    out: dict[str, float] = {}
    steps, vals = read_train_records(run.metrics, last_attempt=True)
    if steps:
        out["step"] = float(steps[-1].step)
        if (loss := as_number(steps[-1].loss)) is not None:
            out["loss"] = loss
    if vals:
        for key in ("energy_mae", "force_mae", "loss"):
            if (v := as_number(getattr(vals[-1], key))) is not None:
                out[f"val_{key}"] = v
    screens = read_records(run.metrics, "screen")
    if screens:
        for key in ("energy_mae", "force_mae"):
            if screens[-1].number(key) is not None:
                out[f"screen_{key}"] = screens[-1].number(key)  # type: ignore[assignment]
    return out


def run_code(run: RunDir) -> str:
    """The code version (``abc1234``, ``abc1234+dirty``) of the run's last finished stage."""
    codes = [s.get("code") for s in run.stages().values() if s.get("code")]
    return CodeVersion.from_dict(codes[-1]).short if codes else "unknown"


def summarize(run: RunDir) -> RunSummary:
    stages_json = run.stages()
    status = {k: "done" for k in stages_json}
    records = read_records(run.metrics)
    if "train" not in status and any(r.kind == "train_step" for r in records):
        status["train"] = "partial"
    order = {k: i for i, k in enumerate(STAGE_ORDER)}
    status = dict(sorted(status.items(), key=lambda kv: order.get(kv[0], len(order))))
    start = run.config.stat().st_mtime
    times = [r.time for r in records if isinstance(r.time, int | float)]
    times += [s["finished_at"] for s in stages_json.values() if isinstance(s.get("finished_at"), int | float)]
    walls = [s["wall_s"] for s in stages_json.values() if isinstance(s.get("wall_s"), int | float)]
    if times:
        start = min(start, min(times))
    # the stages' own wall time (a run resumed days later is not days long), else the span
    duration = sum(walls) if walls else (max(times) - start if times else None)
    return RunSummary(
        name=run.path.name, path=str(run.path), stages=status, start=start,
        duration_s=duration, metrics=key_metrics(run), size_bytes=dir_size(run.path),
        code=run_code(run),
    )


def list_runs(root: str | Path = "runs") -> list[RunSummary]:
    """Summaries of the runs directly under ``root``, newest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    runs = [summarize(RunDir(p)) for p in base.iterdir() if p.is_dir() and is_run(p)]
    return sorted(runs, key=lambda s: s.start or 0.0, reverse=True)
