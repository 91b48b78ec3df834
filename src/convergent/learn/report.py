"""The campaign report: learning curve, per-core timeline, utilisation, per-round table.

Built only from files of the run directory (``learn/state.json``, ``learn/timeline.jsonl``)
so ``convergent learn --report RUN_DIR`` can rebuild it at any time. Writes
``report/learn.md`` with ``learning_curve.png`` and ``timeline.png``.

Utilisation is busy core-seconds over available core-seconds: per driver session,
(sum of task durations) / (workers x (last task end - the moment the pool was up)),
summed over sessions (a killed driver's downtime is not counted as idle pool time).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from convergent.core.fsutil import atomic_write_text
from convergent.learn.engine import read_timeline
from convergent.monitor.reportkit import fmt, md_table, pyplot, save_png

COLOURS = {"label": "tab:blue", "holdout": "tab:cyan", "train": "tab:red", "explore": "tab:green",
           "score": "tab:orange", "eval": "tab:purple"}


def utilisation(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Busy / available core-seconds over the sessions of a timeline, busy seconds per kind,
    and ``per_worker``: each worker's (a core, or a GPU worker: ``resource`` gpu when its
    tasks ran on CUDA) busy and available seconds, utilisation and busy seconds per kind."""
    by_session: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        by_session[s.get("session", "")].append(s)
    busy = avail = 0.0
    kinds: dict[str, float] = defaultdict(float)
    per: dict[str, dict[str, Any]] = {}
    for rows in by_session.values():
        t0 = min(min(r["start"] for r in rows), *(r.get("opened", float("inf")) for r in rows))
        t1 = max(r["end"] for r in rows)
        workers = max(int(rows[0].get("workers") or 0), len({r["worker"] for r in rows}))
        avail += workers * (t1 - t0)
        for w in {r["worker"] for r in rows}:
            row = per.setdefault(w, {"worker": w, "resource": "cpu", "busy_s": 0.0, "available_s": 0.0,
                                     "busy_by_kind_s": defaultdict(float)})
            row["available_s"] += t1 - t0
        for r in rows:
            d = r["end"] - r["start"]
            busy += d
            kinds[r["kind"]] += d
            row = per[r["worker"]]
            row["busy_s"] += d
            row["busy_by_kind_s"][r["kind"]] += d
            if r.get("device") == "cuda":
                row["resource"] = "gpu"
    workers_out = [{**w, "busy_by_kind_s": dict(w["busy_by_kind_s"]),
                    "utilisation": w["busy_s"] / w["available_s"] if w["available_s"] > 0 else None}
                   for w in sorted(per.values(), key=lambda w: (w["resource"], w["worker"]))]
    return {"utilisation": busy / avail if avail > 0 else None, "busy_core_s": busy,
            "available_core_s": avail, "busy_by_kind_s": dict(kinds), "tasks": len(spans),
            "per_worker": workers_out}


