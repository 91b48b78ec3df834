"""``data export --to webdataset|mds``: the same records in a peer format (for benchmarks).

* ``webdataset``: POSIX tar shards ``shard-000000.tar`` written with the standard
  library. Sample ``i`` has members ``<i:09d>.key`` (the original key, UTF-8) and
  ``<i:09d>.bin`` (bytes schema payload) or ``<i:09d>.npz`` + ``<i:09d>.json``
  (molecular arrays; scalars and meta). Readable by ``webdataset.WebDataset``.
* ``mds``: mosaicml-streaming's MDS (version 2, uncompressed, xxh3_64 shard hashes),
  written by :mod:`convergent.data.mds` (no ``streaming`` package needed); read it with
  ``streaming.StreamingDataset(local=OUT)``.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from convergent.core.errors import DataError
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.data.mds import write_mds
from convergent.data.reader import open_dataset

_ARRAYS = ("numbers", "positions", "forces", "cell", "pbc")


def _mol_members(rec: dict[str, Any]) -> tuple[bytes, bytes]:
    buf = io.BytesIO()
    np.savez(buf, **{k: rec[k] for k in _ARRAYS})
    scal = {k: rec[k] for k in ("key", "molecule_id", "energy", "charge", "multiplicity", "meta")}
    return buf.getvalue(), dumps_json(scal).encode()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mtime = 0
    tar.addfile(ti, io.BytesIO(data))


def export_webdataset(path: str | os.PathLike[str], out: str | os.PathLike[str],
                      shard_bytes: int = 128 * 2**20) -> list[str]:
    """Write the dataset as WebDataset tar shards; returns the shard file names."""
    ds = open_dataset(path)
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    tar: tarfile.TarFile | None = None
    tmp: Path | None = None
    size = 0

    def close() -> None:
        nonlocal tar
        if tar is not None:
            tar.close()
            assert tmp is not None
            os.replace(tmp, dest / names[-1])
            tar = None

    for i, rec in enumerate(ds):
        if tar is None or size >= shard_bytes:
            close()
            names.append(f"shard-{len(names):06d}.tar")
            tmp = dest / f".{names[-1]}.tmp"
            tar = tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT)
            size = 0
        stem = f"{i:09d}"
        _add(tar, f"{stem}.key", rec["key"].encode())
        if ds.schema == "bytes":
            _add(tar, f"{stem}.bin", rec["payload"])
            size += len(rec["payload"]) + 1536
        else:
            arrays, scal = _mol_members(rec)
            _add(tar, f"{stem}.npz", arrays)
            _add(tar, f"{stem}.json", scal)
            size += len(arrays) + len(scal) + 2048
    close()
    atomic_write_text(dest / "shards.txt", "".join(n + "\n" for n in names))
    return names


def export_mds(path: str | os.PathLike[str], out: str | os.PathLike[str],
               shard_bytes: int = 128 * 2**20) -> int:
    """Write the dataset as mosaicml-streaming MDS (see :mod:`convergent.data.mds`); returns
    the record count."""
    ds = open_dataset(path)
    return write_mds(iter(ds), out, ds.schema, size_limit=shard_bytes)


def export_dataset(path: str | os.PathLike[str], out: str | os.PathLike[str], to: str,
                   shard_bytes: int = 128 * 2**20) -> Any:
    """Export to ``to`` in ``{"webdataset", "mds"}`` (a failed export removes the output
    directory it created)."""
    writers = {"webdataset": export_webdataset, "mds": export_mds}
    if to not in writers:
        raise DataError(f"unknown export format {to!r}", hint="use webdataset or mds")
    open_dataset(path).manifest  # noqa: B018 - a missing/bad dataset fails before any output
    created = not Path(out).exists()
    try:
        return writers[to](path, out, shard_bytes)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
