"""`data stats`: counts, distributions and label completeness, as mergeable partials.

Each shard task returns a :class:`Partial` (counters, fixed-bin histograms, moments); the
driver adds them up, so memory is bounded by the bin counts, not the dataset. Quantiles
come from the histograms: energy per atom on bins spanning the exact range (read from
the shard indices first), force norms on log-spaced bins (relative error < 0.5 %).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convergent.analytics import derived
from convergent.analytics.engine import Engine, ShardTask, ShardView, plan
from convergent.core.errors import DataError
from convergent.core.fsutil import atomic_write_text, dumps_json

FORCE_EDGES = np.logspace(-4, 4, 1601)  # eV/Å
STATS_JSON = "stats.json"
QUANTILES = (0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999)


@dataclass
class Partial:
    """Mergeable statistics of a set of records."""

    records: int = 0
    atoms: int = 0
    elements: Counter = field(default_factory=Counter)  # atoms per element
    structures_with: Counter = field(default_factory=Counter)  # structures containing element
    source: Counter = field(default_factory=Counter)
    sampler: Counter = field(default_factory=Counter)
    round: Counter = field(default_factory=Counter)
    n_atoms: Counter = field(default_factory=Counter)
    has_energy: int = 0
    has_forces: int = 0
    meta_keys: Counter = field(default_factory=Counter)
    epa_hist: np.ndarray | None = None
    epa_moments: np.ndarray = field(default_factory=lambda: np.zeros(3))  # n, sum, sum sq
    force_hist: np.ndarray = field(default_factory=lambda: np.zeros(len(FORCE_EDGES) + 1, np.int64))
    force_moments: np.ndarray = field(default_factory=lambda: np.zeros(3))
    force_max: float = 0.0
    workers: Counter = field(default_factory=Counter)  # tasks per worker (locality evidence)

    def add(self, o: Partial) -> None:
        self.records += o.records
        self.atoms += o.atoms
        for name in ("elements", "structures_with", "source", "sampler", "round", "n_atoms",
                     "meta_keys", "workers"):
            getattr(self, name).update(getattr(o, name))
        self.has_energy += o.has_energy
        self.has_forces += o.has_forces
        if o.epa_hist is not None:
            self.epa_hist = o.epa_hist.copy() if self.epa_hist is None else self.epa_hist + o.epa_hist
        self.epa_moments += o.epa_moments
        self.force_hist += o.force_hist
        self.force_moments += o.force_moments
        self.force_max = max(self.force_max, o.force_max)


def _stats_task(task: ShardTask, epa_edges: np.ndarray) -> Partial:
    from convergent.analytics.engine import worker_name

    v = ShardView(task)
    p = Partial()
    p.workers[worker_name()] += 1
    if v.schema != "molecular":
        raise DataError(f"{task.dataset}: data stats needs a molecular dataset, not {v.schema!r}")
    zs_all, fn_all, n_at, energies = [], [], np.zeros(v.n, np.int64), np.zeros(v.n)
    keys: set[str] = set()
    srcs, samplers, rounds = [], [], []  # raw meta values, counted once per shard below
    for i in range(v.n):
        r = v.reader.fields(i)  # no positions, cell or strings decoded, no array copies
        z = r.numbers
        n_at[i] = len(z)
        zs_all.append(z)
        meta = r.meta or {}
        keys.update(meta)
        srcs.append(meta.get("source", meta.get("origin", "")) or "(none)")
        samplers.append(meta.get("sampler", "") or "(none)")
        rounds.append(meta.get("round", "(none)"))
        energies[i] = r.energy
        fn_all.append(r.forces if r.forces is not None else np.full((len(z), 3), np.nan))
    p.meta_keys.update(keys)
    for counter, raw, name in ((p.source, srcs, _source), (p.sampler, samplers, str), (p.round, rounds, str)):
        for value, c in _count(raw):
            counter[name(value)] += c
    p.records = v.n
    p.atoms = int(n_at.sum())
    ks, cs = np.unique(n_at, return_counts=True)
    p.n_atoms = Counter({int(k): int(c) for k, c in zip(ks, cs, strict=True)})
    if v.n:
        z = np.concatenate(zs_all)
        rec_of = np.repeat(np.arange(v.n), n_at)
        zc = np.bincount(z, minlength=256)
        pairs = np.unique(rec_of * 256 + z)  # (record, element) present
        sc = np.bincount(pairs % 256, minlength=256)
        p.elements = Counter({int(k): int(zc[k]) for k in np.flatnonzero(zc)})
        p.structures_with = Counter({int(k): int(sc[k]) for k in np.flatnonzero(sc)})
        f = np.concatenate(fn_all)
        fn = np.sqrt(np.einsum("ij,ij->i", f, f))
        finite = np.isfinite(fn)
        rec_ok = np.bincount(rec_of[~finite], minlength=v.n) == 0  # all force norms finite
        p.has_forces = int(rec_ok.sum())
        good = fn[rec_ok[rec_of]]
        if good.size:
            p.force_hist += np.bincount(_bins(FORCE_EDGES, good), minlength=len(FORCE_EDGES) + 1)
            p.force_moments += (good.size, good.sum(), (good * good).sum())
            p.force_max = float(good.max())
    fin = np.isfinite(energies)
    p.has_energy = int(fin.sum())
    epa = energies[fin & (n_at > 0)] / n_at[fin & (n_at > 0)]
    v.close()
    a = epa
    p.epa_hist = np.bincount(_bins(epa_edges, a), minlength=len(epa_edges) + 1)
    p.epa_moments = np.array([a.size, a.sum(), (a * a).sum()])
    return p


def _source(value: Any) -> str:
    """The source a record's ``meta.source`` (or ``origin``) names: up to its first colon."""
    return str(value).split(":")[0]


