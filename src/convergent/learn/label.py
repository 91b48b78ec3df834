"""Labelling a selected batch on the shared pool: append with provenance, quarantine, refill.

The batch is labelled in chunks of ``label_chunk`` structures at the highest Dask
priority. Each finished chunk is appended to the dataset and committed at once (so a
killed driver loses at most the chunks in flight), with provenance in every record's
meta: round, strategy, score at selection, rank, origin. A structure whose calculation
fails is quarantined (``<dataset>/quarantine.jsonl``) and the batch is refilled with the
next candidate of the ranked list, and so is a label whose largest force exceeds
``max_force`` (a broken geometry or an unconverged calculation: one such label skews
the element references and the committee for every later round); a chunk whose worker dies is retried, then its
structures are quarantined. Keys already in the dataset or quarantined are never
submitted again, so a resumed campaign labels nothing twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convergent.core.fsutil import dumps_json
from convergent.data.writer import DatasetWriter
from convergent.learn.engine import Pool
from convergent.learn.pool import Candidate
from convergent.learn.tasks import label_items
from convergent.sim.quarantine import QUARANTINE_NAME, QuarantineLog, quarantine_entry
from convergent.sim.resume import existing_keys
from convergent.sim.taskfarm import Job

LABEL_LOG = "labels.jsonl"


@dataclass
class LabelOutcome:
    """What labelling one batch did."""

    labelled: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    refills: int = 0
    skipped: int = 0  # already labelled or quarantined (resume)
    seconds: float = 0.0


def committed_keys(dataset: Path) -> set[str]:
    return existing_keys(dataset)


def quarantined_keys(dataset: Path) -> set[str]:
    return QuarantineLog(dataset / QUARANTINE_NAME).keys()


def _item(c: Candidate, prov: dict[str, Any]) -> dict[str, Any]:
    meta = {"origin": c.origin, **{k: v for k, v in c.meta.items() if isinstance(v, int | float | str)},
            **prov}
    return {"key": c.key, "molecule_id": c.molecule_id, "numbers": c.numbers,
            "positions": c.positions, "charge": c.charge, "multiplicity": c.multiplicity,
            "meta": meta}


def _trusted(records: list[dict[str, Any]], max_force: float, rnd: int
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``records`` split into those within the force trust limit and quarantine entries
    for the others (``max_force`` 0: all trusted)."""
    if max_force <= 0:
        return list(records), []
    keep, bad = [], []
    for rec in records:
        f = rec.get("forces")
        fmax = float(np.abs(np.asarray(f, dtype=np.float64)).max()) if f is not None and len(f) else 0.0
        if np.isfinite(fmax) and fmax <= max_force:
            keep.append(rec)
        else:
            bad.append(quarantine_entry(rec["key"], str(rec.get("molecule_id", "")),
                                        f"largest force {fmax:.4g} eV/A above learn.label.max_force={max_force:g}",
                                        round=rnd))
    return keep, bad


def _first_todo(queue: Sequence[Candidate], committed: set[str], done: set[str], k: int
                ) -> tuple[list[Candidate], int]:
    """The candidates to submit first, and the index of ``queue`` the refills start at.

    The batch is the first ``k`` candidates of the ranking that label successfully; a
    resumed batch keeps what an earlier attempt labelled or quarantined and goes on in
    rank order, so it ends with the same structures as an uninterrupted one."""
    need = k - sum(1 for c in queue if c.key in committed)
    todo: list[Candidate] = []
    nxt = 0  # next index of ``queue`` to take from
    while need > 0 and nxt < len(queue):
        if queue[nxt].key not in done:
            todo.append(queue[nxt])
            need -= 1
        nxt += 1
    return todo, nxt


