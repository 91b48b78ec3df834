"""Parallel writer on Dask: one writer per task (worker), then an index merge.

Each partition is written by its own :class:`~convergent.data.writer.DatasetWriter` in
part mode (unique shard names, no manifest). The driver then merges: it opens every new
shard's index, checks the record counts and that keys are unique across the dataset, and
commits one manifest last. If the merge fails, the new shards are deleted and the
previous manifest (if any) is untouched.

>>> from dask.distributed import Client, LocalCluster
>>> with LocalCluster(n_workers=2) as cl, Client(cl) as client:
...     write_parallel(partitions, "data/all", client=client)
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

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

Partition = Iterable[dict[str, Any]] | Callable[[], Iterable[dict[str, Any]]]


def _write_part(part: Partition, path: str, tag: str, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Dask task: write one partition's records into shards; return their manifest entries."""
    from convergent.data.writer import DatasetWriter

    records = part() if callable(part) else part
    w = DatasetWriter(path, commit=False, check_unique=True, tag=tag, **settings)
    try:
        w.write_many(records)
        w.flush()
    except BaseException:
        w.abort()
        for info in w.new_shards:
            with contextlib.suppress(FileNotFoundError):
                (Path(path) / info.name).unlink()
        raise
    return [vars(s) for s in w.new_shards]


def merge_parts(path: str | os.PathLike[str], parts: Sequence[Sequence[dict[str, Any] | ShardInfo]],
                schema: str, compression: str, append: bool = False,
                overwrite: bool = False) -> Manifest:
    """Merge shard lists written by parts into one manifest (committed last, atomically).

    Checks each shard's header/index against its entry and the keys' uniqueness across
    the whole dataset (including existing shards when ``append``).
    """
    from convergent.data.reader import ShardReader

    root = Path(path)
    new = [s if isinstance(s, ShardInfo) else ShardInfo(**s) for part in parts for s in part]
    try:
        exists = manifest_path(root).is_file()
        if exists and append:
            manifest = read_manifest(root)
            if manifest.schema != schema:
                raise DataError(f"{root}: cannot append {schema!r} records to a {manifest.schema!r} dataset")
        elif exists and not overwrite:
            raise DataError(f"dataset already exists: {root}",
                            hint="pass append=True to add records or overwrite=True to replace it")
        else:
            manifest = Manifest(schema=schema, compression=compression)
        seen: dict[str, str] = {}
        for info in [*manifest.shards, *new]:
            rd = ShardReader(root, info)
            for key in strings(rd.meta.index, "key"):
                if key in seen:
                    raise DataError(
                        f"{root}: duplicate record key {key!r} (in shards {seen[key]} and {info.name})"
                    )
                seen[key] = info.name
        old = [] if (append or not exists) else [s.name for s in read_manifest(root).shards]
        manifest.shards.extend(new)
        write_manifest(root, manifest)
    except BaseException:
        for info in new:
            with contextlib.suppress(FileNotFoundError):
                (root / info.name).unlink()
        raise
    keep = {s.name for s in manifest.shards}
    for name in old:
        if name not in keep:
            with contextlib.suppress(FileNotFoundError):
                (root / name).unlink()
    return manifest


def write_parallel(
    partitions: Any,
    path: str | os.PathLike[str],
    *,
    schema: str = "molecular",
    shard_bytes: int = 128 * 2**20,
    compression: str = "zstd",
    append: bool = False,
    overwrite: bool = False,
    inline_bytes: int = 256,
    client: Any = None,
) -> Manifest:
    """Write records in parallel on Dask and commit one manifest.

    Args:
        partitions: a ``dask.bag.Bag`` of record dicts, or a sequence whose items are each
            an iterable of records or a zero-argument callable returning one (so records
            can be produced on the worker).
        path: dataset directory.
        client: a ``dask.distributed.Client``; default the current client if there is
            one, else Dask's local threaded scheduler.
        Other arguments as for :class:`~convergent.data.writer.DatasetWriter`.
    """
    import dask

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    if manifest_path(root).is_file() and not (append or overwrite):
        raise DataError(f"dataset already exists: {root}",
                        hint="pass append=True to add records or overwrite=True to replace it")
    fmt.schema_id(schema)
    fmt.codec_id(compression)
    settings = {"schema": schema, "shard_bytes": shard_bytes, "compression": compression,
                "inline_bytes": inline_bytes}
    run = secrets.token_hex(3)
    if hasattr(partitions, "to_delayed"):
        parts = partitions.to_delayed()
    else:
        parts = list(partitions)
    tasks = [
        dask.delayed(_write_part, pure=False)(p, str(root), f"{run}p{i:05d}", settings)
        for i, p in enumerate(parts)
    ]
    if client is None:
        with contextlib.suppress(ImportError, ValueError):
            from distributed import get_client

            client = get_client()
    try:
        if client is not None:
            results = client.gather(client.compute(tasks))
        else:
            results = dask.compute(*tasks, scheduler="threads")
    except BaseException:
        # a part failed: remove every shard this run wrote; the old manifest stays
        for f in root.glob(f"shard-{run}p*"):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        raise
    return merge_parts(root, results, schema, compression, append=append, overwrite=overwrite)
