"""The index of a shard being written, built without holding it in memory.

:class:`IndexBuilder` accumulates the index columns compactly (packed bytes and typed
arrays, no per-record objects, no frame bodies). Past ``spill_bytes`` of columns it
appends them to one temporary spill file beside the shard (``.<name>.<random>.idx.tmp``,
removed when the shard is sealed or aborted), so a writer's memory does not grow with the
records of its shard: a worker that writes one large shard holds a few MiB of index, not
~90 bytes per record. :meth:`IndexBuilder.stream` yields the packed index (the layout of
:func:`convergent.data.index.pack_index`) in pieces for the writer to append and checksum.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from convergent.data.index import index_head

__all__ = ["IndexBuilder"]

SPILL_BYTES = 4 * 2**20  # columns held in memory before they go to the spill file
_READ = 2**20  # bytes per piece when a spilled column is streamed back


class _Column:
    """One index column: an in-memory tail (``array`` or ``bytearray``) and the chunks
    already spilled, as ``(file offset, bytes)``."""

    def __init__(self, name: str, dtype: str, typecode: str | None) -> None:
        self.name, self.dtype, self.typecode = name, np.dtype(dtype), typecode
        self.buf: array | bytearray = bytearray() if typecode is None else array(typecode)
        self.chunks: list[tuple[int, int]] = []
        self.spilled = 0

    def _mem(self) -> bytes | bytearray:
        return self.buf if self.typecode is None else self.buf.tobytes()

    @property
    def nbytes(self) -> int:
        return self.spilled + len(self.buf) * (1 if self.typecode is None else self.buf.itemsize)

    def spill(self, fh) -> None:
        data = self._mem()
        if data:
            fh.seek(0, os.SEEK_END)
            self.chunks.append((fh.tell(), len(data)))
            fh.write(data)
            self.spilled += len(data)
        self.buf = bytearray() if self.typecode is None else array(self.typecode)

    def pieces(self, fh) -> Iterator[bytes]:
        for off, n in self.chunks:
            fh.seek(off)
            while n:
                piece = fh.read(min(n, _READ))
                if not piece:
                    raise OSError(f"{fh.name}: spill file truncated")
                n -= len(piece)
                yield piece
        if self.buf:
            yield bytes(self._mem())


def _columns(schema: str) -> list[_Column]:
    """The columns of ``schema``'s index, in the order they are written."""
    cols = [("offsets", "<u8", "Q"), ("key.off", "<u8", "Q"), ("key.utf8", "|u1", None)]
    if schema == "molecular":
        cols += [("molecule_id.off", "<u8", "Q"), ("molecule_id.utf8", "|u1", None),
                 ("n_atoms", "<i4", "i"), ("energy", "<f8", "d"), ("charge", "<i4", "i"),
                 ("multiplicity", "<i4", "i")]
    else:
        cols += [("size", "<u8", "Q"), ("inline.off", "<u8", "Q"), ("inline.data", "|u1", None),
                 ("inlined", "|u1", "B")]
    return [_Column(*c) for c in cols]


class IndexBuilder:
    """The index columns of a shard being written.

    ``spill_dir``/``name``: where the spill file may go (``None``: never spill, all in
    memory); ``spill_bytes``: columns held in memory before spilling (default
    :data:`SPILL_BYTES`).
    """

    def __init__(self, schema: str, spill_dir: str | Path | None = None, name: str = "shard",
                 spill_bytes: int | None = None) -> None:
        self.schema = schema
        self.n = 0
        self.inline_bytes = 0
        self.spill_dir, self.name = spill_dir, name
        self.spill_bytes = SPILL_BYTES if spill_bytes is None else spill_bytes
        self.spill_path: str | None = None
        self._fh = None
        self._held = 0  # approximate bytes in memory since the last spill
        self.cols = {c.name: c for c in _columns(schema)}
        self._len = {"key": 0, "molecule_id": 0, "inline": 0}  # bytes of each string column
        for name_ in ("key.off", "molecule_id.off", "inline.off"):
            if name_ in self.cols:
                self.cols[name_].buf.append(0)

    def _string(self, col: str, data: bytes) -> None:
        self.cols[f"{col}.utf8" if col != "inline" else "inline.data"].buf.extend(data)
        self._len[col] += len(data)
        self.cols[f"{col}.off"].buf.append(self._len[col])

    def add(self, e, offset: int) -> None:
        """Record ``e``'s index fields (an :class:`~convergent.data.records.Encoded`); its
        frame starts at byte ``offset`` of the shard."""
        c = self.cols
        c["offsets"].buf.append(offset)
        key = e.key.encode()
        self._string("key", key)
        held = 24 + len(key)
        if self.schema == "molecular":
            mid = e.molecule_id.encode()
            self._string("molecule_id", mid)
            c["n_atoms"].buf.append(e.n_atoms)
            c["energy"].buf.append(e.energy)
            c["charge"].buf.append(e.charge)
            c["multiplicity"].buf.append(e.multiplicity)
            held += 28 + len(mid)
        else:
            payload = e.payload or b""
            c["size"].buf.append(e.size)
            c["inlined"].buf.append(e.payload is not None)
            self._string("inline", payload)
            self.inline_bytes += len(payload)
            held += 17 + len(payload)
        self.n += 1
        self._held += held
        if self.spill_dir is not None and self._held > self.spill_bytes:
            self._spill()

    def _spill(self) -> None:
        if self._fh is None:
            fd, self.spill_path = tempfile.mkstemp(prefix=f".{self.name}.", suffix=".idx.tmp",
                                                   dir=self.spill_dir)
            self._fh = os.fdopen(fd, "w+b")
        for col in self.cols.values():
            col.spill(self._fh)
        self._held = 0

    def _finish(self, end_offset: int) -> None:
        """Close the offsets column with ``end_offset`` (where the index starts)."""
        offsets = self.cols["offsets"]
        if offsets.nbytes // 8 == self.n:
            offsets.buf.append(end_offset)
        if self._fh is not None:
            self._fh.flush()

    def stream(self, end_offset: int) -> Iterator[bytes]:
        """The packed index (:func:`convergent.data.index.pack_index`'s layout) in pieces;
        ``end_offset``: where the index starts (after the last frame)."""
        self._finish(end_offset)
        cols = list(self.cols.values())
        yield index_head([(c.name, c.dtype.str, c.nbytes // c.dtype.itemsize, c.nbytes)
                          for c in cols])
        for c in cols:
            yield from c.pieces(self._fh)
            if pad := (-c.nbytes) % 8:
                yield b"\0" * pad

    def columns(self, end_offset: int) -> dict[str, np.ndarray]:
        """The index as arrays (reads spilled columns back: for small shards and tests)."""
        self._finish(end_offset)
        return {c.name: np.frombuffer(b"".join(c.pieces(self._fh)), c.dtype)
                for c in self.cols.values()}

    def close(self) -> None:
        """Remove the spill file (after the shard is sealed or aborted)."""
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None
        if self.spill_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.spill_path)
            self.spill_path = None