def plot_timeline(spans: list[dict[str, Any]], out: Path, title: str = "") -> str | None:
    """One row per worker (core or GPU), a bar per task coloured by kind."""
    if not spans:
        return None
    plt = pyplot()
    t0 = min(s["start"] for s in spans)
    workers = sorted({(s["session"] if "session" in s else "", s["worker"]) for s in spans})
    row = {w: i for i, w in enumerate(workers)}
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(workers)))
    for s in spans:
        y = row[(s.get("session", ""), s["worker"])]
        ax.broken_barh([(s["start"] - t0, s["end"] - s["start"])], (y - 0.4, 0.8),
                       facecolors=COLOURS.get(s["kind"], "grey"), edgecolor="white", linewidth=0.3)
    labels = []
    for _sess, w in workers:
        gpu = any(s["device"] == "cuda" for s in spans if s["worker"] == w)
        labels.append(w.rsplit(":", 1)[-1] + (" (GPU)" if gpu else ""))
    ax.set_yticks(range(len(workers)), labels, fontsize=7)
    ax.set_xlabel("seconds since the first task")
    ax.set_ylabel("worker (core; GPU)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, list(COLOURS), ncol=6, fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, 1.18))
    if title:
        ax.set_title(title, pad=24, fontsize=9)
    return save_png(fig, out)


def plot_curves(curves: dict[str, list[list[dict[str, Any]]]], out: Path) -> str | None:
    """Held-out energy (eV/atom) and force (eV/Å) MAE against labels used, per strategy
    (one thin line per seed, the median thick)."""
    if not any(any(c) for c in curves.values()):
        return None
    import numpy as np

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for (name, runs), colour in zip(curves.items(), ("tab:red", "tab:blue", "tab:green", "tab:grey"),
                                    strict=False):
        for ax, key in zip(axes, ("energy_mae_per_atom", "force_mae"), strict=True):
            for pts in runs:
                ax.plot([p["labels"] for p in pts], [p[key] for p in pts], color=colour, lw=0.7,
                        alpha=0.5, marker=".")
            if len(runs) > 1 and all(len(r) == len(runs[0]) for r in runs):
                xs = np.median([[p["labels"] for p in r] for r in runs], axis=0)
                ys = np.median([[p[key] for p in r] for r in runs], axis=0)
                ax.plot(xs, ys, color=colour, lw=2.2, label=f"{name} (median)")
            else:
                ax.plot([], [], color=colour, label=name)
    axes[0].set_ylabel("held-out energy MAE (eV/atom)")
    axes[1].set_ylabel("held-out force MAE (eV/Å)")
    for ax in axes:
        ax.set_xlabel("labels used")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    return save_png(fig, out)


def build_learn_report(run_dir: str | Path) -> Path:
    """Write ``report/learn.md`` (+ PNGs) for an active-learning run; returns its path."""
    run_dir = Path(run_dir)
    root = run_dir / "learn"
    state = json.loads((root / "state.json").read_text()) if (root / "state.json").exists() else {}
    spans = read_timeline(root / "timeline.jsonl")
    out_dir = run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    curve = sorted(state.get("curve", {}).values(), key=lambda p: p["round"])
    strategy = "uncertainty"
    cfg_path = run_dir / "config.yaml"
    if cfg_path.exists():
        import yaml

        strategy = (yaml.safe_load(cfg_path.read_text()) or {}).get("learn", {}).get("strategy", strategy)
    figs = {"Learning curve (held-out)": plot_curves({strategy: [curve]}, out_dir / "learning_curve.png"),
            "Timeline of the pool": plot_timeline(spans, out_dir / "timeline.png")}
    u = utilisation(spans) if spans else {}
    md = [f"# Active learning: {run_dir.name}", "",
          f"Strategy **{strategy}**; stopped by: {state.get('stop') or 'not finished'}; "
          f"wall time {fmt(state.get('elapsed_s'), '.0f')} s.", ""]
    if u:
        md += ["## Pool utilisation", md_table([
            ("utilisation (busy / available core-seconds)", fmt(u["utilisation"], ".1%")),
            ("busy core-seconds", fmt(u["busy_core_s"], ".1f")),
            ("available core-seconds", fmt(u["available_core_s"], ".1f")),
            ("tasks", str(u["tasks"])),
            *[(f"busy in {k} (s)", fmt(v, ".1f")) for k, v in sorted(u["busy_by_kind_s"].items())],
        ]), "", "Per worker (a core, or a GPU worker; the timeline has one row each; a worker "
            "idle for a whole driver session counts only in the pool's total):", "",
            "| worker | resource | busy (s) | available (s) | utilisation | busiest kinds (s) |",
            "|---|---|---|---|---|---|",
            *[f"| {w['worker'].rsplit(':', 1)[-1]} | {w['resource']} | {fmt(w['busy_s'], '.1f')} | "
              f"{fmt(w['available_s'], '.1f')} | {fmt(w['utilisation'], '.1%')} | "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(w["busy_by_kind_s"].items(),
                                                          key=lambda kv: -kv[1])[:3]) + " |"
              for w in u["per_worker"]], ""]
    if curve:
        md += ["## Learning curve (held-out molecules)",
               "| round | labels | energy MAE (eV/atom) | energy MAE (eV) | force MAE (eV/Å) | "
               "per-element baseline (eV/atom) | baseline / model |",
               "|---|---|---|---|---|---|---|"]
        md += [f"| {p['round']} | {p['labels']} | {fmt(p['energy_mae_per_atom'])} | "
               f"{fmt(p['energy_mae'])} | {fmt(p['force_mae'])} | "
               f"{fmt(p.get('baseline_energy_mae_per_atom'))} | {_ratio(p)} |" for p in curve]
        md += ["", "The baseline is `Σ ref[Z]` with the element reference energies of the "
               "round's first committee member (least squares on its training labels): a "
               "model no better than it has learned the composition, not the geometry.", ""]
    rounds = [state["rounds"][k] for k in sorted(state.get("rounds", {}), key=int)]
    if rounds:
        md += ["## Rounds",
               "| round | labels before | selected | quarantined | refills | candidates (MD) | "
               "mean score selected / all | train retries | wall (s) |",
               "|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['round']} | {r['labels_before']} | {r['selected']} | {r['quarantined']} | "
               f"{r['refills']} | {r['candidates']} ({r['from_md']}) | "
               f"{fmt(r.get('mean_score_selected'))} / {fmt(r.get('mean_score_all'))} | "
               f"{r['train_retries']} | {fmt(r['wall_s'], '.1f')} |" for r in rounds]
        md.append("")
    for title, name in figs.items():
        if name:
            md += [f"## {title}", f"![{title}]({name})", ""]
    out = out_dir / "learn.md"
    atomic_write_text(out, "\n".join(md))
    return out


def _ratio(point: dict[str, Any]) -> str:
    """Baseline error over the model's (per atom) on the held-out set, or n/a."""
    base, model = point.get("baseline_energy_mae_per_atom"), point.get("energy_mae_per_atom")
    if base is None or not model:
        return "n/a"
    return f"{base / model:.2f}x" + ("" if base >= model else " (WORSE than the baseline)")
