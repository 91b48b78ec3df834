"""Map-style reader of a dataset directory and the molecule-wise split.

>>> ds = open_dataset("data/train")
>>> len(ds), ds[0]["energy"], ds.keys()[:3], ds.manifest.records

Shards are memory-mapped lazily (per process); every record frame's CRC is checked when
it is read and every shard's header/index/trailer CRC when it is opened, so corruption
raises :class:`~convergent.core.errors.DataError` naming the shard and offset. With a
:class:`~convergent.data.cache.ShardCache`, shard data is read from node-local copies.

The trainer reads through this map-style view
(:class:`convergent.train.moldata.MoleculeSource`); the data-read benchmark's reference
streaming reader over it is bench/dataio/stream.py. Subsets of a dataset are written by
:func:`convergent.data.writer.write_subset`.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from convergent.core.errors import DataError
from convergent.data import format as fmt
from convergent.data.index import strings
from convergent.data.manifest import Manifest, ShardInfo, read_manifest
from convergent.data.records import (
    MolecularFields,
    decode_bytes,
    decode_molecular,
    decode_plain_bytes_frames,
    molecular_fields,
)

if TYPE_CHECKING:
    from convergent.data.cache import ShardCache


_PID = [os.getpid()]  # this process's pid, updated in forked children (no syscall per read)
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


class ShardReader:
    """Reads records of one shard: index from the source file, data via the cache or mmap."""

    def __init__(self, directory: Path, info: ShardInfo, cache: ShardCache | None = None) -> None:
        self.directory, self.info, self.cache = directory, info, cache
        self.path = directory / info.name
        self._meta: fmt.ShardMeta | None = None
        self._offsets: list[int] | None = None
        self._offsets_np: np.ndarray | None = None
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._pid = -1
        self._dctx: Any = None
        # read the whole shard ahead when mapping it (sequential I/O instead of one page
        # fault per record); set by a reader that will read most of the records (the
        # data-read benchmark's streaming reader, bench/dataio/stream.py)
        self.populate = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_mm=None, _view=None, _pid=-1, _dctx=None)
        return state

    @property
    def name(self) -> str:
        return self.info.name

    def check_size(self) -> int:
        """Size of the source shard file, bytes; DataError if it is missing or differs from
        the manifest (a cheap ``stat``; the index is checked when first read)."""
        return self._check_size(self.path)

    def _check_size(self, path: Path) -> int:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DataError(f"shard {self.name}: file missing ({path})",
                            hint="the dataset is incomplete; restore the shard") from None
        if size != self.info.bytes:
            raise DataError(
                f"shard {self.name}: size {size} bytes, manifest says {self.info.bytes} "
                f"({'truncated' if size < self.info.bytes else 'extended'})",
                hint="re-create the shard or restore it from a good copy",
            )
        return size

    @property
    def meta(self) -> fmt.ShardMeta:
        """Header, trailer and index (read with small reads from the source file)."""
        if self._meta is None:
            size = self._check_size(self.path)
            with open(self.path, "rb") as fh:
                fd = fh.fileno()
                meta = fmt.parse_shard_meta(lambda o, n: os.pread(fd, n, o), size, self.name)
            if meta.count != self.info.records:
                raise DataError(
                    f"shard {self.name}: holds {meta.count} records, manifest says {self.info.records}",
                    hint="the manifest does not match the shard (mixed-up copies?)",
                )
            self._meta = meta
            self._offsets_np = meta.index["offsets"].astype(np.int64)
            self._offsets = self._offsets_np.tolist()
        return self._meta

    def _map(self) -> mmap.mmap:
        if self._mm is None or self._pid != _PID[0]:
            self.meta  # noqa: B018 - checks layout first
            for attempt in range(8):
                path = self.cache.get(self.info, self.directory) if self.cache is not None else self.path
                try:
                    fh = open(path, "rb")
                except FileNotFoundError:
                    # another process on the node evicted the copy between get and open
                    if self.cache is None or attempt == 7:
                        self._check_size(Path(path))
                        raise
                    continue
                with fh:
                    size = os.fstat(fh.fileno()).st_size
                    if size != self.info.bytes:
                        self._check_size(Path(path))
                    self._mm = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                    if self.populate and hasattr(mmap, "MADV_WILLNEED"):
                        # read the whole shard ahead, asynchronously (large sequential I/O;
                        # the first records are served while the rest arrives)
                        self._mm.madvise(mmap.MADV_WILLNEED)
                    self._view = memoryview(self._mm)
                break
            self._pid = _PID[0]
        return self._mm

    def release(self) -> None:
        """Unmap the data (the next read maps it again)."""
        if self._mm is not None and self._pid == _PID[0]:
            try:
                if self._view is not None:
                    self._view.release()
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view: the map closes when it is collected
        self._mm, self._view, self._pid = None, None, -1

    def _frame_view(self, i: int) -> memoryview | None:
        """The stored bytes of local record ``i``'s frame (None if inlined), unchecked."""
        offs = self._offsets
        if offs is None:
            self.meta  # noqa: B018 - loads and checks the index
            offs = self._offsets
            assert offs is not None
        a, b = offs[i], offs[i + 1]
        if a == b:
            return None
        if self._pid != _PID[0] or self._view is None:
            self._map()
        return self._view[a:b]  # type: ignore[index]

    def frame_body(self, i: int) -> bytes | memoryview:
        """Checked, decompressed frame body of local record ``i`` (empty if inlined)."""
        buf = self._frame_view(i)
        if buf is None:
            return b""
        if self._dctx is None and self._meta.codec == 1:  # type: ignore[union-attr]
            import zstandard

            self._dctx = zstandard.ZstdDecompressor()
        return fmt.unpack_frame(buf, self.name, self._dctx, i, self._offsets[i])  # type: ignore[index]

    def raw_frame(self, i: int) -> bytes:
        """Local record ``i``'s frame as stored (checksum checked, not decompressed; b"" if
        inlined): what a writer with the same schema and codec appends unchanged."""
        buf = self._frame_view(i)
        if buf is None:
            return b""
        fmt.check_frame(buf, self.name, i, self._offsets[i])  # type: ignore[index]
        return bytes(buf)

    def records(self, local: list[int]) -> list[dict[str, Any]]:
        """Decode the local records ``local`` (one pass over the shard's map for the common
        case of uncompressed bytes frames; same checks and errors as :meth:`record`)."""
        if self._offsets is None:
            self.meta  # noqa: B018 - loads and checks the index
        if self._meta.schema != 2 or self._meta.codec != 0:  # type: ignore[union-attr]
            return [self.record(i) for i in local]
        if self._pid != _PID[0] or self._view is None:
            self._map()
        fast = decode_plain_bytes_frames(self._view, self._offsets_np, local)  # type: ignore[arg-type]
        return [r if r is not None else self.record(i) for r, i in zip(fast, local, strict=True)]

    def fields(self, i: int) -> MolecularFields:
        """Numbers, energy, forces and meta of molecular local record ``i`` (same checks and
        errors as :meth:`record`; arrays are read-only views)."""
        body = self.frame_body(i)
        try:
            return molecular_fields(body)
        except Exception as exc:  # any decode failure of a checksum-valid frame
            raise self._malformed(i, exc) from None

    def _malformed(self, i: int, exc: Exception) -> DataError:
        where = f"shard {self.name} record {i} at offset {self._offsets[i]}"  # type: ignore[index]
        return DataError(f"{where}: malformed record body: {exc}")

    def record(self, i: int) -> dict[str, Any]:
        """Decode local record ``i`` into a record dict."""
        body = self.frame_body(i)
        meta = self._meta
        assert meta is not None
        try:
            if meta.schema == 1:
                return decode_molecular(body)
            if len(body) == 0:
                cols = meta.index
                if not cols["inlined"][i]:
                    raise ValueError("record has neither a frame nor an inlined payload")
                o = cols["inline.off"]
                key = _string_at(cols, "key", i)
                return {"key": key, "payload": cols["inline.data"][int(o[i]) : int(o[i + 1])].tobytes()}
            return decode_bytes(body)
        except DataError:
            raise
        except Exception as exc:  # any decode failure of a checksum-valid frame
            raise self._malformed(i, exc) from None


