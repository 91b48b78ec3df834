"""The task farm of a campaign: typed jobs on one Dask cluster, one retry rule, a timeline.

The learner decides, the farm executes (colmena's split). A caller describes work as
:class:`Job` values (a kind, a name, the function and its arguments, and whatever the
caller needs back in ``tag``); :class:`TaskFarm` submits them with the Dask priority and
resources of their kind (a GPU worker carries the Dask resource ``GPU=1``; in a Slurm pool
with a GPU job kind the CPU jobs' workers carry ``CPU`` and the other kinds ask for it, so
they stay off the GPU jobs: :mod:`convergent.cluster.pool`), records every
attempt in the timeline as a :class:`TaskRecord` (kind, key, attempt, span, failure) and,
in :meth:`TaskFarm.run`, applies the one retry rule (:func:`next_attempt`): a failed job
runs again until it has had ``retries`` re-runs; then the caller's ``on_failed`` decides
what replaces it (a refill, a split, a quarantine entry, or an error that ends the run).

The labelling campaign's bounded, packed farm (:mod:`convergent.sim.farm`) uses the same
retry rule; active learning (:mod:`convergent.learn`) runs every task kind here.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from convergent.cluster.pool import CPU_RESOURCE, GPU_RESOURCE
from convergent.core.fsutil import dumps_json

__all__ = ["Job", "Span", "TaskFarm", "TaskRecord", "Timed", "next_attempt", "timed"]


@dataclass
class Span:
    """When and where one task ran (wall-clock seconds since the epoch; ``job``: the Slurm
    job of the worker, if it runs in one)."""

    kind: str
    name: str
    start: float
    end: float
    worker: str
    pid: int
    device: str = "cpu"
    round: int = 0
    ok: bool = True
    job: str | None = None


@dataclass
class Timed:
    """A task's value and its :class:`Span` (what every farm task returns)."""

    value: Any
    span: Span
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskRecord:
    """One attempt of one job, as the timeline keeps it: the span when it ran (``None``
    when the worker died before answering) and the failure, if any."""

    kind: str
    key: str
    attempt: int
    span: Span | None
    failure: str | None = None

    def row(self) -> dict[str, Any]:
        """The timeline's JSON row: the span's fields at the top level (readers of the
        timeline use them directly), then key, attempt and failure."""
        span = asdict(self.span) if self.span is not None else {"kind": self.kind, "ok": False}
        return {**span, "ok": self.failure is None and span.get("ok", True), "key": self.key,
                "attempt": self.attempt, "failure": self.failure}


@dataclass(frozen=True)
class Job:
    """One unit of work: ``fn(*args, **kwargs)`` as a task of ``kind``. ``tag`` is the
    caller's (what it needs when the job ends); ``attempt`` counts re-runs (0: first)."""

    kind: str
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    round: int = 0
    tag: Any = None
    attempt: int = 0


def next_attempt(job: Job, retries: int) -> Job | None:
    """The one retry rule: ``job`` again, its attempt counted, while it has had fewer than
    ``retries`` re-runs; ``None`` when it is out of them (the caller gives up on it)."""
    return replace(job, attempt=job.attempt + 1) if job.attempt < retries else None


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return f"local-{os.getpid()}"


def timed(kind: str, name: str, rnd: int, device: str, fn: Callable[..., Any], *args: Any) -> Timed:
    """Run ``fn(*args)`` and wrap its value with its :class:`Span`."""
    t0 = time.time()
    value = fn(*args)
    return Timed(value, Span(kind, name, t0, time.time(), _worker_address(), os.getpid(), device,
                             rnd, job=os.environ.get("SLURM_JOB_ID")))


def _call(kind: str, name: str, rnd: int, device: str, fn: Callable[..., Any], args: tuple,
          kwargs: Mapping[str, Any]) -> Timed:
    return timed(kind, name, rnd, device, lambda: fn(*args, **kwargs))