def _count(values: list[Any]) -> list[tuple[Any, int]]:
    """Counts of meta values, 1, 1.0 and True apart (a list or dict counted by its text)."""
    try:
        typed = Counter(zip(map(type, values), values, strict=True))
    except TypeError:  # an unhashable value
        typed = Counter((type(v), v if isinstance(v, str | int | float | bool) or v is None else str(v))
                        for v in values)
    return [(v, c) for (_, v), c in typed.items()]


def _bins(edges: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Bin k in 1..len(edges)-1 holds [edges[k-1], edges[k]); values outside are clamped
    into the first or last bin."""
    return np.clip(np.searchsorted(edges, x, side="right"), 1, len(edges) - 1)


def _index_range(tasks: list[ShardTask]) -> tuple[float, float]:
    """Min and max energy per atom from the shard indices (no record data read)."""
    from convergent.data.reader import ShardReader

    lo, hi = math.inf, -math.inf
    for t in tasks:
        cols = ShardReader(Path(t.dataset), t.info).meta.index
        if "energy" not in cols:
            continue
        n = cols["n_atoms"].astype(np.float64)
        ok = np.isfinite(cols["energy"]) & (n > 0)
        if ok.any():
            e = cols["energy"][ok] / n[ok]
            lo, hi = min(lo, float(e.min())), max(hi, float(e.max()))
    if not math.isfinite(lo):
        return 0.0, 1.0
    if hi <= lo:
        hi = lo + 1e-9 + abs(lo) * 1e-9
    return lo, hi


def _quantiles(hist: np.ndarray, edges: np.ndarray, log: bool = False) -> dict[str, float]:
    """Quantiles from a histogram whose bin k covers [edges[k-1], edges[k]) (interpolated)."""
    total = hist.sum()
    if total == 0:
        return {}
    cum = np.cumsum(hist)
    out = {}
    for q in QUANTILES:
        k = int(np.searchsorted(cum, q * total, side="left"))
        k = min(max(k, 1), len(edges) - 1)
        below = cum[k - 1]
        frac = (q * total - below) / hist[k] if hist[k] else 0.5
        a, b = edges[k - 1], edges[k]
        val = math.exp(math.log(a) + frac * (math.log(b) - math.log(a))) if log else a + frac * (b - a)
        out[f"p{q * 100:g}"] = float(val)
    return out


def _moments(m: np.ndarray) -> dict[str, float]:
    n, s, ss = m
    if n == 0:
        return {"count": 0}
    mean = s / n
    return {"count": int(n), "mean": float(mean), "std": float(math.sqrt(max(ss / n - mean * mean, 0.0)))}


def compute_stats(dataset: str | os.PathLike[str], engine: Engine | None = None, bins: int = 2000) -> dict[str, Any]:
    """Statistics of a molecular dataset as a JSON-ready dict (see module docstring)."""
    engine = engine or Engine(progress=False)
    tasks, (m,) = plan([dataset])
    if m.schema != "molecular":
        raise DataError(f"{dataset}: data stats needs a molecular dataset, not {m.schema!r}")
    lo, hi = _index_range(tasks)
    edges = np.linspace(lo, hi, bins + 1)
    total = Partial()
    for p in engine.map(_stats_task, tasks, edges, label="stats", batch=True):
        total.add(p)
    n = max(total.records, 1)
    epa_q = _quantiles(total.epa_hist, edges) if total.epa_hist is not None else {}
    return {
        "dataset": str(Path(dataset).resolve()),
        "records": total.records,
        "atoms": total.atoms,
        "shards": len(tasks),
        "elements": {derived.symbol(z): c for z, c in sorted(total.elements.items())},
        "structures_with_element": {derived.symbol(z): c for z, c in sorted(total.structures_with.items())},
        "source": dict(total.source.most_common()),
        "sampler": dict(total.sampler.most_common()),
        "round": dict(sorted(total.round.items())),
        "atoms_per_structure": {
            "histogram": {str(k): v for k, v in sorted(total.n_atoms.items())},
            "min": min(total.n_atoms, default=0), "max": max(total.n_atoms, default=0),
            "mean": total.atoms / n,
        },
        "energy_per_atom": {**_moments(total.epa_moments), "min": lo, "max": hi, "quantiles": epa_q,
                            "histogram": _coarse(total.epa_hist, edges)},
        "force_norm": {**_moments(total.force_moments), "max": total.force_max,
                       "quantiles": _quantiles(total.force_hist, FORCE_EDGES, log=True),
                       "histogram": _coarse_force(total.force_hist)},
        "label_completeness": {"energy": total.has_energy / n, "forces": total.has_forces / n,
                               "meta_keys": {k: v / n for k, v in total.meta_keys.most_common()}},
        "tasks_per_worker": dict(total.workers),
    }


def _coarse(hist: np.ndarray | None, edges: np.ndarray, k: int = 50) -> dict[str, list[float]]:
    """The fine histogram summed into ``k`` bins (for the JSON and the plot)."""
    if hist is None:
        return {"edges": [], "counts": []}
    inner = hist[1:-1]
    step = max(1, len(inner) // k)
    counts = np.add.reduceat(inner, np.arange(0, len(inner), step))
    e = edges[:: step]
    if len(e) < len(counts) + 1:
        e = np.append(e, edges[-1])
    return {"edges": e[: len(counts) + 1].tolist(), "counts": counts.tolist()}


def _coarse_force(hist: np.ndarray, k: int = 80) -> dict[str, list[float]]:
    nz = np.nonzero(hist[1:-1])[0]
    if nz.size == 0:
        return {"edges": [], "counts": []}
    a, b = nz[0], nz[-1] + 1
    sub = hist[1:-1][a:b]
    edges = FORCE_EDGES[a: b + 1]
    step = max(1, len(sub) // k)
    idx = np.arange(0, len(sub), step)
    counts = np.add.reduceat(sub, idx)
    e = np.append(edges[idx], edges[-1])
    return {"edges": e.tolist(), "counts": counts.tolist()}


def write_stats(stats: dict[str, Any], out: str | os.PathLike[str]) -> dict[str, str]:
    """Write ``stats.json`` and PNG histograms into ``out``; returns {title: file name}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figs = _plots(stats, out)
    atomic_write_text(out / STATS_JSON, dumps_json(dict(stats, plots=figs), indent=1) + "\n")
    return figs


def _plots(stats: dict[str, Any], out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    specs = [
        ("Atoms per structure", "atoms_per_structure.png", None),
        ("Energy per atom (eV)", "energy_per_atom.png", stats["energy_per_atom"]["histogram"]),
        ("Force norm |F| (eV/Å)", "force_norm.png", stats["force_norm"]["histogram"]),
        ("Atoms per element", "elements.png", None),
    ]
    for title, name, h in specs:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        if name == "atoms_per_structure.png":
            d = stats["atoms_per_structure"]["histogram"]
            ax.bar([int(k) for k in d], list(d.values()), width=0.9)
        elif name == "elements.png":
            d = stats["elements"]
            ax.bar(list(d), list(d.values()))
        elif h and h["counts"]:
            e = np.asarray(h["edges"])
            ax.stairs(h["counts"], e, fill=True)
            if "force" in name:
                ax.set_xscale("log")
        ax.set_title(title)
        ax.set_ylabel("count")
        fig.tight_layout()
        tmp = out / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        os.replace(tmp, out / name)
        figs[title] = name
    return figs