def _string_at(cols: dict[str, np.ndarray], name: str, i: int) -> str:
    off = cols[f"{name}.off"]
    return cols[f"{name}.utf8"][int(off[i]) : int(off[i + 1])].tobytes().decode()


class Dataset:
    """Map-style view of a committed dataset: ``len(ds)``, ``ds[i]``, ``ds.keys()``.

    Indices are global, in shard order of the manifest. Columns of the index (small fields
    inlined at write time) are available without touching record data:
    :meth:`column` (``energy``, ``n_atoms``, ``charge``, ``multiplicity``, ``size``) and
    :meth:`molecule_ids`.
    """

    def __init__(self, path: str | os.PathLike[str], cache: ShardCache | None = None) -> None:
        self.path = Path(path)
        self.manifest: Manifest = read_manifest(self.path)
        self.schema = self.manifest.schema
        self.cache = cache
        self.shards = [ShardReader(self.path, s, cache) for s in self.manifest.shards]
        self.counts = np.array([s.records for s in self.manifest.shards], np.int64)
        self.starts = np.zeros(len(self.counts) + 1, np.int64)
        np.cumsum(self.counts, out=self.starts[1:])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __repr__(self) -> str:
        return f"Dataset({str(self.path)!r}, schema={self.schema!r}, records={len(self)}, shards={len(self.shards)})"

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, index within the shard) of global record ``i``."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"record index {i} out of range for {n} records")
        s = int(np.searchsorted(self.starts, i, side="right")) - 1
        return s, i - int(self.starts[s])

    def shard_of(self, indices: np.ndarray) -> np.ndarray:
        """Shard number of each global index (vectorised)."""
        return np.searchsorted(self.starts, np.asarray(indices, np.int64), side="right") - 1

    def __getitem__(self, i: int) -> dict[str, Any]:
        s, j = self.locate(int(i))
        return self.shards[s].record(j)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for sh in self.shards:
            for j in range(sh.info.records):
                yield sh.record(j)

    def records(self, indices: Sequence[int] | np.ndarray) -> Iterator[dict[str, Any]]:
        """Records at the given global indices, in that order."""
        for i in indices:
            yield self[int(i)]

    def keys(self) -> list[str]:
        """All record keys, in index order (read from the shard indices only)."""
        out: list[str] = []
        for sh in self.shards:
            out.extend(strings(sh.meta.index, "key"))
        return out

    def molecule_ids(self) -> list[str]:
        """Molecule id of every record (molecular schema; ``key`` for the bytes schema)."""
        if self.schema != "molecular":
            return self.keys()
        out: list[str] = []
        for sh in self.shards:
            out.extend(strings(sh.meta.index, "molecule_id"))
        return out

    def column(self, name: str) -> np.ndarray:
        """A numeric index column over all records (e.g. ``energy`` in eV, ``n_atoms``)."""
        parts = []
        for sh in self.shards:
            cols = sh.meta.index
            if name not in cols or name.endswith((".off", ".utf8", ".data")) or name == "offsets":
                raise DataError(f"{self.path}: no index column {name!r} in a {self.schema} dataset")
            parts.append(np.asarray(cols[name]))
        return np.concatenate(parts) if parts else np.zeros(0)

    def close(self) -> None:
        """Unmap every shard."""
        for sh in self.shards:
            sh.release()


