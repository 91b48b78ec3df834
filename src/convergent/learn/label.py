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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convergent.data.writer import DatasetWriter
from convergent.fsutil import dumps_json
from convergent.learn.engine import Pool
from convergent.learn.pool import Candidate
from convergent.learn.tasks import label_items
from convergent.sim.quarantine import QUARANTINE_NAME, QuarantineLog, quarantine_entry
from convergent.sim.resume import existing_keys

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
                                        f"largest force {fmax:.4g} eV/A above learn.max_force={max_force:g}",
                                        round=rnd))
    return keep, bad


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
) -> LabelOutcome:
    """Label the first ``k`` usable candidates of ``ranked`` (refilling after failures;
    ``max_force`` eV/Å > 0 quarantines labels with a larger force component)."""
    t0 = time.perf_counter()
    out = LabelOutcome()
    qlog = QuarantineLog(dataset / QUARANTINE_NAME)
    committed = committed_keys(dataset)
    done = committed | qlog.keys()
    rank = {c.key: i for i, c in enumerate(ranked)}
    queue = list(ranked)
    # The batch is the first ``k`` candidates of the ranking that label successfully; a
    # resumed batch keeps what an earlier attempt labelled or quarantined and goes on in
    # rank order, so it ends with the same structures as an uninterrupted one.
    need = k - sum(1 for c in queue if c.key in committed)
    out.skipped = sum(1 for c in queue if c.key in done)
    todo: list[Candidate] = []
    nxt = 0  # next index of ``queue`` to take from
    while need > 0 and nxt < len(queue):
        if queue[nxt].key not in done:
            todo.append(queue[nxt])
            need -= 1
        nxt += 1

    def prov(c: Candidate) -> dict[str, Any]:
        s = (scores or {}).get(c.key)
        return {"round": rnd, "strategy": strategy, "rank": rank[c.key],
                "score": float(s) if s is not None else None}

    def submit(cands: list[Candidate], attempt: int):
        items = [_item(c, {kk: v for kk, v in prov(c).items() if v is not None}) for c in cands]
        f = pool.submit("label", f"{cands[0].key[:10]}", rnd, label_items, items, calc, min_distance)
        return f, cands, attempt

    from distributed import as_completed

    pending = {}
    ac = as_completed(loop=pool.client.loop)
    for i in range(0, len(todo), chunk):
        f, cs, a = submit(todo[i:i + chunk], 0)
        pending[f.key] = (cs, a)
        ac.add(f)
    if not pending:
        out.seconds = time.perf_counter() - t0
        return out
    with DatasetWriter(dataset, schema="molecular", append=True) as writer:
        for fut in ac:
            cands, attempt = pending.pop(fut.key)
            failed: list[str] = []
            try:
                res = pool.result(fut)
            except Exception as exc:  # a crashed worker or an unexpected error: retry the chunk
                if attempt < retries:
                    f, cs, a = submit(cands, attempt + 1)
                    pending[f.key] = (cs, a)
                    ac.add(f)
                    continue
                reason = f"label task failed {attempt + 1} times: {type(exc).__name__}: {exc}"
                qlog.append([quarantine_entry(c.key, c.molecule_id, reason, round=rnd) for c in cands])
                failed = [c.key for c in cands]
            else:
                records, untrusted = _trusted(res.records, max_force, rnd)
                rejected = [*res.quarantined, *untrusted]
                for rec in records:
                    writer.write(rec)
                writer.flush()
                if log is not None:
                    with log.open("a", encoding="utf-8") as fh:
                        for rec in records:
                            fh.write(dumps_json({"key": rec["key"], "round": rnd, "strategy": strategy,
                                                 "time": time.time()}) + "\n")
                out.labelled += [rec["key"] for rec in records]
                if rejected:
                    qlog.append([{**q, "round": rnd} for q in rejected])
                failed = [q["key"] for q in rejected]
            out.quarantined += failed
            refill = []
            for _ in failed:  # refill the batch with the next candidates of the ranking
                while nxt < len(queue) and queue[nxt].key in done:
                    nxt += 1
                if nxt < len(queue):
                    refill.append(queue[nxt])
                    nxt += 1
            if refill:
                out.refills += len(refill)
                f, cs, a = submit(refill, 0)
                pending[f.key] = (cs, a)
                ac.add(f)
            if on_chunk is not None:
                on_chunk(len(out.labelled))
    out.seconds = time.perf_counter() - t0
    return out