class TaskFarm:
    """Jobs of several kinds on one Dask cluster, ordered by ``priorities`` (higher runs
    first); kinds in ``gpu_kinds`` ask for the resource ``GPU=1`` when ``gpu`` is set, and
    with ``cpu_resource`` (the CPU workers carry the resource ``CPU``) the other kinds ask
    for ``CPU=1``. Every attempt is appended to ``timeline`` (JSON lines; none when
    ``None``). :meth:`abort` (from any thread) ends the farm's work with an error."""

    def __init__(self, client: Any, timeline: Path | None, priorities: Mapping[str, int],
                 gpu_kinds: Iterable[str] = (), gpu: bool = False,
                 cpu_resource: bool = False) -> None:
        self.client, self.timeline, self.gpu = client, timeline, gpu
        self.cpu_resource = cpu_resource
        self.priorities, self.gpu_kinds = dict(priorities), frozenset(gpu_kinds)
        self.started = time.time()
        self.n_workers = len(client.scheduler_info().get("workers", {}))
        self.session = f"{int(self.started)}-{id(self) & 0xFFFF:04x}"
        self.jobs: dict[str, Job] = {}  # future key -> the job it runs
        self.futures: dict[str, Any] = {}  # future key -> the future, while it is pending
        self.abort_error: BaseException | None = None
        self._lock = threading.Lock()

    def abort(self, error: BaseException) -> None:
        """Stop from another thread (e.g. a Slurm job watch): pending futures are cancelled
        and whoever waits on one (:meth:`result`, :meth:`run`) raises ``error``."""
        self.abort_error = error
        with self._lock:
            pending = list(self.futures.values())
        with contextlib.suppress(Exception):
            self.client.cancel(pending)

    def resources(self, kind: str) -> dict[str, int] | None:
        """The Dask resources a task of ``kind`` asks for."""
        if self.device(kind) == "cuda":
            return {GPU_RESOURCE: 1}
        return {CPU_RESOURCE: 1} if self.cpu_resource else None

    def device(self, kind: str) -> str:
        return "cuda" if self.gpu and kind in self.gpu_kinds else "cpu"

    def submit_job(self, job: Job) -> Any:
        """A Dask future of ``job`` (its kwarg ``device``, if it takes one, set to where
        its kind runs)."""
        device = self.device(job.kind)
        kwargs = dict(job.kwargs)
        if "device" in kwargs:
            kwargs["device"] = device
        key = f"task-{job.kind}-r{job.round}-{job.name}-a{job.attempt}-{time.monotonic_ns()}"
        if self.abort_error is not None:
            raise self.abort_error
        fut = self.client.submit(_call, job.kind, job.name, job.round, device, job.fn, job.args,
                                 kwargs, priority=self.priorities.get(job.kind, 0),
                                 resources=self.resources(job.kind), pure=False, key=key)
        with self._lock:
            self.jobs[fut.key] = job
            self.futures[fut.key] = fut
        if self.abort_error is not None:  # aborted meanwhile: abort() may have missed it
            self.client.cancel([fut])
        return fut

    def submit(self, kind: str, name: str, rnd: int, fn: Callable[..., Any], *args: Any,
               **kwargs: Any) -> Any:
        """A future of a one-off job (no retries: :meth:`result` raises its error)."""
        return self.submit_job(Job(kind, name, fn, args, kwargs, rnd))

    def result(self, future: Any) -> Any:
        """The value of a finished future, its attempt recorded; raises the task's error
        (recorded as the attempt's failure)."""
        job = self.jobs.get(future.key) or Job("?", future.key, _call)
        try:
            out: Timed = future.result()  # still in self.futures: abort() can cancel it
        except Exception as exc:
            self.record(TaskRecord(job.kind, future.key, job.attempt, None,
                                   f"{type(exc).__name__}: {exc}"))
            if self.abort_error is not None:
                raise self.abort_error from None
            raise
        finally:
            with self._lock:
                self.jobs.pop(future.key, None)
                self.futures.pop(future.key, None)
        self.record(TaskRecord(job.kind, future.key, job.attempt, out.span))
        return out.value

    def run(self, jobs: Iterable[Job], *, retries: int,
            on_done: Callable[[Job, Any], Iterable[Job]],
            on_failed: Callable[[Job, BaseException], Iterable[Job]]) -> None:
        """Run ``jobs`` and what they lead to, until none is left: a finished job's value
        goes to ``on_done`` and a job out of retries to ``on_failed`` (:func:`next_attempt`);
        both return the jobs that follow (a refill, a split; none) or raise to stop."""
        from distributed import as_completed

        ac = as_completed([self.submit_job(j) for j in jobs], loop=self.client.loop)
        for fut in ac:
            job = self.jobs[fut.key]
            try:
                value = self.result(fut)
            except Exception as exc:  # a crashed worker or the task's own error
                if self.abort_error is not None:
                    raise
                again = next_attempt(job, retries)
                follow = [again] if again is not None else list(on_failed(job, exc))
            else:
                follow = list(on_done(job, value))
            for nxt in follow:
                ac.add(self.submit_job(nxt))

    def record(self, rec: TaskRecord) -> None:
        if self.timeline is None:
            return
        with self.timeline.open("a", encoding="utf-8") as fh:
            fh.write(dumps_json({**rec.row(), "session": self.session, "workers": self.n_workers,
                                 "opened": self.started}) + "\n")
