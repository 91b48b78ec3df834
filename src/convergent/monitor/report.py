"""The run report: ``report/report.md`` with PNG plots and a bottleneck diagnosis.

Built only from files in the run directory (config.yaml, stages.json, metrics.jsonl,
screen/predictions.json: the held-out predictions with the per-element baseline's,
:mod:`convergent.monitor.accuracy`; the peers' ``peer_<kind>`` stages,
:mod:`convergent.monitor.comparison`), so ``convergent report RUN_DIR`` can rebuild it at any time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from convergent.core.errors import RunDirError
from convergent.core.fsutil import atomic_write_text
from convergent.monitor.accuracy import HeldoutPredictions
from convergent.monitor.accuracy_report import accuracy_sections
from convergent.monitor.comparison import comparison_section, model_results
from convergent.monitor.diagnosis import diagnose, step_breakdown
from convergent.monitor.reportkit import fmt, md_table, pyplot, save_png
from convergent.runsdb.accounting import collect_slurm, usage_table
from convergent.runsdb.records import latest
from convergent.runsdb.rundir import RunDir
from convergent.runsdb.trainrecords import TIME_PARTS, TrainStep, ValRecord

PREDICTIONS = Path("screen") / "predictions.json"
DATASET_STATS = Path("dataset") / "stats.json"  # under report/, written by `data stats --run`


def plot_losses(steps: list[TrainStep], vals: list[ValRecord], out: Path) -> str | None:
    """Training loss and validation energy/force MAE against step."""
    if not steps:
        return None
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot([r.step for r in steps], [r.loss for r in steps], lw=1, label="train loss")
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.legend()
    for key, label in (("energy_mae", "energy MAE (eV)"), ("force_mae", "force MAE (eV/Å)")):
        if steps and getattr(steps[0], key) is not None:
            ax2.plot([r.step for r in steps], [getattr(r, key) for r in steps], lw=0.8,
                     alpha=0.6, label=f"train {label}")
        if vals and getattr(vals[0], key) is not None:
            ax2.plot([r.step for r in vals], [getattr(r, key) for r in vals], "o-",
                     label=f"val {label}")
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8)
    return save_png(fig, out)


def plot_stage_times(stages: dict[str, Any], out: Path) -> str | None:
    """Wall seconds of each finished stage."""
    timed = [(k, v["wall_s"]) for k, v in stages.items() if "wall_s" in v]
    if not timed:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([k for k, _ in timed][::-1], [v for _, v in timed][::-1])
    ax.set_xlabel("wall time (s)")
    return save_png(fig, out)


def plot_breakdown(steps: list[TrainStep], out: Path) -> str | None:
    """Stacked per-step time: data wait / compute / communication / optimizer."""
    parts = [k for k in TIME_PARTS if steps and getattr(steps[0], k) is not None]
    if not parts:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    x = [r.step for r in steps]
    ax.stackplot(x, *[[(getattr(r, k) or 0.0) * 1e3 for r in steps] for k in parts],
                 labels=[k.removesuffix("_s").replace("_", " ") for k in parts])
    ax.set_xlabel("step")
    ax.set_ylabel("ms per step")
    ax.legend(loc="upper right", fontsize=8)
    return save_png(fig, out)


def _dataset_stats(path: Path) -> list[str]:
    """The "Dataset statistics" section from ``data stats`` output, if the run has one."""
    if not path.is_file():
        return []
    try:
        st = json.loads(path.read_text())
        e, f, lab = st["energy_per_atom"], st["force_norm"], st["label_completeness"]
        rows = [
            ("records / atoms", f"{st['records']} / {st['atoms']}"),
            ("atoms per element", ", ".join(f"{k} {v}" for k, v in st["elements"].items())),
            ("sampler", ", ".join(f"{k} {v}" for k, v in st["sampler"].items())),
            ("atoms per structure (min / mean / max)", f"{st['atoms_per_structure']['min']} / "
             f"{st['atoms_per_structure']['mean']:.1f} / {st['atoms_per_structure']['max']}"),
            ("energy per atom p1 / p50 / p99 (eV)", " / ".join(fmt(e["quantiles"].get(q)) for q in ("p1", "p50", "p99"))),
            ("force norm p50 / p99 / max (eV/Å)", " / ".join(
                [fmt(f["quantiles"].get(q)) for q in ("p50", "p99")] + [fmt(f.get("max"))])),
            ("labelled: energy / forces", f"{lab['energy']:.1%} / {lab['forces']:.1%}"),
        ]
    except (KeyError, TypeError, ValueError, AttributeError):
        return ["## Dataset statistics", f"(unreadable {path.name})", ""]
    md = ["## Dataset statistics", md_table(rows), ""]
    for title, name in (st.get("plots") or {}).items():
        md += [f"![{title}]({path.parent.name}/{name})", ""]
    return md


def _baseline_rows(val: ValRecord | None) -> list[tuple[str, str]]:
    """The per-element baseline beside the model's validation error, and their ratio."""
    base = val.baseline_energy_mae if val is not None else None
    model = val.energy_mae if val is not None else None
    if base is None or model is None:
        return [("val per-element baseline energy MAE (eV)",
                 "n/a (no validation, or a model without element reference energies)")]
    ratio = base / model if model > 0 else None
    verdict = ("n/a" if ratio is None else f"{ratio:.2f}x" if ratio >= 1 else
               f"{ratio:.2f}x (the model is WORSE than the baseline)")
    return [("val per-element baseline energy MAE (eV)", fmt(base)),
            ("baseline MAE / model MAE", verdict)]


