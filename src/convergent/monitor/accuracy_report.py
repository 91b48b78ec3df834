"""The report's accuracy sections: model vs per-element baseline, parity of energies
relative to the per-element references, force parity, errors per element, outliers.

Reads only a :class:`~convergent.monitor.accuracy.HeldoutPredictions` record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from convergent.core.elements import symbol
from convergent.monitor.accuracy import (
    HeldoutPredictions,
    element_errors,
    forces_array,
    outliers,
)
from convergent.monitor.reportkit import fmt, md_table, pyplot, save_png


def _mev(x: float | None) -> str:
    return fmt(x * 1e3, ".1f") if x is not None else "n/a"


def _ev(x: float | None) -> str:
    return fmt(x) if x is not None else "n/a"


def plot_energy_parity(p: HeldoutPredictions, out: Path) -> str | None:
    """Parity of energies per atom relative to the per-element references (the part the
    composition does not explain; the baseline predicts 0 for every structure), and the
    error distributions of the model and the baseline."""
    a = p.arrays()
    if not np.isfinite(a["true"]).any():
        return None
    ref = p.reference_sums()
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    name = p.reference
    if ref is not None and np.isfinite(ref).all():
        t, e = (a["true"] - ref) / a["n"] * 1e3, (a["pred"] - ref) / a["n"] * 1e3
        ax.set_xlabel(f"{name} energy - Σ element refs (meV/atom)")
        ax.set_ylabel("surrogate, same (meV/atom)")
    else:  # a record without references: energies per atom (old runs)
        t, e = a["true"] / a["n"], a["pred"] / a["n"]
        ax.set_xlabel(f"{name} energy (eV/atom)")
        ax.set_ylabel("surrogate energy (eV/atom)")
    ok = np.isfinite(t) & np.isfinite(e)
    ax.scatter(t[ok], e[ok], s=7, alpha=0.6, label="surrogate")
    lo, hi = float(min(t[ok].min(), e[ok].min())), float(max(t[ok].max(), e[ok].max()))
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    if ref is not None:
        ax.axhline(0.0, color="tab:red", lw=0.8, alpha=0.7, label="per-element baseline")
    ax.legend(fontsize=8)
    ax.set_title("parity, held-out molecules")
    err = (a["pred"] - a["true"]) / a["n"] * 1e3
    errb = (a["base"] - a["true"]) / a["n"] * 1e3
    both = np.concatenate([err[np.isfinite(err)], errb[np.isfinite(errb)]])
    bins = np.linspace(float(both.min()), float(both.max()), 41) if both.size else 40
    ax2.hist(err[np.isfinite(err)], bins=bins, alpha=0.7, label="surrogate")
    if np.isfinite(errb).any():
        ax2.hist(errb[np.isfinite(errb)], bins=bins, alpha=0.5, label="per-element baseline")
    ax2.set_xlabel(f"prediction - {name} (meV/atom)")
    ax2.set_ylabel("structures")
    ax2.legend(fontsize=8)
    ax2.set_title("energy error")
    return save_png(fig, out)


def plot_force_parity(p: HeldoutPredictions, out: Path) -> str | None:
    """Predicted vs reference force components (eV/Å), coloured by element."""
    ft, fp = forces_array(p.forces_true), forces_array(p.forces_pred)
    if not len(ft) or len(ft) != len(fp) or len(ft) != len(p.numbers):
        return None
    z = np.asarray(p.numbers, dtype=np.int64)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    for el in np.unique(z).tolist():
        m = z == el
        t, e = ft[m].ravel(), fp[m].ravel()
        ok = np.isfinite(t) & np.isfinite(e)
        ax.scatter(t[ok], e[ok], s=3, alpha=0.35, label=symbol(el))
    ok = np.isfinite(ft) & np.isfinite(fp)
    if not ok.any():
        plt.close(fig)
        return None
    lo, hi = float(min(ft[ok].min(), fp[ok].min())), float(max(ft[ok].max(), fp[ok].max()))
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xlabel(f"{p.reference} force component (eV/Å)")
    ax.set_ylabel("surrogate force component (eV/Å)")
    ax.set_title("force parity, held-out molecules")
    ax.legend(fontsize=8, markerscale=3)
    return save_png(fig, out)


def plot_element_errors(p: HeldoutPredictions, out: Path) -> str | None:
    """Force MAE per element, and energy MAE (meV/atom) of the structures holding each
    element, surrogate vs baseline (energy error against composition)."""
    rows = element_errors(p)
    if not rows:
        return None
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.6, 3.6))
    x = np.arange(len(rows))
    names = [r.element for r in rows]
    ax1.bar(x, [r.force_mae or 0.0 for r in rows])
    ax1.set_xticks(x, names)
    ax1.set_ylabel("force MAE (eV/Å)")
    ax1.set_title("force error per element")
    ax2.bar(x - 0.2, [(r.energy_mae_per_atom or 0.0) * 1e3 for r in rows], 0.4, label="surrogate")
    ax2.bar(x + 0.2, [(r.baseline_energy_mae_per_atom or 0.0) * 1e3 for r in rows], 0.4,
            label="per-element baseline")
    ax2.set_xticks(x, [f"with {n}" for n in names])
    ax2.set_ylabel("energy MAE (meV/atom)")
    ax2.set_title("energy error by composition")
    ax2.legend(fontsize=8)
    return save_png(fig, out)


def accuracy_sections(p: HeldoutPredictions, report_dir: Path,
                      extra_rows: list[tuple[str, str]]) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines of the accuracy sections and the figures (title -> PNG name)."""
    s = p.summary()
    ratio = s.baseline_over_model
    verdict = ("n/a" if ratio is None else
               f"{ratio:.1f}x lower error than the baseline" if ratio >= 1 else
               f"{1 / ratio:.1f}x WORSE than the baseline (the model has not learned beyond composition)")
    md = ["## Screening (held-out molecules)",
          f"{s.structures} held-out structures of molecules the model never saw, labelled by "
          f"{p.reference}. The baseline is the per-element linear fit (least squares of the "
          f"energy on element counts) of the same {p.baseline_structures} training structures: "
          "a model must beat it to have learned anything beyond composition.", "",
          "| energy MAE | surrogate | per-element baseline |", "| --- | --- | --- |",
          f"| eV per structure | {_ev(s.energy_mae)} | {_ev(s.baseline_energy_mae)} |",
          f"| meV/atom | {_mev(s.energy_mae_per_atom)} | {_mev(s.baseline_energy_mae_per_atom)} |",
          "",
          f"**Baseline MAE / surrogate MAE: {fmt(ratio, '.2f') if ratio else 'n/a'}** ({verdict}).", "",
          md_table([("force MAE (eV/Å)", fmt(s.force_mae)), *extra_rows]), ""]
    if p.baseline_refs:
        md += ["Per-element reference energies of the baseline (eV): " + ", ".join(
            f"{symbol(int(z))} {v:.3f}" for z, v in sorted(p.baseline_refs.items(), key=lambda kv: int(kv[0]))),
            ""]
    rows = element_errors(p)
    if rows:
        md += ["## Errors per element",
               "| element | atoms | force MAE (eV/Å) | structures with it | energy MAE surrogate (meV/atom) | energy MAE baseline (meV/atom) |",
               "| --- | --- | --- | --- | --- | --- |",
               *[f"| {r.element} | {r.atoms} | {fmt(r.force_mae) if r.force_mae is not None else 'n/a'} | "
                 f"{r.structures} | {_mev(r.energy_mae_per_atom)} | {_mev(r.baseline_energy_mae_per_atom)} |"
                 for r in rows], ""]
    worst = outliers(p)
    if worst:
        md += ["## Worst held-out structures (largest surrogate energy error, one per molecule)",
               "| molecule | structure | formula | atoms | surrogate error (eV) | (meV/atom) | baseline error (eV) | force MAE (eV/Å) |",
               "| --- | --- | --- | --- | --- | --- | --- | --- |",
               *[f"| {o.molecule_id} | {o.key} | {o.formula} | {o.n_atoms} | {o.error:+.3f} | {o.error / o.n_atoms * 1e3:+.1f} | "
                 f"{f'{o.baseline_error:+.3f}' if o.baseline_error is not None else 'n/a'} | "
                 f"{fmt(o.force_mae) if o.force_mae is not None else 'n/a'} |" for o in worst], ""]
    figs = {
        "Parity of energies relative to the element references (held-out molecules)":
            plot_energy_parity(p, report_dir / "parity.png"),
        "Force parity (held-out molecules)": plot_force_parity(p, report_dir / "force_parity.png"),
        "Error per element": plot_element_errors(p, report_dir / "element_errors.png"),
    }
    return md, figs
