"""Candidate structures: content keys, the unlabelled pool and the held-out molecules.

A :class:`Candidate` is one structure that could be labelled. Its ``key`` is a content
hash of (atomic numbers, charge, multiplicity, positions rounded to 1e-5 Å), so the same
structure gets the same key wherever it was proposed from, and a resumed campaign never
labels it twice. The pool is built deterministically from the seed (molecules from the
source, ``pool_conformers`` seeded rattles of each) and split by molecule: the held-out
molecules never enter the pool.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convergent.core.elements import symbol
from convergent.core.errors import InputError
from convergent.core.fsutil import atomic_write_bytes, dumps_json
from convergent.data.reader import open_dataset
from convergent.learn.config import PoolConfig
from convergent.sim.config import SimulateConfig
from convergent.sim.molecules import Molecule, stable_int
from convergent.sim.sources import load_molecules


def content_key(numbers: np.ndarray, positions: np.ndarray, charge: int = 0, multiplicity: int = 1) -> str:
    """``c-<32 hex>``: a hash of the structure itself (positions rounded to 1e-5 Å)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(numbers, dtype=np.int64).tobytes())
    h.update(np.asarray([charge, multiplicity], dtype=np.int64).tobytes())
    rounded = np.round(np.asarray(positions, dtype=np.float64) * 1e5).astype(np.int64)
    h.update(rounded.tobytes())
    return "c-" + h.hexdigest()


@dataclass
class Candidate:
    """A structure that could be labelled, and where it came from (``origin``: pool | md)."""

    key: str
    molecule_id: str
    numbers: np.ndarray  # int64[N]
    positions: np.ndarray  # float64[N, 3], Å
    charge: int = 0
    multiplicity: int = 1
    origin: str = "pool"
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, molecule_id: str, numbers, positions, charge: int = 0, multiplicity: int = 1,
             origin: str = "pool", **meta: Any) -> Candidate:
        numbers = np.asarray(numbers, dtype=np.int64)
        positions = np.round(np.asarray(positions, dtype=np.float64), 5)
        return cls(content_key(numbers, positions, charge, multiplicity), molecule_id, numbers,
                   positions, int(charge), int(multiplicity), origin, dict(meta))

    @property
    def n_atoms(self) -> int:
        return len(self.numbers)

    def record(self) -> dict[str, Any]:
        """An unlabelled record for the surrogate (batching.collate_records)."""
        return {"key": self.key, "molecule_id": self.molecule_id, "numbers": self.numbers,
                "positions": self.positions, "charge": self.charge,
                "multiplicity": self.multiplicity}


def _elements(cands: list[Candidate]) -> set[int]:
    return {int(z) for c in cands for z in np.unique(c.numbers)}


def cover_elements(ranked: list[Candidate], held: list[Candidate], k: int) -> list[Candidate]:
    """``ranked`` reordered so its first picks hold every element of ``ranked`` ∪ ``held``.

    For each element (by Z) not yet held by the picks, the first candidate of ``ranked``
    that holds it moves to the front (so the seeded order decides which); the rest keep
    their order. A model trained on the first ``k`` then knows every element it will be
    asked about. Raises :class:`InputError` when an element is only in the held-out set
    or the cover needs more than ``k`` structures.
    """
    picks: list[Candidate] = []
    covered: set[int] = set()
    for z in sorted(_elements(ranked)):
        if z not in covered:
            first = next(c for c in ranked if z in c.numbers)
            picks.append(first)
            covered |= _elements([first])
    only_held = sorted(_elements(held) - covered)
    if only_held:
        where = next(c for c in held if only_held[0] in c.numbers)
        raise InputError(
            f"learn: element {symbol(only_held[0])} (Z={only_held[0]}) is in the held-out "
            f"structure {where.molecule_id} ({where.key}) but in no pool structure, so no "
            "initial label can teach it", hint="add molecules with it to simulate.source")
    if len(picks) > k:
        raise InputError(
            f"learn.label.init={k} cannot cover the pool's {len(covered)} elements "
            f"({', '.join(symbol(z) for z in sorted(covered))}): {len(picks)} structures "
            "are needed", hint=f"set learn.label.init to {len(picks)} or more")
    chosen = {id(c) for c in picks}
    return picks + [c for c in ranked if id(c) not in chosen]


def is_holdout(molecule_id: str, fraction: float, seed: int) -> bool:
    """Whether a molecule is held out (a seeded hash of its id; independent of the rest)."""
    return stable_int("holdout", seed, molecule_id) < fraction * float(2**63)