def _md_check_section(mdc: dict[str, Any] | None) -> list[str]:
    """The MD stability check (demo stage ``md_check``, convergent.screen.mdcheck)."""
    if not mdc or "runs" not in mdc:
        return []
    bad = [r for r in mdc["runs"] if not r["stable"]]
    rows = [("runs that stay bonded", f"{mdc['stable_runs']} / {mdc['total_runs']}"),
            ("molecules", ", ".join(dict.fromkeys(r["molecule"] for r in mdc["runs"]))),
            ("Langevin", f"{mdc['temperature_K']:g} K, {mdc['time_fs']:g} fs, "
                         f"step {mdc['timestep_fs']:g} fs, friction {mdc['friction_per_fs']:g}/fs")]
    rows += [(f"{r['molecule']} seed {r['seed']}", f"{r['event']} at {r['time_fs']:.0f} fs")
             for r in bad[:8]]
    return ["## MD stability (surrogate, Langevin from G2 geometries)", md_table(rows), ""]


def build_report(run_dir: str | Path) -> Path:
    """Write ``report/report.md`` and its PNGs for ``run_dir``; returns the markdown path."""
    run = RunDir(Path(run_dir))
    if not run.config.exists():
        raise RunDirError(f"{run.path}: not a run directory (no config.yaml)",
                          hint="pass a directory made by `convergent demo` or `convergent train`")
    run.report.mkdir(parents=True, exist_ok=True)
    stages = run.stages()
    # a resumed job replays steps: keep the last attempt of each (runsdb.records)
    steps = [TrainStep.from_metric(r) for r in latest(run.metrics, "train_step")]
    vals = [ValRecord.from_metric(r) for r in latest(run.metrics, "val")]
    pred = HeldoutPredictions.load(run.path / PREDICTIONS)

    figs = {
        "Loss curves": plot_losses(steps, vals, run.report / "loss.png"),
        "Time per stage": plot_stage_times(stages, run.report / "stages.png"),
        "Training step breakdown": plot_breakdown(steps, run.report / "step_breakdown.png"),
    }

    md = [f"# convergent run report: {run.path.name}", ""]
    sim = stages.get("simulate", {})
    if sim:
        md += ["## Simulation", md_table([
            ("frames done", fmt(sim.get("done"))),
            ("retried / quarantined", f"{sim.get('retried', 0)} / {sim.get('quarantined', 0)}"),
            ("wall time (s)", fmt(sim.get("wall_s"), ".1f")),
            ("throughput (frames/s)", fmt(sim.get("frames_per_s"), ".2f")),
            ("mean time per calculation (s)", fmt(sim.get("mean_calc_s"), ".4f")),
        ]), ""]
    data = stages.get("data", {})
    if data:
        md += ["## Dataset", md_table([(k, fmt(v)) for k, v in data.items() if k != "finished_at"]), ""]
    if steps:
        last = steps[-1]
        md += ["## Training", md_table([
            ("steps", str(last.step)),
            ("final train loss", fmt(last.loss)),
            ("final val energy MAE (eV)", fmt(vals[-1].energy_mae) if vals else "n/a"),
            *_baseline_rows(vals[-1] if vals else None),
            ("final val force MAE (eV/Å)", fmt(vals[-1].force_mae) if vals else "n/a"),
            ("median samples/s", fmt(float(np.median([r.samples_per_s or 0 for r in steps])), ".1f")),
            ("median MFU", fmt(float(np.median([r.mfu or 0 for r in steps])), ".2%")),
        ]), ""]
    if pred is not None:
        sps = pred.seconds_per_structure
        ref_s = sim.get("mean_calc_s")
        speedup = ref_s / sps if sps and ref_s else None
        lines, acc_figs = accuracy_sections(pred, run.report, [
            ("surrogate time per structure (s)", fmt(sps)),
            (f"{pred.reference} time per structure (s)", fmt(ref_s)),
            ("speed-up of the surrogate", f"{speedup:.0f}x" if speedup else "n/a"),
        ])
        md += lines
        figs.update(acc_figs)
    md += _md_check_section(stages.get("md_check"))
    md += comparison_section(model_results(stages))  # ours beside each peer (demo.peers)
    collect_slurm(run.path)  # Slurm's record of each job the run's stages name
    cost = usage_table(run.path)
    if cost:
        md += ["## Cost (accounting.jsonl)",
               "| stage | source | core-hours | GPU-hours |", "| --- | --- | --- | --- |",
               *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in cost], ""]
    md += _dataset_stats(run.report / DATASET_STATS)
    bd = step_breakdown(steps)
    findings = diagnose(stages, steps)
    md += ["## Diagnosis", ""]
    if bd:
        md += ["Share of training step time: " + ", ".join(
            f"{k.replace('_', ' ')} {v:.0%}" for k, v in bd.items()), ""]
    md += [f"- **{f.title}**: {f.detail} *What to change:* {f.action}" for f in findings] or ["- nothing stands out"]
    md.append("")
    for title, name in figs.items():
        if name:
            md += [f"## {title}", f"![{title}]({name})", ""]
    out = run.report / "report.md"
    atomic_write_text(out, "\n".join(md))
    return out
