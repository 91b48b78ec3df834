"""A round's committee predictions, member by member (the ``score`` tasks).

Selection needs the whole committee, but each member's predictions depend on that member
alone, so the score tasks are per member and chunk of ``learn.select.score_chunk``
records (:func:`convergent.learn.tasks.member_predict`) and the driver combines them
(:func:`convergent.learn.tasks.combine`). A pipelined campaign submits a member's tasks
for the round's pool candidates and labelled structures as soon as that member is
trained, so they run while the committee's last members still train; the exploration
frames, which arrive later, are scored at selection. Sequential phases submit every task
at selection; both give the same numbers (the same tasks)."""

from __future__ import annotations

from typing import Any

import numpy as np

from convergent.learn import tasks
from convergent.learn.engine import Pool


class MemberScores:
    """Committee ``members`` of round ``rnd`` on ``records``: :meth:`submit` one member's
    tasks (at most once), :meth:`collect` the combined arrays (``energy_pred``,
    ``energy_std``, ``force_std_max``, ``n_atoms``, with ``elements`` ``features``)."""

    def __init__(self, pool: Pool, rnd: int, members: list[str], records: list[dict[str, Any]],
                 chunk: int, batch_atoms: int, elements: list[int] | None) -> None:
        self.pool, self.rnd, self.members, self.records = pool, rnd, members, records
        self.chunk, self.batch_atoms, self.elements = chunk, batch_atoms, elements
        self.keys = [str(r.get("key", "")) for r in records]
        self.futures: dict[int, list[Any]] = {}

    def submit(self, k: int) -> None:
        if k in self.futures or not self.records:
            return
        self.futures[k] = [
            self.pool.submit("score", f"m{k}c{i}", self.rnd, tasks.member_predict, self.members[k],
                             self.records[i:i + self.chunk], self.batch_atoms, device="cpu",
                             elements=self.elements)
            for i in range(0, len(self.records), self.chunk)]

    def submit_all(self) -> MemberScores:
        for k in range(len(self.members)):
            self.submit(k)
        return self

    def collect(self) -> dict[str, np.ndarray]:
        if not self.records:
            return {}
        self.submit_all()
        parts = []
        for k in range(len(self.members)):
            chunks = [self.pool.result(f) for f in self.futures[k]]
            parts.append({"energy": np.concatenate([c["energy"] for c in chunks]),
                          "forces": np.concatenate([c["forces"] for c in chunks]),
                          "n_atoms": np.concatenate([c["n_atoms"] for c in chunks]),
                          "features": (np.concatenate([c["features"] for c in chunks])
                                       if self.elements is not None else None)})
        return tasks.combine(parts, self.records, self.elements)


def joined(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays of several :meth:`MemberScores.collect` results end to end (empty ones
    skipped)."""
    parts = [p for p in parts if p]
    if not parts:
        return {k: np.zeros(0) for k in ("energy_pred", "energy_std", "force_std_max", "n_atoms")}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
