"""The analytics engine: per-shard tasks on Dask, per-worker output sinks, one commit.

Every command is a map over the shards of its input dataset(s): one task per shard, run
on a ``distributed.Client`` (local cluster by default, the Slurm cluster at scale) or, with
no client, in this process (the same functions, in order). A task streams its shard
record by record, so a worker holds one shard's index and one record at a time.

**Aggregated intermediate I/O.** A task does not write files of its own. Records it keeps
go to a *sink*: one :class:`~convergent.data.writer.DatasetWriter` per (run, output) per
worker process, kept in this module between tasks and rolled by size
(``shard_bytes``). After the map the driver seals every worker's sinks in one call and
commits each output's manifest once, with its lineage. So a stage writes about
``workers x ceil(bytes per worker / shard_bytes)`` files, not one per task.

**Locality.** With a node-local cache directory (``data.cache_dir``; ``{worker}`` in it is
replaced by the worker's name), the driver asks each worker which input shards its cache
holds, and a task reading such a shard is restricted to those workers (Dask worker
restrictions); it then reads the local copy.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from convergent.analytics.batching import units as units_of
from convergent.core.errors import DataError
from convergent.data import format as fmt
from convergent.data.index import strings
from convergent.data.manifest import (
    Manifest,
    ShardInfo,
    manifest_path,
    read_manifest,
    write_manifest,
)
from convergent.data.reader import ShardReader
from convergent.data.records import Encoded
from convergent.data.writer import DatasetWriter

# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class ShardTask:
    """One input shard: which dataset, which shard, where its records start globally."""

    dataset: str  # dataset directory
    info: ShardInfo
    shard_no: int  # position in the dataset's manifest
    start: int  # global index (over all inputs) of the shard's first record
    input_no: int = 0  # which input dataset (merge)
    cache_dir: str | None = None  # node-local cache to read from where it holds the shard


@dataclass(frozen=True)
class OutSpec:
    """Where and how an output dataset is written."""

    path: str
    schema: str
    compression: str
    shard_bytes: int


def plan(datasets: Sequence[str | os.PathLike[str]]) -> tuple[list[ShardTask], list[Manifest]]:
    """One task per shard of each input dataset, with global record offsets."""
    tasks: list[ShardTask] = []
    manifests = []
    start = 0
    for k, d in enumerate(datasets):
        m = read_manifest(d)
        manifests.append(m)
        for j, info in enumerate(m.shards):
            tasks.append(ShardTask(str(Path(d).resolve()), info, j, start, k))
            start += info.records
    return tasks, manifests


# --------------------------------------------------------------------------- reading


class ShardView:
    """Records of one shard, decoded or as checked raw frames (for copying unchanged)."""

    def __init__(self, task: ShardTask) -> None:
        cache = None
        cache_dir = task.cache_dir
        if cache_dir:
            from convergent.data.cache import ShardCache

            c = ShardCache(_expand(cache_dir))
            if c.local_path(task.info, Path(task.dataset)).exists():
                cache = c  # read the node-local copy; never copy a shard in for one pass
        self.task = task
        self.reader = ShardReader(Path(task.dataset), task.info, cache)
        self.cols = self.reader.meta.index
        self.schema = fmt.SCHEMA_NAMES[self.reader.meta.schema]
        self.codec = self.reader.meta.codec
        self.n = task.info.records
        self.keys = strings(self.cols, "key")
        self.molecule_ids = (strings(self.cols, "molecule_id") if self.schema == "molecular"
                             else self.keys)

    def record(self, i: int) -> dict[str, Any]:
        return self.reader.record(i)

    def encoded(self, i: int) -> Encoded:
        """The index fields of record ``i`` (body empty), for :meth:`DatasetWriter.write_encoded`."""
        c = self.cols
        if self.schema == "molecular":
            return Encoded(self.keys[i], b"", self.molecule_ids[i], int(c["n_atoms"][i]),
                           float(c["energy"][i]), int(c["charge"][i]), int(c["multiplicity"][i]))
        payload = None
        if c["inlined"][i]:
            o = c["inline.off"]
            payload = c["inline.data"][int(o[i]): int(o[i + 1])].tobytes()
        return Encoded(self.keys[i], b"", size=int(c["size"][i]), payload=payload)

    def frame(self, i: int) -> bytes:
        """Record ``i``'s stored frame, checksum checked (b"" for an inlined record)."""
        return self.reader.raw_frame(i)

    def copy_to(self, sink: DatasetWriter, i: int) -> None:
        """Append record ``i`` unchanged (raw frame when the codec matches, else re-encoded)."""
        if self.codec == sink._codec:
            sink.write_encoded(self.encoded(i), self.frame(i))
        else:
            sink.write(self.record(i))

    def close(self) -> None:
        self.reader.release()


