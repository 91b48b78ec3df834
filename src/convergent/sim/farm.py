"""The driver's task farm: bounded futures in flight, retries, splitting and quarantine.

Tasks are Dask futures (at most ``max_in_flight``, default 3 per worker, in flight). A
task that fails as a whole (worker crash, timeout, unexpected error) is retried
``retries`` times, then split into single frames, and what still fails is quarantined
with its reason; the farm never stops on a failure. Results go into the dataset writer
as tasks complete; the writer is flushed (shard sealed, manifest committed) at most every
``flush_every_s`` seconds, and by its owner's ``close`` at the end.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from convergent.core.errors import DataError
from convergent.sim.guards import Backstop, failure_reason
from convergent.sim.quarantine import QuarantineLog, quarantine_entry
from convergent.sim.summary import CampaignSummary
from convergent.sim.taskfarm import Job, next_attempt
from convergent.sim.tasks import FramesTask, Task, TaskResult
from convergent.sim.worker import execute_task_packed


def _job(task: Task, attempt: int = 0) -> Job:
    """A campaign task as the task farm's job (executed packed, in batches: see Farm)."""
    return Job("label", task.task_id, execute_task_packed, (task,), tag=task, attempt=attempt)


def run_nonce() -> str:
    """A short random id so Dask keys of two runs of the same campaign never collide."""
    return os.urandom(3).hex()


def n_workers(client) -> int:
    """Workers currently connected to the client's scheduler (0 if it cannot tell)."""
    with contextlib.suppress(Exception):
        return len(client.scheduler_info().get("workers", {}))
    return 0


