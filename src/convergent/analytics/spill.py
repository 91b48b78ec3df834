"""Hash-partitioned spill files: the disk-backed shuffle between two stages.

A map task groups its rows (a fixed numpy record dtype) by partition and appends them to
**its worker process's** spill file — one file per process and run, however many tasks
the process runs — one contiguous block per partition; it returns only the
:class:`Block` addresses (path, offset, rows). A reduce task reads its partition's blocks
back from every spill file. So the rows never sit in worker memory or travel through the
scheduler, a worker holds one map task's rows or one partition at a time, and a stage
writes one intermediate file per worker (aggregated I/O, as the output sinks).

Each append opens, writes and closes the file under a per-process lock (close-to-open
consistency: a reader on another node of a shared file system sees the whole block).
The driver deletes the spill directory when the stage is done or failed.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convergent.analytics.engine import proc_tag

_LOCK = threading.Lock()


@dataclass(frozen=True)
class Block:
    """Rows of one partition from one map task, in a spill file."""

    path: str
    offset: int  # bytes
    rows: int


def spill_dir(out: str | os.PathLike[str], run: str) -> Path:
    """The (hidden) spill directory of ``run`` next to its output."""
    return Path(out) / f".spill-{run}"


def append(directory: str | os.PathLike[str], run: str, parts: Sequence[np.ndarray]) -> list[Block]:
    """Append ``parts`` (one row array per partition, same dtype) to this process's spill
    file of ``run``; their addresses, one :class:`Block` per partition."""
    path = Path(directory) / f"spill-{run}{proc_tag()}.bin"
    blocks = []
    with _LOCK, open(path, "ab") as f:
        pos = f.tell()
        for rows in parts:
            rows = np.ascontiguousarray(rows)
            rows.tofile(f)
            blocks.append(Block(str(path), pos, len(rows)))
            pos += rows.nbytes
    return blocks


def read(blocks: Sequence[Block], dtype: np.dtype) -> np.ndarray:
    """The rows of ``blocks`` (in order), concatenated."""
    got = [np.fromfile(b.path, dtype=dtype, count=b.rows, offset=b.offset) for b in blocks if b.rows]
    for b, a in zip([b for b in blocks if b.rows], got, strict=True):
        if len(a) != b.rows:
            raise OSError(f"spill file {b.path} is short: {len(a)} of {b.rows} rows at byte {b.offset}")
    return np.concatenate(got) if got else np.zeros(0, dtype)


def usage(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """(files, bytes) in a spill directory."""
    files = [p for p in Path(directory).glob("spill-*.bin") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def remove(directory: str | os.PathLike[str]) -> None:
    shutil.rmtree(directory, ignore_errors=True)
