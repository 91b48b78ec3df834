"""The shared pool: every task kind on one Dask cluster, ordered by Dask priorities.

No scheduler of our own: the campaign's :class:`Pool` is the task farm of
:mod:`convergent.sim.taskfarm` with learn's priorities — labels the trainer waits for and
training first, then scoring, then exploration MD, then evaluation — and Dask's queueing
and work stealing place them. Long low-priority work is chunked (one short trajectory or
one chunk of candidates per task), so a free core takes the highest-priority ready task
within seconds. On a machine with a GPU, a GPU worker joins the cluster with the Dask
resource ``GPU=1``; training, exploration and scoring then ask for that resource while
the CPU workers label. On a Slurm cluster with the GPU job kind (``cluster.gpu``), the GPU
jobs' workers carry ``GPU=1`` instead and labelling asks for the CPU jobs' resource
``CPU``, so it stays off the GPU jobs (:mod:`convergent.cluster.pool`).

Every attempt of every task is appended to the campaign's ``timeline.jsonl`` (kind,
start, end, worker, pid, device, round, the Slurm job; key, attempt and failure).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from convergent.cluster.pool import GPU_RESOURCE, WORKER_ENV
from convergent.core.errors import ConfigError
from convergent.sim.taskfarm import TaskFarm

#: Dask priorities (higher runs first) per task kind: the critical path (labels, training,
#: then scoring the round's candidates), then exploration for a later round, the held-out
#: set's labels (pipelined: only the first evaluation needs them), evaluation.
PRIORITY = {"label": 40, "train": 40, "score": 30, "explore": 20, "holdout": 15, "eval": 10}
#: Kinds that run on the GPU worker when there is one.
GPU_KINDS = ("train", "explore", "score", "eval")


class Pool(TaskFarm):
    """The campaign's task farm: learn's priorities and GPU kinds (``cpu_resource``: the
    other kinds ask for the CPU jobs' resource of a Slurm pool with a GPU job kind)."""

    def __init__(self, client: Any, timeline: Path, gpu: bool = False,
                 cpu_resource: bool = False) -> None:
        super().__init__(client, timeline, PRIORITY, GPU_KINDS, gpu, cpu_resource)


def read_timeline(path: Path) -> list[dict[str, Any]]:
    """The spans of ``timeline.jsonl``: the attempts that ran (a failed attempt whose
    worker died has no span and is left out; a torn last line after a crash is skipped)."""
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                row = json.loads(line)
                if "start" in row:
                    rows.append(row)
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
                          hint="use learn.device=auto or cpu, or GPU worker jobs on Slurm "
                          "(cluster.kind=slurm, cluster.gpu.enabled=true)")
    return ok


@contextlib.contextmanager
def gpu_worker(client) -> Iterator[None]:
    """A worker process with the Dask resource ``GPU=1`` joined to ``client``'s scheduler."""
    from distributed import Nanny

    address = client.scheduler.address

    async def start():
        return await Nanny(address, nthreads=1, resources={GPU_RESOURCE: 1}, name="gpu-0",
                           env=dict(WORKER_ENV))

    nanny = client.sync(start)
    client.wait_for_workers(len(client.scheduler_info()["workers"]) or 1)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            client.sync(nanny.close)
