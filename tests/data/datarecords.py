"""Deterministic record generators shared by the dataset-store tests (a uniquely named
module, so Dask worker processes import it unambiguously)."""

from __future__ import annotations

import numpy as np


def molecular_record(i: int, rng: np.random.Generator, n_mol: int = 7, max_atoms: int = 12) -> dict:
    """A valid molecular record with random arrays (key ``r<i>``, molecule ``m<i % n_mol>``)."""
    n = int(rng.integers(1, max_atoms + 1))
    return {
        "key": f"r{i}",
        "molecule_id": f"m{i % n_mol}",
        "numbers": rng.integers(1, 10, n),
        "positions": rng.normal(size=(n, 3)),
        "energy": float(rng.normal()),
        "forces": rng.normal(size=(n, 3)),
        "cell": np.zeros((3, 3)),
        "pbc": np.array([False, False, False]),
        "charge": int(rng.integers(-1, 2)),
        "multiplicity": int(rng.integers(1, 3)),
        "meta": {"calculator": "test", "i": i},
    }


def molecular_records(n: int, seed: int = 0, **kw) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [molecular_record(i, rng, **kw) for i in range(n)]


def bytes_records(n: int, seed: int = 0, max_size: int = 3000) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"key": f"f{i}", "payload": rng.bytes(int(rng.integers(0, max_size)))} for i in range(n)]


def assert_same_record(a: dict, b: dict) -> None:
    assert a["key"] == b["key"]
    if "payload" in a:
        assert a["payload"] == b["payload"]
        return
    for k in ("numbers", "positions", "forces", "cell", "pbc"):
        np.testing.assert_array_equal(np.asarray(a[k]), b[k], err_msg=k)
    assert b["numbers"].dtype == np.int64 and b["positions"].dtype == np.float64
    for k in ("molecule_id", "charge", "multiplicity", "meta"):
        assert a[k] == b[k], k
    assert a["energy"] == b["energy"]
