"""``data inspect``: counts, sizes, schema, element histogram, energy statistics.

Energies, atom counts and payload sizes come from the columnar index (no record data is
read); the element histogram decodes the records (all, or an evenly spaced sample).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from ase.data import chemical_symbols

from convergent.data.reader import open_dataset


def _stats(x: np.ndarray) -> dict[str, float]:
    x = np.asarray(x, np.float64)
    finite = x[np.isfinite(x)]
    if len(finite) == 0:
        return {"count": 0, "missing": int(len(x))}
    return {
        "count": int(len(finite)), "missing": int(len(x) - len(finite)),
        "min": float(finite.min()), "max": float(finite.max()),
        "mean": float(finite.mean()), "std": float(finite.std()),
        "median": float(np.median(finite)),
    }


def inspect_dataset(path: str | os.PathLike[str], sample: int | None = None) -> dict[str, Any]:
    """Summary of a dataset as a JSON-ready dict.

    Args:
        sample: decode at most this many records (evenly spaced) for the element
            histogram; ``None`` decodes all.
    """
    ds = open_dataset(path)
    m = ds.manifest
    sizes = np.array([s.bytes for s in m.shards], np.float64)
    out: dict[str, Any] = {
        "path": str(Path(path)), "schema": m.schema, "schema_version": m.schema_version,
        "format_version": m.format_version, "compression": m.compression,
        "records": len(ds), "shards": len(m.shards), "bytes": int(m.bytes),
        "shard_bytes": _stats(sizes) if len(sizes) else {},
        "shard_records": _stats(ds.counts) if len(ds.counts) else {},
    }
    if m.schema == "molecular":
        out["energy_eV"] = _stats(ds.column("energy"))
        out["n_atoms"] = _stats(ds.column("n_atoms"))
        out["molecules"] = len(set(ds.molecule_ids()))
        n = len(ds)
        idx = range(n) if sample is None or sample >= n else np.linspace(0, n - 1, sample).astype(int)
        hist: Counter[int] = Counter()
        for i in idx:
            hist.update(ds[int(i)]["numbers"].tolist())
        out["elements"] = {
            (chemical_symbols[z] if z < len(chemical_symbols) else str(z)): int(c) for z, c in sorted(hist.items())
        }
        out["elements_sampled_records"] = len(idx)
    else:
        size = ds.column("size")
        out["payload_bytes"] = _stats(size)
        out["inlined"] = int(sum(int(sh.meta.index["inlined"].sum()) for sh in ds.shards))
    ds.close()
    return out