class Farm:
    """Bounded-in-flight task farm with retries, splitting and quarantine (driver side)."""

    inflight: dict[Any, tuple[Task, int, str]]

    def __init__(self, client, writer, quarantine: QuarantineLog, skip: set[str],
                 retries: int, tag: str, max_in_flight: int | None, flush_every_s: float,
                 summary: CampaignSummary, progress, bar, on_task: Callable | None) -> None:
        self.client, self.writer, self.qlog = client, writer, quarantine
        self.skip = skip  # keys already committed or quarantined
        self.retries, self.tag = retries, tag
        self.max_in_flight, self.flush_every_s = max_in_flight, flush_every_s
        self.s, self.progress, self.bar, self.on_task = summary, progress, bar, on_task
        self.pending_records = 0
        self.inflight = {}
        self.min_in_flight = 0  # e.g. 3 x adapt_max so an adaptive cluster sees the backlog
        self.backstop: Backstop | None = None
        self.extra_status: Callable[[], str] | None = None  # e.g. Slurm job counts
        self.abort_error: BaseException | None = None

    def abort(self, error: BaseException) -> None:
        """Stop the farm from another thread: ``run`` raises ``error`` (nothing is
        quarantined; what was accepted stays with the writer)."""
        self.abort_error = error
        with contextlib.suppress(Exception):
            self.client.cancel(list(self.inflight))

    def refresh_status(self) -> None:
        with contextlib.suppress(Exception):
            self.progress.update(self.bar, status=self._status())

    def _limit(self) -> int:
        if self.max_in_flight:
            return self.max_in_flight
        return max(4, self.min_in_flight, 3 * max(1, n_workers(self.client)))

    def run(self, tasks: list[Task]) -> None:
        from distributed import as_completed

        self.queue: deque[Job] = deque(_job(t) for t in tasks)
        self.inflight = {}  # future -> (task, attempt, key)
        self.ac = as_completed(with_results=True, raise_errors=False, loop=self.client.loop)
        self.limit = self._limit()
        t_start = time.perf_counter()
        self._submit()
        if self.backstop is not None:
            self.backstop.start()
        try:
            self._loop()
        finally:
            if self.backstop is not None:
                self.backstop.stop()
        # the last records are committed when the caller closes the writer (one manifest
        # write instead of a flush here and another one on close)
        self.s.compute_wall_s = time.perf_counter() - t_start

    def _submit(self) -> None:
        """Top up the futures in flight (bounded, so the driver's memory stays small).

        All free slots are filled by one ``client.map`` call: one graph message to the
        scheduler instead of one per task.
        """
        batch: list[tuple[Task, int, str]] = []
        while self.queue and len(self.inflight) + len(batch) < self.limit:
            job = self.queue.popleft()
            task, attempt = job.tag, job.attempt
            batch.append((task, attempt, f"{self.tag}-{task.task_id}-a{attempt}"))
        if not batch:
            return
        keys = [key for _, _, key in batch]
        futures = self.client.map(execute_task_packed, [t for t, _, _ in batch], keys,
                                  compression=self.writer.compression, key=keys, pure=False)
        for fut, item in zip(futures, batch, strict=True):
            self.inflight[fut] = item
            self.ac.add(fut)

    def _loop(self) -> None:
        last_flush = limit_t = time.monotonic()
        while self.inflight:
            fut, value = next(self.ac)
            if self.abort_error is not None:
                raise self.abort_error
            task, attempt, key = self.inflight.pop(fut)
            if fut.status == "finished" and isinstance(value, bytes):
                value = pickle.loads(value)
            if fut.status == "finished" and isinstance(value, TaskResult):
                self._accept(task, value)
            else:
                exc = value
                if isinstance(value, tuple) and len(value) == 3:  # (type, exc, traceback)
                    exc = value[1]
                if not isinstance(exc, BaseException):
                    exc = RuntimeError(f"task ended with status {fut.status}")
                self._failed(task, attempt, key, exc, self.queue)
            fut.release()
            now = time.monotonic()
            if self.pending_records and now - last_flush >= self.flush_every_s:
                self.writer.flush()
                self.pending_records = 0
                last_flush = now
            if now - limit_t > 5.0:
                self.limit, limit_t = self._limit(), now
            self._submit()

    def _accept(self, task: Task, res: TaskResult) -> None:
        """Append a finished task's packed records and quarantine entries (new keys only)."""
        written = 0
        rejected = []
        for rec in res.records:
            if rec.key in self.skip:
                continue
            try:
                self.writer.write_encoded(rec.index, rec.frame)
            except DataError as exc:  # a record the store refuses: quarantine, go on
                rejected.append(quarantine_entry(rec.key, rec.index.molecule_id,
                                                 f"record refused by the dataset: {exc}"))
                continue
            self.skip.add(rec.key)
            written += 1
        q = [e for e in [*res.quarantined, *rejected] if e["key"] not in self.skip]
        self.qlog.append(q)
        for e in q:
            self.skip.add(e["key"])
            reason = e["reason"].split(":")[0][:60]
            self.s.reasons[reason] = self.s.reasons.get(reason, 0) + 1
        self.pending_records += written
        self.s.done += written
        self.s.quarantined += len(q)
        self.s.calc_s += res.calc_s
        self.s.n_calcs += res.n_calcs
        self.s.task_wall_s += res.wall_s
        self.s.tasks_run += 1
        self.progress.update(self.bar, advance=written + len(q), status=self._status())
        if self.on_task is not None:
            self.on_task(task, res, self.s)

    def _status(self) -> str:
        text = f"retried {self.s.retried} quarantined {self.s.quarantined}"
        return text if self.extra_status is None else f"{text} | {self.extra_status()}"

    def _failed(self, task: Task, attempt: int, key: str, exc: BaseException,
                queue: deque) -> None:
        """The task farm's retry rule (:func:`~convergent.sim.taskfarm.next_attempt`), then
        a split into single frames (each with its last chance), then quarantine."""
        again = next_attempt(_job(task, attempt), self.retries)
        if again is not None:
            self.s.retried += 1
            queue.appendleft(again)
            self.progress.update(self.bar, status=self._status())
            return
        if task.splittable and isinstance(task, FramesTask) and len(task.items) > 1:
            self.s.split += 1
            self.s.retried += 1
            for sub in reversed(task.split()):
                queue.appendleft(_job(sub, self.retries))  # last chance each
            return
        reason = failure_reason(self.client, exc, key, self.backstop)
        entries = [
            quarantine_entry(k, task.molecule_of(k), reason, task=task.task_id,
                              attempts=attempt + 1)
            for k in task.keys if k not in self.skip
        ]
        self.qlog.append(entries)
        for e in entries:
            self.skip.add(e["key"])
        short = reason.split(":")[0][:60]
        self.s.reasons[short] = self.s.reasons.get(short, 0) + len(entries)
        self.s.quarantined += len(entries)
        self.progress.update(self.bar, advance=len(entries), status=self._status())