def conformers(mol: Molecule, n: int, sigma: float, seed: int, origin: str) -> list[Candidate]:
    """``n`` seeded rattles of one molecule (std from sigma/4 up to sigma Å)."""
    out = []
    for k in range(n):
        rng = np.random.default_rng(stable_int("conformer", seed, origin, mol.molecule_id, k))
        s = sigma * (0.25 + 0.75 * k / max(1, n - 1))
        pos = mol.positions + rng.normal(0.0, s, mol.positions.shape)
        out.append(Candidate.make(mol.molecule_id, mol.numbers, pos, mol.charge, mol.multiplicity,
                                  origin, conformer=k, sigma=round(s, 4)))
    return out


def dataset_molecules(path: str | None) -> frozenset[str]:
    """Molecule ids of a dataset's records (empty for ``None``)."""
    if not path:
        return frozenset()
    ds = open_dataset(path)
    try:
        return frozenset(m for m in ds.molecule_ids() if m)
    finally:
        ds.close()


def _held_out_ids(ids: list[str], fraction: float, seed: int, source: str,
                  seen: frozenset[str]) -> set[str]:
    """The held-out molecules: by seeded hash (:func:`is_holdout`); with starting data, as
    many, taken in the same hash order from the molecules it does not contain."""
    by_hash = {i for i in ids if is_holdout(i, fraction, seed)}
    if not seen:
        return by_hash
    unseen = sorted({i for i in ids if i not in seen}, key=lambda i: stable_int("holdout", seed, i))
    if not unseen:
        raise InputError(
            f"learn: every molecule of simulate.source ({source}) is in learn.label.init_dataset, "
            "so none can be held out unseen", hint="add molecules to simulate.source")
    return set(unseen[:max(1, len(by_hash))])


def build_pool(pool_cfg: PoolConfig, sim: SimulateConfig, seed: int,
               seen: frozenset[str] = frozenset()) -> tuple[list[Candidate], list[Candidate]]:
    """(pool, held-out) candidates from the molecules of ``sim``'s source filter (source,
    elements, atom counts, max_molecules), rattled by ``sim.rattle_sigma``, split by
    molecule. Molecules in ``seen`` (those of the starting data, which the starting model
    was trained on) are never held out, so the held-out curve measures unseen molecules."""
    mols, _ = load_molecules(sim.source, sim.elements, sim.min_atoms, sim.max_atoms,
                             sim.max_molecules, seed, on_bad_input="quarantine")
    held_ids = _held_out_ids([m.molecule_id for m in mols], pool_cfg.holdout_fraction, seed,
                             sim.source, seen)
    sigma = sim.rattle_sigma
    pool, held = [], []
    for mol in mols:
        if mol.molecule_id in held_ids:
            held += conformers(mol, pool_cfg.holdout_per_molecule, sigma, seed + 1, "holdout")
        else:
            pool += conformers(mol, pool_cfg.conformers, sigma, seed, "pool")
    return _unique(pool), _unique(held)


def _unique(cands: list[Candidate]) -> list[Candidate]:
    seen: set[str] = set()
    out = []
    for c in cands:
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


def save_candidates(path: Path, cands: list[Candidate]) -> None:
    """Write candidates to one ``.npz`` (atomically); :func:`load_candidates` reads it."""
    arrays: dict[str, Any] = {
        "meta": np.frombuffer(dumps_json([
            {"key": c.key, "molecule_id": c.molecule_id, "charge": c.charge,
             "multiplicity": c.multiplicity, "origin": c.origin, "meta": c.meta} for c in cands
        ]).encode(), dtype=np.uint8),
        "n": np.asarray([c.n_atoms for c in cands], dtype=np.int64),
        "numbers": np.concatenate([c.numbers for c in cands]) if cands else np.zeros(0, np.int64),
        "positions": np.concatenate([c.positions for c in cands]) if cands else np.zeros((0, 3)),
    }
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def load_candidates(path: Path) -> list[Candidate]:
    """Candidates written by :func:`save_candidates`."""
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        n, numbers, positions = z["n"], z["numbers"], z["positions"]
    out, at = [], 0
    for m, k in zip(meta, n.tolist(), strict=True):
        out.append(Candidate(m["key"], m["molecule_id"], numbers[at:at + k].copy(),
                             positions[at:at + k].copy(), m["charge"], m["multiplicity"],
                             m["origin"], m["meta"]))
        at += k
    return out


def check_cover(cands: list[Candidate], held: list[Candidate], labelled: set[str]) -> None:
    """Refuse to go on when quarantine left an element of the pool (or of the held-out set)
    without a label among ``labelled`` keys."""
    have = {int(z) for c in cands if c.key in labelled for z in c.numbers}
    need = {int(z) for c in cands + held for z in c.numbers}
    if need - have:
        z = min(need - have)
        raise InputError(
            f"learn: no initial label holds element {symbol(z)} (Z={z}): its "
            "structures were quarantined, so the committee could not predict them",
            hint="see learn/quarantine and raise learn.label.init")
