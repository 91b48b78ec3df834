"""The data of the retrospective active-learning bench: the records, the split, the labels.

* :func:`load_records` — nci2k (bench/models/nci2k.py, the chunks already built) or the
  same records from a compact ``.npz`` (:func:`export_npz`: float32 positions and forces,
  small enough to carry to a GPU machine beside the packages it lacks).
* :func:`make_split` — a balanced scaffold split (:func:`bench.models.nci2k.balanced_scaffold_split`, groups by
  bench/models/nci2k.py's ``scaffold_group``, shuffled with the seed): the pool is the
  training scaffolds' structures (optionally a seeded sample of their compounds), the test
  set a seeded sample of the held-out scaffolds' structures. No scaffold group is on both
  sides (asserted).
* :class:`LabelOracle` — the only holder of the pool's labels. A campaign sees the pool as
  unlabelled :class:`~convergent.learn.pool.Candidate` objects; a label comes out only
  through :meth:`LabelOracle.reveal` (counted, and recorded in order), and the oracle
  strategy's score reads true energies through :meth:`LabelOracle.true_energy` (recorded
  apart: never counted as labels, never trained on).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.learn.retrospective_rules import Rules
from bench.models.nci2k import balanced_scaffold_split

FIELDS = ("key", "molecule_id", "scaffold", "kind")


def seed_of(*parts: object) -> int:
    """A 31-bit seed from ``parts`` (``convergent learn``'s rule, learn.loop._seed)."""
    from convergent.sim.molecules import stable_int

    return stable_int(*parts) & 0x7FFFFFFF


def load_records(source: str) -> list[dict[str, Any]]:
    """``nci2k``: the built chunks of bench/models/nci2k.py (none is built here); else an
    ``.npz`` written by :func:`export_npz`. Sorted by key."""
    if source == "nci2k":
        from bench.models.nci2k import load

        return load(build_missing=False)
    with np.load(source, allow_pickle=False) as z:
        start = np.concatenate([[0], np.cumsum(z["n_atoms"])])
        cols = {f: z[f].tolist() for f in FIELDS}
        numbers, pos, forces, energy = z["numbers"], z["positions"], z["forces"], z["energy"]
        return [{**{f: cols[f][i] for f in FIELDS},
                 "numbers": numbers[a:b].astype(np.int64), "positions": pos[a:b].astype(np.float64),
                 "forces": forces[a:b].astype(np.float64), "energy": float(energy[i])}
                for i, (a, b) in enumerate(zip(start[:-1], start[1:], strict=True))]


def export_npz(records: Sequence[dict[str, Any]], path: Path) -> dict[str, Any]:
    """Write ``records`` compactly (positions and forces float32; energies float64)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path, n_atoms=np.array([len(r["numbers"]) for r in records], np.int32),
        numbers=np.concatenate([r["numbers"] for r in records]).astype(np.int8),
        positions=np.concatenate([r["positions"] for r in records]).astype(np.float32),
        forces=np.concatenate([r["forces"] for r in records]).astype(np.float32),
        energy=np.array([r["energy"] for r in records], np.float64),
        **{f: np.array([str(r[f]) for r in records]) for f in FIELDS})
    return {"path": str(path), "structures": len(records), "bytes": path.stat().st_size}


def describe(records: Sequence[dict[str, Any]], source: str) -> dict[str, Any]:
    """What was loaded: counts and a hash of the keys (the same data gives the same hash)."""
    keys = "\n".join(r["key"] for r in records).encode()
    return {"source": source, "structures": len(records),
            "compounds": len({r["molecule_id"] for r in records}),
            "keys_hash": hashlib.blake2b(keys, digest_size=8).hexdigest(),
            "precision": "float32 positions and forces (npz)" if source.endswith(".npz")
            else "float64 (the nci2k datasets)"}


@dataclass(frozen=True)
class Split:
    pool: list[int]  # indices into the records
    test: list[int]
    info: dict[str, Any]


def make_split(records: Sequence[dict[str, Any]], rules: Rules, seed: int) -> Split:
    """The pool and the test set of ``seed`` (module docstring)."""
    from bench.models.nci2k import scaffold_group

    pool, held = balanced_scaffold_split(records, rules.test_fraction,
                                         seed_of("scaffold-split", seed))
    shared = {scaffold_group(records[i]) for i in pool} & {scaffold_group(records[i]) for i in held}
    assert not shared, f"seed {seed}: scaffold groups in the pool and the test set: {sorted(shared)[:3]}"
    rng = np.random.default_rng(seed_of("retrospective-split", seed))
    comps = sorted({records[i]["molecule_id"] for i in pool})
    if rules.pool_compounds and len(comps) > rules.pool_compounds:
        keep = {comps[j] for j in rng.choice(len(comps), rules.pool_compounds, replace=False)}
        pool = [i for i in pool if records[i]["molecule_id"] in keep]
    test = held
    if rules.test_structures and len(held) > rules.test_structures:
        test = sorted(held[j] for j in rng.choice(len(held), rules.test_structures, replace=False))
    info = {"pool_structures": len(pool), "pool_compounds": len({records[i]["molecule_id"] for i in pool}),
            "pool_scaffold_groups": len({scaffold_group(records[i]) for i in pool}),
            "heldout_structures": len(held), "test_structures": len(test),
            "test_compounds": len({records[i]["molecule_id"] for i in test}),
            "test_scaffold_groups": len({scaffold_group(records[i]) for i in test}),
            "scaffold_groups_in_pool_and_test": 0,
            "test_keys_hash": hashlib.blake2b("\n".join(records[i]["key"] for i in test).encode(),
                                              digest_size=8).hexdigest()}
    return Split(pool, test, info)


def candidate(rec: dict[str, Any]) -> Any:
    """The unlabelled view of a record (no energy, no forces)."""
    from convergent.learn.pool import Candidate

    return Candidate(rec["key"], rec["molecule_id"], np.asarray(rec["numbers"], np.int64),
                     np.asarray(rec["positions"], np.float64), meta={"kind": rec.get("kind", "")})


class LabelOracle:
    """The pool's labels, handed out one structure at a time (module docstring). Indices
    are positions in the pool (0 .. len(pool) - 1)."""

    def __init__(self, pool_records: Sequence[dict[str, Any]]) -> None:
        self._energy = [float(r["energy"]) for r in pool_records]
        self._forces = [np.asarray(r["forces"], np.float64) for r in pool_records]
        self.revealed: list[int] = []  # in the order revealed: the labels spent
        self.peeked: set[int] = set()  # true energies read by the oracle's score

    def reveal(self, idx: Sequence[int], cands: Sequence[Any]) -> list[dict[str, Any]]:
        """The labelled records of pool structures ``idx`` (``cands``: the pool's unlabelled
        view); refuses a structure revealed before."""
        done = set(self.revealed)
        out = []
        for i in idx:
            if i in done or not 0 <= i < len(self._energy):
                raise ValueError(f"pool structure {i}: revealed before or not in the pool")
            done.add(i)
            self.revealed.append(i)
            out.append({**cands[i].record(), "energy": self._energy[i], "forces": self._forces[i]})
        return out

    def true_energy(self, idx: Sequence[int]) -> np.ndarray:
        """Reference energies (eV) of pool structures ``idx``, for the oracle's score only."""
        self.peeked.update(int(i) for i in idx)
        return np.array([self._energy[i] for i in idx], np.float64)