def open_dataset(path: str | os.PathLike[str], cache: ShardCache | str | os.PathLike[str] | None = None,
                 cache_bytes: int | None = None) -> Dataset:
    """Open a committed dataset for reading.

    Args:
        path: dataset directory (with ``manifest.json``).
        cache: a :class:`~convergent.data.cache.ShardCache` or a node-local directory to
            copy shards into before reading them (checked against their xxh3 on copy).
        cache_bytes: byte budget when ``cache`` is a directory (default 10 GiB).
    """
    if cache is not None and not hasattr(cache, "get"):
        from convergent.data.cache import ShardCache

        cache = ShardCache(cache, budget_bytes=cache_bytes or 10 * 2**30)
    return Dataset(path, cache)  # type: ignore[arg-type]


def split_by_molecule(
    ds: Dataset, val_fraction: float = 0.1, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Split record indices so that no molecule has records on both sides.

    Molecules are shuffled with ``seed`` and ``round(val_fraction * n_molecules)`` of them
    (at least one when ``val_fraction > 0`` and there are two or more) go to validation.
    Returns ``(train_indices, val_indices)``, each a sorted int64 array.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in [0, 1)")
    mol = np.asarray(ds.molecule_ids(), dtype=object)
    uniq, inverse = np.unique(mol.astype(str), return_inverse=True) if len(mol) else (np.array([]), np.array([], np.int64))
    n_mol = len(uniq)
    n_val = int(round(val_fraction * n_mol))
    if val_fraction > 0 and n_mol >= 2:
        n_val = min(max(n_val, 1), n_mol - 1)
    rng = np.random.default_rng(seed)
    is_val_mol = np.zeros(n_mol, bool)
    is_val_mol[rng.permutation(n_mol)[:n_val]] = True
    is_val = is_val_mol[inverse] if n_mol else np.zeros(0, bool)
    idx = np.arange(len(mol), dtype=np.int64)
    return idx[~is_val], idx[is_val]
