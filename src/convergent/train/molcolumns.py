"""Columnar batches of a molecule source: one vectorised gather per batch.

:class:`ColumnStore` keeps the atoms of every record it has seen in flat arrays
(``numbers``, ``positions``, ``forces``; offsets from the source's atom counts) and
builds an :class:`~convergent.models.batching.AtomsBatch` of any set of records with a
few numpy fancy-index gathers instead of a Python loop over records — the host work of
a step then no longer grows with the number of molecules per batch. Each record is
copied in once (checked as :func:`~convergent.models.batching.collate_records` checks
it). The batches are identical to ``collate_records`` on the same records; sources with
periodic records, or records whose forces are missing, use ``collate_records`` itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from convergent.core.errors import DataError
from convergent.models.batching import AtomsBatch, collate_records

__all__ = ["ColumnStore"]


class ColumnStore:
    """Flat per-atom arrays over a source's records (``read(i)``, ``records(idx)``,
    ``atom_counts``); records are read once, uncached, and live only in the arrays."""

    def __init__(self, source: Any) -> None:
        self.source = source
        counts = np.asarray(source.atom_counts, dtype=np.int64)
        self.counts = counts
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        total = int(self.offsets[-1])
        self.numbers = np.zeros(total, dtype=np.int64)
        self.positions = np.zeros((total, 3), dtype=np.float64)
        self.forces = np.zeros((total, 3), dtype=np.float64)
        self.energy = np.zeros(len(counts), dtype=np.float64)
        self.filled = np.zeros(len(counts), dtype=bool)
        self.plain = np.ones(len(counts), dtype=bool)  # labelled, finite, not periodic
        self.keys: list[str] = [""] * len(counts)
        self.mids: list[str] = [""] * len(counts)

    def _fill(self, i: int) -> None:
        rec = self.source.read(i)
        get = rec.get
        z = np.asarray(get("numbers"), dtype=np.int64)
        p = np.asarray(get("positions"), dtype=np.float64)
        n = int(self.counts[i])
        if get("key") is None or z.ndim != 1 or z.shape[0] != n or p.shape != (n, 3):
            self.plain[i] = False  # collate_records reports it, as it would have
            self.filled[i] = True
            return
        a, b = self.offsets[i], self.offsets[i + 1]
        self.numbers[a:b] = z
        self.positions[a:b] = p
        f, e, pb = get("forces"), get("energy"), get("pbc")
        periodic = pb is not None and bool(np.asarray(pb, bool).any())
        if f is None or e is None or periodic:
            self.plain[i] = False
        else:
            fa = np.asarray(f, dtype=np.float64).reshape(n, 3)
            self.forces[a:b] = fa
            self.energy[i] = float(e)
            self.plain[i] = bool(np.isfinite(fa).all() and np.isfinite(self.energy[i]))
        self.keys[i] = str(get("key"))
        mid = get("molecule_id")
        self.mids[i] = "" if mid is None else str(mid)
        self.filled[i] = True

    def batch(self, idx: list[int], dtype: torch.dtype = torch.float32) -> AtomsBatch:
        """The batch of records ``idx`` (in order), as ``collate_records`` would build it."""
        if not idx:
            raise DataError("cannot collate an empty list of records")
        ids = np.asarray(idx, dtype=np.int64)
        for i in ids[~self.filled[ids]].tolist():
            self._fill(i)
        if not self.plain[ids].all():
            return collate_records(self.source.records(idx), dtype)
        counts = self.counts[ids]
        starts = self.offsets[ids]
        total = int(counts.sum())
        # atom rows of each record: start + 0..count-1, concatenated
        ends = np.cumsum(counts)
        atom = np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - counts), counts)
        pos = self.positions[atom]
        if not np.isfinite(pos).all():
            for i in idx:
                a, b = self.offsets[i], self.offsets[i + 1]
                if not np.isfinite(self.positions[a:b]).all():
                    raise DataError(f"record {self.keys[i]}: positions contain NaN/inf")
        return AtomsBatch(
            numbers=torch.from_numpy(self.numbers[atom]),
            positions=torch.from_numpy(pos).to(dtype),
            batch=torch.from_numpy(np.repeat(np.arange(len(ids), dtype=np.int64), counts)),
            n_molecules=len(ids),
            n_atoms=torch.from_numpy(counts.copy()),
            energy=torch.from_numpy(self.energy[ids]),
            forces=torch.from_numpy(self.forces[atom]).to(dtype),
            keys=[self.keys[i] for i in idx],
            molecule_ids=[self.mids[i] for i in idx],
        )
