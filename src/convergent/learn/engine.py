"""The shared pool: every task kind on one Dask cluster, ordered by Dask priorities.

No scheduler of our own: each kind of task is submitted with a Dask ``priority``
(labels the trainer waits for and training first, then exploration MD, then screening
and evaluation), and Dask's queueing and work stealing place them. Long low-priority work
is chunked (one short trajectory or one chunk of candidates per task), so a free core
takes the highest-priority ready task within seconds. On a machine with a GPU, a GPU
worker joins the cluster with the Dask resource ``GPU=1``; training, exploration and
scoring then ask for that resource while the CPU workers label.

Every finished task's :class:`~convergent.learn.tasks.Span` is appended to the
campaign's ``timeline.jsonl`` (kind, start, end, worker, pid, device, round).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from convergent.cluster import WORKER_ENV
from convergent.errors import ConfigError
from convergent.fsutil import dumps_json
from convergent.learn.tasks import Span, Timed, timed

#: Dask priorities (higher runs first) per task kind.
PRIORITY = {"label": 40, "train": 40, "explore": 20, "score": 10, "eval": 10}
#: Kinds that run on the GPU worker when there is one.
GPU_KINDS = ("train", "explore", "score", "eval")


class Pool:
    """Submit timed tasks of a kind to the shared cluster and record their spans."""

    def __init__(self, client, timeline: Path, gpu: bool = False) -> None:
        self.client = client
        self.timeline = timeline
        self.gpu = gpu
        self.started = time.time()
        self.n_workers = len(client.scheduler_info().get("workers", {}))
        self.session = f"{int(self.started)}-{id(self) & 0xFFFF:04x}"

    def device(self, kind: str) -> str:
        return "cuda" if self.gpu and kind in GPU_KINDS else "cpu"

    def submit(self, kind: str, name: str, rnd: int, fn, *args: Any, **kwargs: Any):
        """A Dask future of ``timed(kind, ...)``; ``kwargs`` go to ``fn``."""
        device = self.device(kind)
        resources = {"GPU": 1} if device == "cuda" else None
        if "device" in kwargs:
            kwargs["device"] = device
        return self.client.submit(_call, kind, name, rnd, device, fn, args, kwargs,
                                  priority=PRIORITY[kind], resources=resources, pure=False,
                                  key=f"learn-{kind}-r{rnd}-{name}-{time.monotonic_ns()}")

    def result(self, future) -> Any:
        """The value of a finished future (its span is recorded); raises the task's error."""
        out: Timed = future.result()
        self.record(out.span)
        return out.value

    def record(self, span: Span) -> None:
        with self.timeline.open("a", encoding="utf-8") as fh:
            fh.write(dumps_json({**asdict(span), "session": self.session,
                                 "workers": self.n_workers, "opened": self.started}) + "\n")


def _call(kind: str, name: str, rnd: int, device: str, fn, args, kwargs) -> Timed:
    return timed(kind, name, rnd, device, lambda: fn(*args, **kwargs))


def read_timeline(path: Path) -> list[dict[str, Any]]:
    """The spans of ``timeline.jsonl`` (a torn last line after a crash is skipped)."""
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


def gpu_wanted(device: str) -> bool:
    """Whether the campaign should add a GPU worker (``auto``: if CUDA is there)."""
    if device == "cpu":
        return False
    try:
        import torch

        ok = torch.cuda.is_available()
    except ImportError:
        ok = False
    if device == "cuda" and not ok:
        raise ConfigError("learn.device=cuda but no CUDA device is visible",
                          hint="use learn.device=auto or cpu")
    return ok


@contextlib.contextmanager
def gpu_worker(client) -> Iterator[None]:
    """A worker process with the Dask resource ``GPU=1`` joined to ``client``'s scheduler."""
    from distributed import Nanny

    address = client.scheduler.address

    async def start():
        return await Nanny(address, nthreads=1, resources={"GPU": 1}, name="gpu-0",
                           env=dict(WORKER_ENV))

    nanny = client.sync(start)
    client.wait_for_workers(len(client.scheduler_info()["workers"]) or 1)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            client.sync(nanny.close)
