"""Single-process dataset writer: records -> sealed shards -> manifest (committed last).

>>> with DatasetWriter("data/train", schema="molecular") as w:
...     w.write(record)      # one record dict
...     w.flush()            # seal the open shard, commit the manifest (durable checkpoint)

Each shard is written to a temporary file, sealed (index + trailer), fsynced and renamed;
then the manifest is rewritten atomically. A crash leaves the last committed manifest
intact; shard files it does not list are ignored by readers.
"""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import xxhash

from convergent.core.errors import DataError
from convergent.core.fsutil import file_mode, fsync_dir, start_writeback
from convergent.data import format as fmt
from convergent.data.indexbuild import IndexBuilder
from convergent.data.manifest import (
    Manifest,
    ShardInfo,
    manifest_path,
    read_manifest,
    write_manifest,
)
from convergent.data.reader import Dataset, open_dataset
from convergent.data.records import Encoded, encode_bytes, encode_molecular

DEFAULT_SHARD_BYTES = 128 * 2**20
DEFAULT_INLINE_BYTES = 256  # bytes-schema payloads up to this size live in the index
WRITEBACK_BYTES = 32 * 2**20  # a shard's bytes handed to the disk as it grows (fsutil.start_writeback)
WRITE_BUFFER = 2**20  # bytes gathered per write(2): records are ~1 KB, the default buffer (4 KiB) made a syscall every few records
TMP_SUFFIX = ".tmp"  # shards being written: '.<name>.<random>.tmp' (see data verify --clean)


class _OpenShard:
    """A shard being written to a temporary file, hashed as it grows."""

    def __init__(self, directory: Path, name: str, schema: int, codec: int, schema_name: str) -> None:
        self.directory, self.name = directory, name
        fd, self.tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=TMP_SUFFIX, dir=directory)
        os.fchmod(fd, file_mode())  # group-readable as the umask allows, like the manifest
        self.fh = os.fdopen(fd, "wb", buffering=WRITE_BUFFER)
        self.hash = xxhash.xxh3_64()
        self.header = fmt.pack_header(schema, codec)
        self.pos = 0
        self.synced = 0  # bytes handed to start_writeback
        # the index columns, compact (no bodies), spilled beside the shard past a few MiB
        self.index = IndexBuilder(schema_name, spill_dir=directory, name=name)
        self._write(self.header)

    def _write(self, data: bytes) -> None:
        self.fh.write(data)
        self.hash.update(data)
        self.pos += len(data)
        if self.pos - self.synced >= WRITEBACK_BYTES:  # start the disk writes now: seal's fsync
            self.fh.flush()                            # then waits for the tail only
            start_writeback(self.fh.fileno(), self.synced, self.pos - self.synced)
            self.synced = self.pos

    def add(self, enc: Encoded, frame: bytes) -> None:
        self.index.add(enc, self.pos)
        if frame:
            self._write(frame)

    @property
    def n(self) -> int:
        return self.index.n

    def seal(self) -> ShardInfo:
        """Write index + trailer, fsync, rename to the final name; return its manifest entry."""
        index_offset = self.pos
        crc, index_len = zlib.crc32(self.header), 0
        for piece in self.index.stream(index_offset):  # spilled columns read back in pieces
            self._write(piece)
            crc, index_len = zlib.crc32(piece, crc), index_len + len(piece)
        self._write(fmt.trailer_from_crc(crc, index_len, index_offset, self.n))
        self.index.close()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.directory / self.name)
        fsync_dir(self.directory)
        return ShardInfo(self.name, self.n, self.pos, self.hash.hexdigest())

    def abort(self) -> None:
        self.index.close()
        with contextlib.suppress(Exception):
            self.fh.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


