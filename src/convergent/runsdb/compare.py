"""``runs compare``: what differs between runs' configs, their metrics side by side, and
their loss / MAE curves in one PNG."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convergent.core.fsutil import atomic_write_bytes
from convergent.runsdb.cost import run_cost
from convergent.runsdb.index import key_metrics, load_config_dict, run_code
from convergent.runsdb.records import latest
from convergent.runsdb.rundir import RunDir
from convergent.runsdb.trainrecords import TrainStep, ValRecord

MISSING = "<unset>"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(configs: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Dotted key -> the value in each config, for the keys where they differ."""
    flat = [flatten(c) for c in configs]
    keys = sorted(set().union(*flat)) if flat else []
    out = {}
    for key in keys:
        values = [f.get(key, MISSING) for f in flat]
        if any(v != values[0] for v in values[1:]):
            out[key] = values
    return out


@dataclass
class Comparison:
    names: list[str]
    config: dict[str, list[Any]]  # differing keys only
    metrics: dict[str, list[float | None]]  # metric -> value per run
    code: list[str] = field(default_factory=list)  # code version per run
    plot: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"runs": self.names, "code": self.code, "config_diff": self.config,
                "metrics": self.metrics, "plot": self.plot}


def metrics_table(runs: list[RunDir]) -> dict[str, list[float | None]]:
    """Key metrics and costs of each run, one row per metric (None where a run lacks it)."""
    per_run = []
    for run in runs:
        m: dict[str, float] = dict(key_metrics(run))
        total = run_cost(run).total()
        m["wall_s"], m["core_s"] = total["wall_s"], total["core_s"]
        if total["gpu_s"]:
            m["gpu_s"] = total["gpu_s"]
        steps = [TrainStep.from_metric(r) for r in latest(run.metrics, "train_step")]
        sps = sorted(r.samples_per_s or 0.0 for r in steps[2:] or steps)
        if sps:
            m["median_samples_per_s"] = sps[len(sps) // 2]
        per_run.append(m)
    keys = list(dict.fromkeys(k for m in per_run for k in m))
    return {k: [m.get(k) for m in per_run] for k in keys}


def plot_curves(runs: list[RunDir], out: Path) -> Path | None:
    """Train loss (left) and validation energy/force MAE (right; a language model's
    validation loss) of every run."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [(r.path.name, [TrainStep.from_metric(m) for m in latest(r.metrics, "train_step")],
               [ValRecord.from_metric(m) for m in latest(r.metrics, "val")]) for r in runs]
    if not any(steps or vals for _, steps, vals in curves):
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, steps, vals) in enumerate(curves):
        color = f"C{i % 10}"
        pts = [(r.step, r.loss) for r in steps if r.loss is not None]
        if pts:
            ax1.plot(*zip(*pts, strict=True), lw=1, color=color, label=name)
        keys = (("energy_mae", "o-"), ("force_mae", "s--"))
        if not any(r.energy_mae is not None for r in vals):
            keys = (("loss", "o-"),)  # a language model: its validation loss
        for key, style in keys:
            pts = [(r.step, getattr(r, key)) for r in vals if getattr(r, key) is not None]
            if pts:
                ax2.plot(*zip(*pts, strict=True), style, color=color, ms=3,
                         label=f"{name} {key.replace('_', ' ')}")
    ax1.set(xlabel="step", ylabel="train loss", yscale="log", title="training loss")
    ax2.set(xlabel="step", ylabel="MAE (eV, eV/Å) or loss", yscale="log", title="validation")
    for ax in (ax1, ax2):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    return out


def compare_runs(runs: list[RunDir], plot: Path | None) -> Comparison:
    """Config diff, metrics side by side and (when ``plot`` is given) the curves PNG."""
    comp = Comparison(
        names=[r.path.name for r in runs],
        config=config_diff([load_config_dict(r) for r in runs]),
        metrics=metrics_table(runs),
        code=[run_code(r) for r in runs],
    )
    if plot is not None:
        written = plot_curves(runs, plot)
        comp.plot = str(written) if written else None
    return comp
