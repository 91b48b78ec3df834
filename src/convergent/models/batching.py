"""Batches of molecules without padding: atoms concatenated, a molecule index per atom.

A batch of B molecules with N_tot atoms is one flat set of tensors (``numbers[N_tot]``,
``positions[N_tot,3]``, ``batch[N_tot]``); neighbour lists are built per molecule so no
edge crosses molecules. Batches are formed by an atom budget, not a molecule count, so
the work per step is nearly constant whatever the molecule sizes.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from convergent.core.errors import DataError


@dataclass
class AtomsBatch:
    """Flat batch of molecules.

    ``numbers`` int64[N]; ``positions`` float32[N,3] Å; ``batch`` int64[N] molecule index
    in ``[0, n_molecules)``; ``n_atoms`` int64[B]; ``energy`` float64[B] eV (None if not
    labelled); ``forces`` float32[N,3] eV/Å (None if not labelled); ``cell`` float32[B,3,3]
    Å and ``pbc`` bool[B,3] (None if no molecule is periodic); ``keys`` and
    ``molecule_ids`` of the records (may be empty).
    """

    numbers: torch.Tensor
    positions: torch.Tensor
    batch: torch.Tensor
    n_molecules: int
    n_atoms: torch.Tensor
    energy: torch.Tensor | None = None
    forces: torch.Tensor | None = None
    cell: torch.Tensor | None = None
    pbc: torch.Tensor | None = None
    keys: list[str] = field(default_factory=list)
    molecule_ids: list[str] = field(default_factory=list)

    @property
    def num_atoms(self) -> int:
        """Total atoms in the batch."""
        return int(self.numbers.shape[0])

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> AtomsBatch:
        """Copy to ``device``; ``dtype`` (if given) applies to positions/forces/cell."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                if dtype is not None and f.name in ("positions", "forces", "cell"):
                    v = v.to(device=device, dtype=dtype)
                else:
                    v = v.to(device)
            out[f.name] = v
        return AtomsBatch(**out)

    def with_positions(self, positions: torch.Tensor) -> AtomsBatch:
        """The same batch with other positions (e.g. a tensor requiring grad)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["positions"] = positions
        return AtomsBatch(**out)


def _get(rec: Mapping[str, Any], name: str, default: Any = None) -> Any:
    if type(rec) is dict:  # the common case, without the ABC isinstance check
        v = rec.get(name, default)
    else:
        v = rec.get(name, default) if isinstance(rec, Mapping) else getattr(rec, name, default)
    return default if v is None else v


def collate_records(
    records: Sequence[Mapping[str, Any]], dtype: torch.dtype = torch.float32
) -> AtomsBatch:
    """Concatenate record dicts into an :class:`AtomsBatch`.

    Each record has ``numbers`` int[N], ``positions`` float[N,3] Å and optionally
    ``energy`` (eV), ``forces`` float[N,3] eV/Å, ``cell`` [3,3] Å, ``pbc`` bool[3],
    ``key``, ``molecule_id``. ``energy``/``forces`` are kept only if every record has
    them (NaN, as written by the dataset store for unlabelled records, counts as absent). A malformed record raises :class:`~convergent.core.errors.DataError` naming its key.
    """
    if len(records) == 0:
        raise DataError("cannot collate an empty list of records")
    # one pass of cheap per-record work; the checks over all atoms run once, vectorised
    # (a batch of thousands of small molecules is collated on the host every step)
    nums, poss, ens, frcs, cells, pbcs, keys, mids = [], [], [], [], [], [], [], []
    counts = []
    for b, rec in enumerate(records):
        key = str(_get(rec, "key", b))
        z = np.asarray(_get(rec, "numbers"), dtype=np.int64)
        p = np.asarray(_get(rec, "positions"), dtype=np.float64)
        if z.ndim != 1 or p.shape != (z.shape[0], 3):
            raise DataError(
                f"record {key}: positions shape {p.shape} does not match {z.shape[0]} atoms"
            )
        n = z.shape[0]
        counts.append(n)
        nums.append(z)
        poss.append(p)
        e = _get(rec, "energy")  # the dataset store writes NaN for "not labelled"
        ens.append(np.nan if e is None else float(e))
        f = _get(rec, "forces")
        frcs.append(None if f is None else np.asarray(f, dtype=np.float64).reshape(n, 3))
        cells.append(_get(rec, "cell"))
        pbcs.append(_get(rec, "pbc"))
        keys.append(key)
        mids.append(str(_get(rec, "molecule_id", "")))
    positions = np.concatenate(poss)
    if not np.isfinite(positions).all():
        bad = next(k for k, p in zip(keys, poss, strict=True) if not np.isfinite(p).all())
        raise DataError(f"record {bad}: positions contain NaN/inf")
    en = np.asarray(ens, dtype=np.float64)
    energy = torch.from_numpy(en) if np.isfinite(en).all() else None
    forces = None
    if all(f is not None for f in frcs):
        fa = np.concatenate(frcs)
        if np.isfinite(fa).all():  # a record with NaN forces counts as unlabelled
            forces = torch.from_numpy(fa).to(dtype)
    cell = pbc = None
    any_periodic = False
    if any(x is not None for x in pbcs):
        try:  # every record has a bool[3]: one C-level copy
            pbc = np.asarray(pbcs, dtype=bool)
        except (ValueError, TypeError):
            pbc = None
        if pbc is None or pbc.shape != (len(records), 3):
            pbc = np.stack([np.zeros(3, bool) if x is None
                            else np.broadcast_to(np.asarray(x, bool), (3,)) for x in pbcs])
        any_periodic = bool(pbc.any())
    if any_periodic:
        cell = np.stack([np.zeros((3, 3)) if c is None
                         else np.asarray(c, dtype=np.float64).reshape(3, 3) for c in cells])
    count_arr = np.asarray(counts, dtype=np.int64)
    return AtomsBatch(
        numbers=torch.from_numpy(np.concatenate(nums)),
        positions=torch.from_numpy(positions).to(dtype),
        batch=torch.from_numpy(np.repeat(np.arange(len(records), dtype=np.int64), count_arr)),
        n_molecules=len(records),
        n_atoms=torch.from_numpy(count_arr),
        energy=energy,
        forces=forces,
        cell=torch.from_numpy(cell).to(dtype) if any_periodic else None,
        pbc=torch.from_numpy(pbc) if any_periodic else None,
        keys=keys,
        molecule_ids=mids,
    )


def atoms_to_record(atoms: Any, key: str = "0") -> dict[str, Any]:
    """An ``ase.Atoms`` as a record dict (energy/forces taken from an attached result if any)."""
    rec: dict[str, Any] = {
        "key": key,
        "molecule_id": atoms.info.get("molecule_id", atoms.get_chemical_formula()),
        "numbers": np.asarray(atoms.numbers, dtype=np.int64),
        "positions": np.asarray(atoms.positions, dtype=np.float64),
    }
    if atoms.pbc.any():
        rec["cell"] = np.asarray(atoms.cell.array, dtype=np.float64)
        rec["pbc"] = np.asarray(atoms.pbc, dtype=bool)
    calc = atoms.calc
    if calc is not None and getattr(calc, "results", None):
        if "energy" in calc.results:
            rec["energy"] = float(calc.results["energy"])
        if "forces" in calc.results:
            rec["forces"] = np.asarray(calc.results["forces"], dtype=np.float64)
    elif "energy" in atoms.info:
        rec["energy"] = float(atoms.info["energy"])
    return rec


def batches_by_atom_budget(
    atom_counts: Sequence[int], budget: int, shuffle_seed: int | None = None
) -> list[list[int]]:
    """Group indices into batches whose total atom count stays within ``budget``.

    Indices are taken in order (or in a seeded shuffled order) and packed greedily; a new
    batch starts when the next molecule would exceed the budget. A molecule larger than
    the budget gets a batch of its own (never dropped). Every index appears exactly once.
    """
    if budget <= 0:
        raise ValueError("atom budget must be positive")
    order = list(range(len(atom_counts)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_atoms = 0
    for i in order:
        n = int(atom_counts[i])
        if cur and cur_atoms + n > budget:
            batches.append(cur)
            cur, cur_atoms = [], 0
        cur.append(i)
        cur_atoms += n
    if cur:
        batches.append(cur)
    return batches
