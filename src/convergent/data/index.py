"""The columnar index of a shard: named numpy arrays behind a JSON column table.

``pack_index`` writes u32 JSON length | JSON table | 8-byte aligned arrays; ``unpack_index``
returns read-only views. Strings and byte strings are two columns each (``<name>.off``
offsets and the concatenated ``<name>.utf8`` / ``<name>.data``). Which columns a shard
carries is decided by its record schema (:class:`convergent.data.indexbuild.IndexBuilder`).
"""

from __future__ import annotations

import json
import struct

import numpy as np

from convergent.core.errors import DataError
from convergent.core.fsutil import dumps_json


def index_head(columns: list[tuple[str, str, int, int]]) -> bytes:
    """The index's head for ``(name, dtype str, count, nbytes)`` columns: u32 JSON length
    and the JSON table, padded to 8 bytes; each column's data follows, padded to 8."""
    table, pos = [], 0
    for name, dtype, count, nbytes in columns:
        table.append({"name": name, "dtype": dtype, "shape": [count], "offset": pos,
                      "nbytes": nbytes})
        pos += nbytes + (-nbytes) % 8
    head = dumps_json(table, separators=(",", ":")).encode()
    head += b" " * ((-(4 + len(head))) % 8)
    return struct.pack("<I", len(head)) + head


def pack_index(columns: dict[str, np.ndarray]) -> bytes:
    """Serialise named 1-D numpy arrays: :func:`index_head`, then 8-byte aligned data
    (the writer streams the same layout from :class:`convergent.data.indexbuild.IndexBuilder`)."""
    arrays = {name: np.ascontiguousarray(arr).reshape(-1) for name, arr in columns.items()}
    blobs = [a.tobytes() + b"\0" * ((-a.nbytes) % 8) for a in arrays.values()]
    head = index_head([(n, a.dtype.str, a.size, a.nbytes) for n, a in arrays.items()])
    return head + b"".join(blobs)


def column_table(read, index_len: int, where: str) -> dict[str, tuple[np.dtype, int, list[int]]]:
    """The column table of an index of ``index_len`` bytes, read through ``read(offset,
    n)`` (offsets from the index start): name -> (dtype, data offset from the index
    start, shape), each column checked to lie inside the index."""
    try:
        (hl,) = struct.unpack("<I", read(0, 4))
        if 4 + hl > index_len:
            raise ValueError("column table past the index end")
        base = 4 + hl
        out = {}
        for col in json.loads(bytes(read(4, hl))):
            dt = np.dtype(col["dtype"])
            count = int(np.prod(col["shape"])) if col["shape"] else 1
            if base + col["offset"] + col["nbytes"] > index_len or count * dt.itemsize != col["nbytes"]:
                raise ValueError(f"column {col['name']!r} out of bounds")
            out[col["name"]] = (dt, base + col["offset"], list(col["shape"]))
        return out
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise DataError(f"{where}: malformed shard index: {exc}") from None


def unpack_index(buf: bytes | memoryview, where: str) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_index` (arrays are read-only views of ``buf``)."""
    table = column_table(lambda o, n: buf[o: o + n], len(buf), where)
    return {name: np.frombuffer(buf, dt, int(np.prod(shape)) if shape else 1, off).reshape(shape)
            for name, (dt, off, shape) in table.items()}


def strings(cols: dict[str, np.ndarray], name: str) -> list[str]:
    """Decode a string column of an index into a list of str."""
    off = cols[f"{name}.off"]
    raw = cols[f"{name}.utf8"].tobytes()
    o = off.tolist()
    return [raw[o[i] : o[i + 1]].decode() for i in range(len(o) - 1)]
