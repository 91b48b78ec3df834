"""A shard's index read in bounded pieces, for shards too large to load whole.

:class:`~convergent.data.reader.ShardReader` reads a shard's whole index into memory (and
the offset table into a Python list): right for reading records, but a task that only
needs one column of a large shard (an analytics output rolled at 1 GiB holds ~100 bytes
of index per record) would hold the whole index. :class:`IndexScan` checks the same
header, trailer and CRC-32 (streaming the index through the CRC in 1 MiB reads), then
reads the requested column rows on demand with ``pread``.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

from convergent.core.errors import DataError
from convergent.data import format as fmt
from convergent.data.index import column_table
from convergent.data.manifest import ShardInfo

_PIECE = 2**20  # bytes per read while checking the index CRC


class IndexScan:
    """Checked access to single columns of one shard's index, ``rows`` at a time.

    >>> with IndexScan(Path("ds"), info) as sc:
    ...     for a in range(0, sc.count, 65536):
    ...         off, data = sc.strings("molecule_id", a, min(a + 65536, sc.count))
    """

    def __init__(self, directory: Path, info: ShardInfo) -> None:
        self.name = info.name
        try:
            self._fh = open(Path(directory) / info.name, "rb")
        except FileNotFoundError:
            raise DataError(f"shard {info.name}: file missing ({Path(directory) / info.name})",
                            hint="the dataset is incomplete; restore the shard") from None
        try:
            fd = self._fh.fileno()
            size = os.fstat(fd).st_size
            if size != info.bytes:
                raise DataError(f"shard {info.name}: size {size} bytes, manifest says {info.bytes}",
                                hint="re-create the shard or restore it from a good copy")
            ends = fmt.parse_shard_ends(lambda o, n: os.pread(fd, n, o), size, info.name)
            crc = zlib.crc32(ends.header)
            for a in range(ends.index_offset, ends.index_offset + ends.index_len, _PIECE):
                n = min(_PIECE, ends.index_offset + ends.index_len - a)
                crc = zlib.crc32(self._read(a, n), crc)
            fmt.check_ends(ends, crc, info.name)
            if ends.count != info.records:
                raise DataError(f"shard {info.name}: holds {ends.count} records, manifest says {info.records}")
            self.schema = fmt.SCHEMA_NAMES[ends.schema]
            self.count = ends.count
            self._cols = self._table(ends)
        except BaseException:
            self._fh.close()
            raise

    def _read(self, offset: int, n: int) -> bytes:
        b = os.pread(self._fh.fileno(), n, offset)
        if len(b) != n:
            raise DataError(f"shard {self.name}: short read at offset {offset} (file changed?)")
        return b

    def _table(self, ends: fmt.ShardEnds) -> dict[str, tuple[np.dtype, int, int]]:
        """Column name -> (dtype, absolute file offset, count), bounds checked."""
        table = column_table(lambda o, n: self._read(ends.index_offset + o, n), ends.index_len,
                             f"shard {self.name} at offset {ends.index_offset}")
        return {name: (dt, ends.index_offset + off, int(np.prod(shape)) if shape else 1)
                for name, (dt, off, shape) in table.items()}

    def has(self, name: str) -> bool:
        """Whether the index holds column ``name`` (a string column: ``name.off``)."""
        return name in self._cols or f"{name}.off" in self._cols

    def array(self, name: str, a: int, b: int) -> np.ndarray:
        """Elements ``a:b`` of numeric column ``name``."""
        dt, off, count = self._cols[name]
        if not 0 <= a <= b <= count:
            raise DataError(f"shard {self.name}: rows {a}:{b} outside column {name!r} of {count}")
        return np.frombuffer(self._read(off + a * dt.itemsize, (b - a) * dt.itemsize), dt)

    def strings(self, name: str, a: int, b: int) -> tuple[np.ndarray, bytes]:
        """Rows ``a:b`` of string column ``name``: int64 offsets (``b - a + 1``, from 0)
        into the returned utf-8 bytes."""
        off = self.array(f"{name}.off", a, b + 1).astype(np.int64)
        _, data_at, nbytes = self._cols[f"{name}.utf8"]
        if off.size and (off[0] < 0 or off[-1] > nbytes or np.any(np.diff(off) < 0)):
            raise DataError(f"shard {self.name}: string column {name!r} offsets out of bounds")
        data = self._read(data_at + int(off[0]), int(off[-1] - off[0])) if off.size else b""
        return off - (off[0] if off.size else 0), data

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> IndexScan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
