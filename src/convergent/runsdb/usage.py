"""What a stage held and for how long: the numbers ``stages.json`` keeps for ``runs cost``.

:func:`allocation` says how many cores (and GPUs) a stage of a run holds from its config
(simulate: the Dask workers x threads; train: processes x torch threads, one GPU per
process on CUDA, as :mod:`convergent.cluster.placement` resolves them; data/screen: one process). :func:`timed_stage` runs a stage and returns
its summary with ``wall_s``, ``cores``, ``gpus`` and the measured ``cpu_s`` (this process
and its reaped children, from ``getrusage``) plus the code version.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any, TypeVar

from convergent.cluster.resources import usable_cpus
from convergent.core.provenance import code_version

T = TypeVar("T")


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


PEER_PREFIX = "peer_"  # stages.json: the demo's stage training peer ``kind`` is ``peer_<kind>``


def allocation(cfg: Any, stage: str, placement: Any | None = None) -> tuple[float, float]:
    """(cores, gpus) that ``stage`` holds under ``cfg`` (a ConvergentConfig). Training (and
    a demo peer's stage, trained by the same launcher) uses ``placement`` (a
    :class:`convergent.cluster.placement.Placement`, as ``convergent train`` resolved it),
    else resolves ``parallel.nproc``/``train.device`` the same way."""
    if stage in ("simulate", "learn"):  # learn: the Dask pool that labels, trains and explores
        c = cfg.cluster
        if c.kind != "local":
            return 1.0, 0.0  # the client; the workers' use comes from the scheduler's records
        workers = c.n_workers or usable_cpus()
        return float(workers * c.threads_per_worker), 0.0
    if stage == "train" or stage.startswith(PEER_PREFIX):
        if placement is None:
            from convergent.cluster.placement import plan_training, visible_gpus

            p = cfg.parallel
            placement = plan_training(cfg.train.device, p.nproc, p.strategy, p.backend,
                                      visible_gpus(), fit=False)
        ranks = placement.nproc * cfg.parallel.nnodes
        return float(ranks * cfg.train.threads), float(ranks if placement.device == "cuda" else 0)
    if stage == "screen":
        return 1.0, 1.0 if cfg.screen.device.startswith("cuda") else 0.0
    return 1.0, 0.0


def held(cfg: Any, stage: str, placement: Any | None = None) -> dict[str, Any]:
    """``{"cores", "gpus", "code"}`` for a stage summary whose ``wall_s`` is already known."""
    cores, gpus = allocation(cfg, stage, placement)
    return {"cores": cores, "gpus": gpus, "code": code_version().to_dict()}


def measure(
    cfg: Any, stage: str, fn: Callable[[], T], placement: Any | None = None
) -> tuple[T, dict[str, Any]]:
    """``(fn(), usage)``; usage: wall_s, cores, gpus, cpu_s and code of the stage."""
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    value = fn()
    usage = {"wall_s": time.perf_counter() - t0, **held(cfg, stage, placement),
             "cpu_s": _cpu_seconds() - cpu0}
    return value, usage


def timed_stage(
    cfg: Any, stage: str, fn: Callable[[], dict[str, Any] | None], placement: Any | None = None
) -> dict[str, Any]:
    """Run ``fn`` and return its summary with wall_s, cores, gpus, cpu_s and code."""
    summary, usage = measure(cfg, stage, fn, placement)
    return {**(summary or {}), **usage}


def record_stage(run: Any, stage: str, summary: dict[str, Any]) -> None:
    """``run.mark_done(stage, summary)``, adding the times of earlier launches of the same
    stage (a resumed ``convergent train``), so stages.json holds the stage's whole cost."""
    before = run.stages().get(stage, {})
    merged = dict(summary)
    for key in ("wall_s", "cpu_s"):
        if isinstance(before.get(key), int | float) and isinstance(merged.get(key), int | float):
            merged[key] += before[key]
    if before:
        merged["launches"] = int(before.get("launches", 1)) + 1
    run.mark_done(stage, merged)
