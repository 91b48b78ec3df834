"""Derived values of a molecular record: forces, energy per atom, composition, hashes,
geometry fingerprint. Pure functions of one record (numpy), shared by every command."""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from convergent.core.elements import formula, symbol  # noqa: F401 (analytics calls derived.formula/symbol)

FP_LEN = 32  # fingerprint length: sorted distances, resampled to this many when longer


def force_norms(rec: dict[str, Any]) -> np.ndarray:
    """|F| per atom (eV/Å); NaN where forces are missing."""
    f = np.asarray(rec["forces"], np.float64)
    return np.sqrt(np.einsum("ij,ij->i", f, f)) if f.size else np.zeros(0)


def values(rec: dict[str, Any]) -> dict[str, Any]:
    """The names a ``--where`` expression can use (see :mod:`convergent.analytics.where`)."""
    numbers = rec["numbers"]
    n = int(len(numbers))
    fn = force_norms(rec)
    e = float(rec["energy"])
    meta = rec.get("meta") or {}
    return {
        "key": rec["key"], "molecule_id": rec["molecule_id"], "n_atoms": n, "energy": e,
        "e_per_atom": e / n if n else float("nan"),
        "max_force": float(fn.max()) if fn.size else 0.0,
        "mean_force": float(fn.mean()) if fn.size else 0.0,
        "has_forces": bool(fn.size == 0 or np.all(np.isfinite(fn))),
        "has_energy": bool(np.isfinite(e)),
        "charge": int(rec["charge"]), "multiplicity": int(rec["multiplicity"]),
        "elements": sorted({symbol(int(z)) for z in numbers}),
        "formula": formula(numbers),
        "source": str(meta.get("source", meta.get("origin", ""))),
        "sampler": str(meta.get("sampler", "")),
        "round": meta.get("round", -1),
        "meta": meta,
    }


def structure_hash(rec: dict[str, Any]) -> int:
    """xxh3-64 of the structure: atomic numbers, positions, cell, pbc, charge, multiplicity
    (bit-exact). Labels and the key are not part of it."""
    h = xxhash.xxh3_64()
    h.update(np.ascontiguousarray(rec["numbers"], np.int64).tobytes())
    h.update(np.ascontiguousarray(rec["positions"], np.float64).tobytes())
    h.update(np.ascontiguousarray(rec["cell"], np.float64).tobytes())
    h.update(np.ascontiguousarray(rec["pbc"], bool).tobytes())
    h.update(np.array([rec["charge"], rec["multiplicity"]], np.int64).tobytes())
    return h.intdigest()


def composition_hash(rec: dict[str, Any]) -> int:
    """xxh3-64 of (sorted atomic numbers, charge, multiplicity): near duplicates share it."""
    z = np.sort(np.asarray(rec["numbers"], np.int64))
    return xxhash.xxh3_64_intdigest(z.tobytes() + np.array([rec["charge"], rec["multiplicity"]], np.int64).tobytes())


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(i, j) of the n(n-1)/2 atom pairs and the resampling positions (cached per n)."""
    got = _PAIRS.get(n)
    if got is None:
        i, j = np.triu_indices(n, 1)
        m = len(i)
        q = (np.arange(FP_LEN) + 0.5) * (m / FP_LEN) - 0.5 if m > FP_LEN else None
        got = _PAIRS[n] = (i, j, q)
    return got


def fingerprint(numbers: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Geometry fingerprint, invariant to rotation, translation and atom order: for each
    element pair (Zi <= Zj, in order) the sorted interatomic distances, concatenated; a
    list longer than :data:`FP_LEN` is resampled at ``FP_LEN`` evenly spaced quantiles
    (each element pair keeps a share proportional to its length). float64[FP_LEN]."""
    n = len(numbers)
    out = np.zeros(FP_LEN)
    if n < 2:
        return out
    i, j, q = _pairs(n)
    z = np.asarray(numbers, np.int64)
    diff = positions[i] - positions[j]
    d = np.sqrt(np.einsum("ij,ij->i", diff, diff))
    zi, zj = z[i], z[j]
    code = (np.minimum(zi, zj) * 256 + np.maximum(zi, zj)) * 4096.0  # pair type, then distance
    v = np.sort(code + np.minimum(d, 4095.0))
    d = v - np.floor(v / 4096.0) * 4096.0
    if q is None:
        out[: len(d)] = d
        return out
    return np.interp(q, np.arange(len(d)), d)