def _expand(cache_dir: str) -> str:
    """The cache directory of this worker (``{worker}`` replaced by its name)."""
    return cache_dir.replace("{worker}", worker_name())


def worker_name() -> str:
    """This Dask worker's name ("local" outside a worker)."""
    if "distributed" not in sys.modules:  # not imported: not in a worker (and no import cost here)
        return "local"
    try:
        from distributed import get_worker

        return str(get_worker().name)
    except (ImportError, ValueError):
        return "local"


# --------------------------------------------------------------------------- sinks (worker side)

_SINKS: dict[str, dict[str, DatasetWriter]] = {}
_SINK_LOCK = threading.Lock()
_PROC_TAG = secrets.token_hex(3)
os.register_at_fork(after_in_child=lambda: globals().__setitem__("_PROC_TAG", secrets.token_hex(3)))


def proc_tag() -> str:
    """A short tag naming this worker process's files (new after a fork)."""
    return _PROC_TAG


def sink(run: str, name: str, spec: OutSpec) -> DatasetWriter:
    """This process's writer for output ``name`` of ``run`` (created on first use)."""
    with _SINK_LOCK:
        per_run = _SINKS.setdefault(run, {})
        w = per_run.get(name)
        if w is None:
            w = DatasetWriter(spec.path, schema=spec.schema, compression=spec.compression,
                              shard_bytes=spec.shard_bytes, commit=False, check_unique=False,
                              tag=f"{run}{_PROC_TAG}{name}")
            per_run[name] = w
        return w


def seal_sinks(run: str) -> dict[str, list[dict[str, Any]]]:
    """Seal this process's sinks of ``run``; their new shards by output name.

    The sinks (one per output, each its own files and directory) are sealed in parallel
    threads: sealing is mostly waiting for ``fsync``, and the file system serves several
    at once (one journal commit for all of them) instead of one after another."""
    with _SINK_LOCK:
        per_run = _SINKS.pop(run, {})
    writers = list(per_run.values())
    if len(writers) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(writers), thread_name_prefix="seal") as pool:
            for f in [pool.submit(w.flush) for w in writers]:
                f.result()
    else:
        for w in writers:
            w.flush()
    return {name: [vars(s) for s in w.new_shards] for name, w in per_run.items()}


def abort_sinks(run: str) -> None:
    """Drop this process's sinks of ``run`` (their files are removed by the driver)."""
    with _SINK_LOCK:
        per_run = _SINKS.pop(run, {})
    for w in per_run.values():
        w.abort()


def _cached(cache_dir: str, items: list[tuple[str, ShardInfo]], dask_worker: Any = None) -> list[int]:
    """Worker side (``client.run``): positions in ``items`` whose shard this worker's
    cache holds."""
    from convergent.data.cache import ShardCache

    name = str(dask_worker.name) if dask_worker is not None else worker_name()
    d = Path(cache_dir.replace("{worker}", name))
    if not d.is_dir():
        return []
    c = ShardCache(d)
    return [k for k, (ds, info) in enumerate(items) if c.local_path(info, Path(ds)).exists()]


# --------------------------------------------------------------------------- driver

def _run_batch(fn: Callable[..., Any], items: list[tuple[Any, tuple[Any, ...]]],
               args: tuple[Any, ...]) -> list[Any]:
    """Worker side of a batched map: ``fn`` on each (task, per-task args) in turn."""
    return [fn(task, *args, *more) for task, more in items]


@dataclass
class StageIO:
    """Files and bytes one stage wrote."""

    files: int = 0
    bytes: int = 0