class DatasetWriter:
    """Write records into a dataset directory of checksummed shards.

    Args:
        path: dataset directory (created if missing).
        schema: ``"molecular"`` or ``"bytes"`` (``key`` + ``payload``).
        shard_bytes: target shard size in bytes (a shard is sealed before it would exceed
            it; one oversized record still makes a shard). Default 128 MiB.
        compression: ``"zstd"`` (per record, kept only when it shrinks it) or ``"none"``.
        append: open an existing dataset and add shards to it (schema must match).
        overwrite: replace an existing dataset (its old shards are deleted only after the
            new manifest is committed). Without ``append``/``overwrite`` an existing
            dataset is an error, so nothing written earlier is lost by accident.
        inline_bytes: bytes-schema payloads up to this size are stored in the index.
        check_unique: refuse a key already in the dataset (DataError).
        commit: write the manifest on flush/close; ``False`` is used by the parallel writer
            whose driver merges the shard lists into one manifest.
        tag: name part unique to this writer (default random); shards are
            ``shard-<tag>-<seq>.cvs``.
        zstd_level: compression level.
        commit_on_error: when the ``with`` block raises, still seal and commit the
            records accepted so far (default; right for long campaigns that resume).
            ``False`` rolls back to the last committed manifest instead (``pack``).
        existing: ``path`` already opened with :func:`~convergent.data.reader.open_dataset`
            by the caller (``append`` only): its manifest and keys are used instead of
            reading them again, so a resuming campaign reads the dataset once.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema: str = "molecular",
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        compression: str = "zstd",
        append: bool = False,
        *,
        overwrite: bool = False,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
        check_unique: bool = True,
        commit: bool = True,
        tag: str | None = None,
        zstd_level: int = 3,
        commit_on_error: bool = True,
        existing: Dataset | None = None,
    ) -> None:
        self.path = Path(path)
        if existing is not None and not (append and commit and existing.path.resolve() == self.path.resolve()):
            raise DataError(f"{self.path}: existing= must be this dataset, opened to append to it")
        self._schema_id = fmt.schema_id(schema)
        self._codec = fmt.codec_id(compression)
        if shard_bytes < 4096:
            raise DataError(f"shard_bytes={shard_bytes} is too small", hint="use at least 4096 bytes")
        self.schema, self.compression = schema, compression
        self.shard_bytes, self.inline_bytes = int(shard_bytes), int(inline_bytes)
        self.check_unique, self.commit = check_unique, commit
        self.commit_on_error = commit_on_error
        self._uncommitted: list[str] = []
        self.tag = tag or secrets.token_hex(4)
        self._zstd = None
        if self._codec == 1:
            import zstandard

            self._zstd = zstandard.ZstdCompressor(level=zstd_level)
        self._keys: set[str] = set()
        self._old_shards: list[str] = []
        self.path.mkdir(parents=True, exist_ok=True)
        exists = existing is not None or manifest_path(self.path).is_file()
        if not commit:
            # a part of a parallel write: the driver merges and commits the manifest
            self.manifest = Manifest(schema=schema, compression=compression)
        elif exists and append:
            self._open_for_append(existing)
        elif exists and not overwrite:
            raise DataError(
                f"dataset already exists: {self.path}",
                hint="pass append=True to add records or overwrite=True to replace it",
            )
        else:
            if exists:
                self._old_shards = [s.name for s in read_manifest(self.path).shards]
            self.manifest = Manifest(schema=schema, compression=compression)
        self._seq = 0
        self._open: _OpenShard | None = None
        self._closed = False
        self.new_shards: list[ShardInfo] = []  # shards sealed by this writer
        self.records_written = 0

    # ------------------------------------------------------------------ API

    def write(self, record: dict[str, Any]) -> None:
        """Validate, encode and append one record (DataError on a malformed record)."""
        if self._closed:
            raise DataError(f"{self.path}: writer is closed")
        enc = (
            encode_molecular(record) if self._schema_id == 1
            else encode_bytes(record, self.inline_bytes)
        )
        frame = fmt.pack_frame(enc.body, self._codec, compressor=self._zstd) if enc.body else b""
        self.write_encoded(enc, frame)

    def write_encoded(self, enc: Encoded, frame: bytes) -> None:
        """Append one record encoded and framed elsewhere (e.g. on a Dask worker).

        ``enc`` is the record's :class:`~convergent.data.records.Encoded` (its ``body`` may
        be empty) and ``frame`` is ``format.pack_frame(body, codec)`` of this dataset's
        schema and codec. DataError on a duplicate key.
        """
        if self._closed:
            raise DataError(f"{self.path}: writer is closed")
        if self.check_unique:
            if enc.key in self._keys:
                raise DataError(f"{self.path}: duplicate record key {enc.key!r}")
            self._keys.add(enc.key)
        sh = self._open
        index_estimate = 64 * (sh.n + 1) + sh.index.inline_bytes + len(enc.payload or b"") if sh else 0
        if sh is not None and sh.n and sh.pos + len(frame) + index_estimate > self.shard_bytes:
            self._seal()
        if self._open is None:
            name = f"shard-{self.tag}-{self._seq:06d}{fmt.SHARD_SUFFIX}"
            self._seq += 1
            self._open = _OpenShard(self.path, name, self._schema_id, self._codec, self.schema)
        self._open.add(enc, frame)
        self.records_written += 1

    def write_many(self, records: Any) -> int:
        """Write every record of an iterable; returns how many were written."""
        n = 0
        for r in records:
            self.write(r)
            n += 1
        return n

    def flush(self) -> None:
        """Seal the open shard (even if small) and commit the manifest: a durable checkpoint."""
        self._seal()
        if self.commit:
            write_manifest(self.path, self.manifest)
            self._uncommitted = []
            self._delete_replaced()

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if self._closed:
            return
        self.flush()
        self._closed = True

    def abort(self) -> None:
        """Drop the open shard and shards sealed since the last commit (committed data stays)."""
        if self._open is not None:
            self._open.abort()
            self._open = None
        if self.commit:
            for name in self._uncommitted:
                with contextlib.suppress(FileNotFoundError):
                    (self.path / name).unlink()
            self._uncommitted = []
        self._closed = True

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        # On an error the records already accepted are still sealed and committed, so a
        # long campaign loses nothing; a KeyboardInterrupt/abort behaves the same.
        if self._closed:
            return
        if et is not None and not self.commit_on_error:
            self.abort()
            return
        try:
            self.close()
        except Exception:
            self.abort()
            if et is None:
                raise

    # ------------------------------------------------------------------ internals

    def _open_for_append(self, existing: Dataset | None) -> None:
        """Take the committed manifest (and, with ``check_unique``, the keys) of the dataset,
        from ``existing`` or from one opening of it."""
        ds = existing
        if ds is None and self.check_unique:
            ds = open_dataset(self.path)
        try:
            # a copy: this writer adds shards to it, the reader's view stays as opened
            self.manifest = copy.deepcopy(ds.manifest) if ds is not None else read_manifest(self.path)
            if self.manifest.schema != self.schema:
                raise DataError(
                    f"{self.path}: cannot append {self.schema!r} records to a "
                    f"{self.manifest.schema!r} dataset"
                )
            if self.check_unique:
                self._keys.update(ds.keys())
        finally:
            if ds is not None and existing is None:
                ds.close()

    def _seal(self) -> None:
        if self._open is None:
            return
        sh, self._open = self._open, None
        try:
            info = sh.seal()
        except BaseException:
            sh.abort()
            raise
        self.manifest.shards.append(info)
        self.new_shards.append(info)
        self._uncommitted.append(info.name)

    def _delete_replaced(self) -> None:
        keep = {s.name for s in self.manifest.shards}
        for name in self._old_shards:
            if name not in keep:
                with contextlib.suppress(FileNotFoundError):
                    (self.path / name).unlink()
        self._old_shards = []


def write_records(path: str | os.PathLike[str], records: Any, **kwargs: Any) -> Manifest:
    """Write an iterable of records to a new dataset; returns its manifest."""
    with DatasetWriter(path, **kwargs) as w:
        w.write_many(records)
    return w.manifest


def write_subset(ds: Dataset, indices: Sequence[int] | np.ndarray, path: str | os.PathLike[str],
                 **writer_kwargs: Any) -> Manifest:
    """Copy the records at ``indices`` (in that order) into a new dataset at ``path``.

    ``writer_kwargs`` go to :class:`~convergent.data.writer.DatasetWriter` (schema and
    compression default to the source's).
    """
    writer_kwargs.setdefault("schema", ds.schema)
    writer_kwargs.setdefault("compression", ds.manifest.compression)
    with DatasetWriter(path, **writer_kwargs) as w:
        for i in indices:
            w.write(ds[int(i)])
    return w.manifest