@dataclass
class _Labelling:
    """One batch in flight on the task farm: the refill cursor, the writer, the outcome.
    Its label jobs carry their candidates in ``Job.tag``; the farm retries a failed job
    (``learn.label.retries``) and hands back the ones out of retries (:meth:`failed`)."""

    calc: dict[str, Any]
    rnd: int
    strategy: str
    scores: dict[str, float] | None
    min_distance: float
    max_force: float
    log: Path | None
    qlog: QuarantineLog
    queue: list[Candidate]
    done: set[str]
    nxt: int
    out: LabelOutcome
    rank: dict[str, int] = field(default_factory=dict)
    writer: DatasetWriter | None = None
    on_chunk: Callable[[int], None] | None = None
    kind: str = "label"

    def prov(self, c: Candidate) -> dict[str, Any]:
        """The provenance a candidate's record carries in its meta."""
        s = (self.scores or {}).get(c.key)
        return {"round": self.rnd, "strategy": self.strategy, "rank": self.rank[c.key],
                "score": float(s) if s is not None else None}

    def job(self, cands: list[Candidate]) -> Job:
        """The label task of one chunk."""
        items = [_item(c, {kk: v for kk, v in self.prov(c).items() if v is not None}) for c in cands]
        return Job(self.kind, cands[0].key[:10], label_items, (items, self.calc, self.min_distance),
                   round=self.rnd, tag=cands)

    def finished(self, job: Job, res: Any) -> list[Job]:
        """A chunk labelled: commit what is trusted, refill for what is not."""
        return self.then(self.commit(res))

    def failed(self, job: Job, exc: BaseException) -> list[Job]:
        """A chunk out of retries: quarantine it and refill."""
        reason = f"label task failed {job.attempt + 1} times: {type(exc).__name__}: {exc}"
        self.qlog.append([quarantine_entry(c.key, c.molecule_id, reason, round=self.rnd)
                          for c in job.tag])
        return self.then([c.key for c in job.tag])

    def then(self, failed: list[str]) -> list[Job]:
        """After a chunk ended: count its failures, report progress, the refill's job."""
        self.out.quarantined += failed
        refill = self.refill(failed)
        if self.on_chunk is not None:
            self.on_chunk(len(self.out.labelled))
        return [self.job(refill)] if refill else []

    def commit(self, res: Any) -> list[str]:
        """Append a finished chunk's trusted records (and log them); quarantine the rest and
        return their keys."""
        records, untrusted = _trusted(res.records, self.max_force, self.rnd)
        rejected = [*res.quarantined, *untrusted]
        for rec in records:
            self.writer.write(rec)
        self.writer.flush()
        if self.log is not None:
            with self.log.open("a", encoding="utf-8") as fh:
                for rec in records:
                    fh.write(dumps_json({"key": rec["key"], "round": self.rnd, "strategy": self.strategy,
                                         "time": time.time()}) + "\n")
        self.out.labelled += [rec["key"] for rec in records]
        if rejected:
            self.qlog.append([{**q, "round": self.rnd} for q in rejected])
        return [q["key"] for q in rejected]

    def refill(self, failed: list[str]) -> list[Candidate]:
        """The next candidates of the ranking, one for each failed one."""
        refill = []
        for _ in failed:
            while self.nxt < len(self.queue) and self.queue[self.nxt].key in self.done:
                self.nxt += 1
            if self.nxt < len(self.queue):
                refill.append(self.queue[self.nxt])
                self.nxt += 1
        self.out.refills += len(refill)
        return refill


def label_batch(
    pool: Pool,
    dataset: Path,
    ranked: Sequence[Candidate],
    k: int,
    calc: dict[str, Any],
    *,
    rnd: int,
    strategy: str,
    scores: dict[str, float] | None = None,
    chunk: int = 2,
    retries: int = 1,
    min_distance: float = 0.5,
    max_force: float = 0.0,
    log: Path | None = None,
    on_chunk: Callable[[int], None] | None = None,
    kind: str = "label",
) -> LabelOutcome:
    """Label the first ``k`` usable candidates of ``ranked`` (refilling after failures;
    ``max_force`` eV/Å > 0 quarantines labels with a larger force component) as tasks of
    ``kind`` (its Dask priority: ``holdout`` for the held-out set, labelled in the
    background while the first committee trains)."""
    t0 = time.perf_counter()
    out = LabelOutcome()
    qlog = QuarantineLog(dataset / QUARANTINE_NAME)
    committed = committed_keys(dataset)
    done = committed | qlog.keys()
    queue = list(ranked)
    out.skipped = sum(1 for c in queue if c.key in done)
    todo, nxt = _first_todo(queue, committed, done, k)
    job = _Labelling(calc, rnd, strategy, scores, min_distance, max_force, log, qlog, queue, done,
                     nxt, out, rank={c.key: i for i, c in enumerate(ranked)}, on_chunk=on_chunk,
                     kind=kind)
    jobs = [job.job(todo[i:i + chunk]) for i in range(0, len(todo), chunk)]
    if jobs:
        with DatasetWriter(dataset, schema="molecular", append=True) as writer:
            job.writer = writer
            pool.run(jobs, retries=retries, on_done=job.finished, on_failed=job.failed)
    out.seconds = time.perf_counter() - t0
    return out


class Background:
    """``fn()`` (a :func:`label_batch`) in a thread of the driver, e.g. the held-out set's
    labels while the first committee trains; :meth:`join` waits and re-raises its error."""

    def __init__(self, fn: Callable[[], LabelOutcome]) -> None:
        self.out: LabelOutcome | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), name="learn-background", daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], LabelOutcome]) -> None:
        try:
            self.out = fn()
        except BaseException as exc:  # handed to whoever joins
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> LabelOutcome | None:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.out


def labelled_records(dataset: Path) -> list[dict[str, Any]]:
    """Every structure of ``dataset`` as a record to predict (sorted by key; none when it
    does not exist yet)."""
    from convergent.data.format import MANIFEST_NAME
    from convergent.data.reader import open_dataset

    if not (dataset / MANIFEST_NAME).is_file():
        return []
    ds = open_dataset(dataset)
    try:
        recs = [ds[i] for i in range(len(ds))]
    finally:
        ds.close()
    return sorted(({"key": r["key"], "molecule_id": r.get("molecule_id", ""),
                    "numbers": np.asarray(r["numbers"]), "positions": np.asarray(r["positions"]),
                    "charge": r.get("charge", 0), "multiplicity": r.get("multiplicity", 1)}
                   for r in recs), key=lambda r: r["key"])