@dataclass
class Engine:
    """Runs per-shard tasks on ``client`` (or in this process) with progress and locality."""

    client: Any = None
    progress: bool = True
    cache_dir: str | None = None
    io: dict[str, StageIO] = field(default_factory=dict)
    placed: dict[int, list[str]] = field(default_factory=dict)  # task no -> allowed workers

    @property
    def workers(self) -> int:
        if self.client is None:
            return 1
        return len(self.client.scheduler_info().get("workers", {}))

    def with_cache(self, tasks: Sequence[ShardTask]) -> list[ShardTask]:
        """The tasks, told to read through this engine's cache directory."""
        if not self.cache_dir:
            return list(tasks)
        return [replace(t, cache_dir=self.cache_dir) for t in tasks]

    def _placement(self, tasks: Sequence[ShardTask]) -> dict[int, list[str]]:
        if self.client is None or not self.cache_dir:
            return {}
        items = [(t.dataset, t.info) for t in tasks]
        held = self.client.run(_cached, self.cache_dir, items)
        where: dict[int, list[str]] = {}
        for w, idx in held.items():
            for k in idx:
                where.setdefault(k, []).append(w)
        n = len(held)
        return {k: sorted(ws) for k, ws in where.items() if len(ws) < n}

    def map(self, fn: Callable[..., Any], tasks: Sequence[ShardTask], *args: Any,
            label: str = "working", per_task: Sequence[tuple[Any, ...]] | None = None,
            batch: bool | str = False) -> list[Any]:
        """``[fn(task, *args, *per_task[k]) for k, task in enumerate(tasks)]`` on the cluster
        (or here); results in task order. Shard tasks read through the cache and run where
        it holds their shard; other items (e.g. partition numbers) run anywhere.

        ``batch``: run runs of consecutive tasks (same placement) as one Dask task each,
        for stages of many short tasks, where Dask's per-task cost (a few ms of scheduler
        and worker time) matters; ``batch=EVEN``: one run per worker of about equal
        records, for stages of a few ms per shard; ``batch=BALANCED``: those runs over most
        records, then single tasks, for long stages (see :mod:`.batching`)."""
        extra = per_task if per_task is not None else [()] * len(tasks)
        shards = all(isinstance(t, ShardTask) for t in tasks)  # else: no locality (e.g. partitions)
        if shards:
            tasks = self.with_cache(tasks)
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        err = Console(stderr=True)
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, transient=True, console=err, disable=not (self.progress and err.is_terminal)) as bar:
            t = bar.add_task(label, total=len(tasks))
            if self.client is None:
                out = []
                for task, more in zip(tasks, extra, strict=True):
                    out.append(fn(task, *args, *more))
                    bar.advance(t)
                return out
            from distributed import as_completed

            placed = self._placement(tasks) if shards else {}
            if shards:
                self.placed = placed
            sizes = [t.info.records for t in tasks] if shards else None  # EVEN cuts by records
            futs, units = [], units_of(len(tasks), placed, self.workers if batch else 1, batch, sizes)
            for j, unit in enumerate(units):
                ws = placed.get(unit[0])
                key = f"{label.replace(' ', '-')}-{secrets.token_hex(4)}-{j}"
                call = (fn, tasks[unit[0]], *args, *extra[unit[0]]) if not batch else (
                    _run_batch, fn, [(tasks[k], extra[k]) for k in unit], args)
                futs.append(self.client.submit(*call, pure=False, workers=ws,
                                               allow_other_workers=False if ws else None, key=key))
            pos = {f.key: j for j, f in enumerate(futs)}
            # a future is dropped once its result is here, so its worker frees the result
            # then, not after the whole stage (a worker's memory does not grow with tasks)
            pending = {f.key: f for f in futs}
            done = as_completed(futs, loop=self.client.loop)
            del futs
            out = [None] * len(tasks)
            try:
                for f in done:
                    unit = units[pos[f.key]]
                    res = f.result()
                    del pending[f.key]
                    for k, r in zip(unit, res if batch else [res], strict=True):
                        out[k] = r
                    bar.advance(t, len(unit))
            except BaseException:
                for f in pending.values():
                    f.cancel()
                raise
            return out

    def seal(self, run: str) -> dict[str, list[list[dict[str, Any]]]]:
        """Seal every worker's sinks of ``run``: output name -> one shard list per worker."""
        per = self.client.run(seal_sinks, run).values() if self.client is not None else [seal_sinks(run)]
        out: dict[str, list[list[dict[str, Any]]]] = {}
        for d in per:
            for name, shards in d.items():
                out.setdefault(name, []).append(shards)
        return out

    def abort(self, run: str, specs: dict[str, OutSpec]) -> None:
        """Drop the sinks of ``run`` everywhere and delete the files they wrote."""
        with contextlib.suppress(Exception):
            if self.client is not None:
                self.client.run(abort_sinks, run)
            else:
                abort_sinks(run)
        for spec in specs.values():
            for f in Path(spec.path).glob(f"shard-{run}*"):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
            for f in Path(spec.path).glob(f".shard-{run}*"):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()


