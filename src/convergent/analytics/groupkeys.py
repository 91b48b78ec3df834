"""Fixed-width group keys: strings (molecule ids, scaffolds, formulas) as xxh3-64 hashes.

Split's tasks return a group key per record as a ``uint64`` hash of its string, so the
driver joins, counts and intersects groups with ``np.unique``/``np.searchsorted`` on
numeric arrays instead of Python sets of strings. A string column of a shard index is
hashed without a Python step per record: rows are padded into one byte matrix (with
their length appended), made unique with ``np.unique``, and only the distinct strings
are hashed.

Why 64 bits is enough: equal strings always get equal hashes, so a collision can only
*join* two different keys. Two groups joined go to the same split (never a leak; the
sizes change by one group), and two molecules joined can only make the leakage check
report a leak that is not there, never hide one. With ``n`` distinct keys the chance of
any collision is about ``n**2 / 2**65``: 3e-8 for a million keys, 3e-4 for 10**8.
"""

from __future__ import annotations

import numpy as np
import xxhash

from convergent.data.indexscan import IndexScan

_h = xxhash.xxh3_64_intdigest
_PAD_MAX = 16 * 2**20  # bytes of padded matrix per call; past it strings are hashed one by one
ROWS = 65536  # index rows read per piece


def hash_strings(off: np.ndarray, data: bytes) -> np.ndarray:
    """xxh3-64 of each string of a string column piece (``off``: n + 1 offsets into
    ``data``, utf-8, from 0), as uint64[n]."""
    n = len(off) - 1
    if n <= 0:
        return np.zeros(0, np.uint64)
    lens = np.diff(off)
    w = int(lens.max())
    if n * (w + 4) > _PAD_MAX:
        o = off.tolist()
        return np.fromiter((_h(data[o[i]: o[i + 1]]) for i in range(n)), np.uint64, n)
    rows = np.zeros((n, w + 4), np.uint8)
    rows[:, w:] = lens.astype("<u4").view(np.uint8).reshape(n, 4)  # "ab" and "ab\0" differ
    rows[:, :w][np.arange(w) < lens[:, None]] = np.frombuffer(data, np.uint8, int(off[-1]))
    _, first, inv = np.unique(rows.view(f"S{w + 4}").ravel(), return_index=True, return_inverse=True)
    o = off.tolist()
    hu = np.fromiter((_h(data[o[i]: o[i + 1]]) for i in first.tolist()), np.uint64, len(first))
    return hu[inv.ravel()]


def hash_list(strings: list[str]) -> np.ndarray:
    """xxh3-64 of each string (utf-8), as uint64 (the same value :func:`hash_strings` gives)."""
    return np.fromiter((_h(s.encode()) for s in strings), np.uint64, len(strings))


def molecule_key(molecule_id: str, key: str) -> str:
    """The molecule a record belongs to: its ``molecule_id``, or itself when it has none."""
    return molecule_id or f"record:{key}"


def molecule_keys(scan: IndexScan, a: int, b: int) -> np.ndarray:
    """Hashed :func:`molecule_key` of rows ``a:b`` of a shard (the ``key`` for a shard
    whose schema has no molecule ids)."""
    if scan.schema != "molecular":
        return hash_strings(*scan.strings("key", a, b))
    off, data = scan.strings("molecule_id", a, b)
    h = hash_strings(off, data)
    empty = np.flatnonzero(off[1:] == off[:-1])
    if empty.size:
        koff, kdata = scan.strings("key", a, b)
        ko = koff.tolist()
        h[empty] = [_h(b"record:" + kdata[ko[i]: ko[i + 1]]) for i in empty.tolist()]
    return h


def in_two(sets: list[np.ndarray]) -> int:
    """How many values occur in two or more of ``sets`` (each an array of unique values)."""
    if not sets:
        return 0
    _, counts = np.unique(np.concatenate(sets), return_counts=True)
    return int((counts > 1).sum())