def new_run() -> str:
    """A short id naming one command's output shards (``shard-<run><proc><output>-<seq>``)."""
    return secrets.token_hex(3)


def prepare_outputs(specs: dict[str, OutSpec], overwrite: bool,
                    inputs: Sequence[str | os.PathLike[str]] = ()) -> None:
    """Refuse existing outputs (unless ``overwrite``) and outputs that are inputs, before
    anything is computed."""
    ins = {Path(p).resolve() for p in inputs}
    for spec in specs.values():
        if Path(spec.path).resolve() in ins:
            raise DataError(f"output {spec.path} is an input of this command",
                            hint="write the result to a new path")
        if manifest_path(spec.path).is_file() and not overwrite:
            raise DataError(f"dataset already exists: {spec.path}",
                            hint="pass --overwrite to replace it, or choose another output path")
        if Path(spec.path).exists() and not Path(spec.path).is_dir():
            raise DataError(f"output {spec.path} exists and is not a directory")
    for spec in specs.values():
        Path(spec.path).mkdir(parents=True, exist_ok=True)


def commit(engine: Engine, run: str, specs: dict[str, OutSpec], lineage: dict[str, Any],
           stage: str, check_keys: bool = False) -> dict[str, Manifest]:
    """Seal the sinks and write each output's manifest once (with ``lineage``).

    An output no worker wrote to becomes an empty dataset. Old shards of an overwritten
    dataset are deleted after the new manifest is committed.
    """
    try:
        parts = engine.seal(run)
        out = {}
        io = engine.io.setdefault(stage, StageIO())
        for name, spec in specs.items():
            shards = [ShardInfo(**s) for part in parts.get(name, []) for s in part]
            shards.sort(key=lambda s: s.name)
            if check_keys:
                _check_unique(spec.path, shards)
            old = [s.name for s in read_manifest(spec.path).shards] if manifest_path(spec.path).is_file() else []
            m = Manifest(schema=spec.schema, compression=spec.compression, shards=shards,
                         extra={"lineage": dict(lineage, output=name)})
            write_manifest(spec.path, m)
            keep = {s.name for s in shards}
            for o in old:
                if o not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        (Path(spec.path) / o).unlink()
            io.files += len(shards) + 1
            io.bytes += m.bytes + manifest_path(spec.path).stat().st_size
            out[name] = m
        return out
    except BaseException:
        engine.abort(run, specs)
        raise


def _check_unique(path: str, shards: list[ShardInfo]) -> None:
    seen: dict[str, str] = {}
    for info in shards:
        rd = ShardReader(Path(path), info)
        for key in strings(rd.meta.index, "key"):
            if key in seen:
                raise DataError(f"{path}: duplicate record key {key!r} (from two inputs)",
                                hint="merge datasets whose keys are distinct, or use --prefix-keys")
            seen[key] = info.name


def lineage(operation: str, inputs: Sequence[str | os.PathLike[str]], manifests: Sequence[Manifest],
            parameters: dict[str, Any]) -> dict[str, Any]:
    """The lineage entry of an output manifest: inputs (path, records, manifest digest, their
    own lineage's operation) and the operation with its parameters."""
    from convergent import __version__

    ins = []
    for p, m in zip(inputs, manifests, strict=True):
        raw = manifest_path(p).read_bytes()
        parent = m.extra.get("lineage") or {}
        ins.append({"path": str(Path(p).resolve()), "records": m.records,
                    "manifest_xxh3": xxhash.xxh3_64_hexdigest(raw),
                    "produced_by": parent.get("operation")})
    return {"operation": operation, "parameters": parameters, "inputs": ins,
            "convergent": __version__, "time": time.time()}


def shard_groups(values: np.ndarray, n: int) -> list[np.ndarray]:
    """Indices of ``values`` (non-negative ints) split into ``n`` buckets by ``value % n``."""
    b = values % n
    order = np.argsort(b, kind="stable")
    cuts = np.searchsorted(b[order], np.arange(1, n))
    return np.split(order, cuts)
