"""Fixed-width group keys: strings (molecule ids, scaffolds, formulas) as xxh3-64 hashes.

Split's tasks return a group key per record as a ``uint64`` hash of its string, so the
driver joins, counts and intersects groups with ``np.unique``/``np.searchsorted`` on
numeric arrays instead of Python sets of strings. A string column of a shard index is
hashed without a Python step per record: rows are padded into one byte matrix (with
their length appended), made unique with ``np.unique`` (on one uint64 per row, checked
exactly against the bytes), and only the distinct strings are hashed.

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
_MIX = np.uint64(0x9E3779B97F4A7C15)


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
    width = -(-(w + 4) // 8) * 8  # whole uint64 words
    rows = np.zeros((n, width), np.uint8)
    rows[:, w: w + 4] = lens.astype("<u4").view(np.uint8).reshape(n, 4)  # "ab" and "ab\0" differ
    rows[:, :w][np.arange(w) < lens[:, None]] = np.frombuffer(data, np.uint8, int(off[-1]))
    first, inv = _unique_rows(rows)
    starts, ends = off[first].tolist(), off[first + 1].tolist()
    hu = np.fromiter((_h(data[a:b]) for a, b in zip(starts, ends, strict=True)), np.uint64, len(first))
    return hu[inv]


def _unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First row of each distinct row of a uint8 matrix (width a multiple of 8) and each
    row's distinct number: on one uint64 per row (the row itself when it is one word, else
    a mix of its words, checked exactly afterwards), sorting bytes only if the mix collides."""
    words = rows.view("<u8")
    mixed = words[:, 0].copy()
    for j in range(1, words.shape[1]):
        mixed = (mixed ^ (mixed >> np.uint64(29))) * _MIX + words[:, j]
    _, first, inv = np.unique(mixed, return_index=True, return_inverse=True)
    inv = inv.ravel()
    if words.shape[1] > 1 and not np.array_equal(rows[first[inv]], rows):  # a collision of the mix
        _, first, inv = np.unique(rows.view(f"S{rows.shape[1]}").ravel(), return_index=True, return_inverse=True)
        inv = inv.ravel()
    return first, inv


def hash_list(strings: list[str]) -> np.ndarray:
    """xxh3-64 of each string (utf-8), as uint64 (the same value :func:`hash_strings` gives)."""
    return np.fromiter((_h(s.encode()) for s in strings), np.uint64, len(strings))


#: A record without a molecule id is its own molecule, ``record:<key>`` (one spelling for the
#: per-record, per-row-set and index-column forms below: split's groups and its leakage
#: check must hash the same string).
RECORD_PREFIX = "record:"


def molecule_key(molecule_id: str, key: str) -> str:
    """The molecule a record belongs to: its ``molecule_id``, or itself when it has none."""
    return molecule_id or RECORD_PREFIX + key


def distinct_molecules(molecule_ids: list[str], keys: list[str], rows: list[int]) -> np.ndarray:
    """The distinct hashed :func:`molecule_key` of records ``rows`` (``molecule_ids`` and
    ``keys``: a shard's columns; for a schema without molecule ids pass the keys as
    ``molecule_ids``), sorted. A Python set over the rows, then one hash per distinct
    molecule: cheaper than hashing every row when a shard holds few molecules."""
    mols = {molecule_ids[i] or RECORD_PREFIX + keys[i] for i in rows}
    return np.unique(hash_list(list(mols)))


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
        prefix = RECORD_PREFIX.encode()
        h[empty] = [_h(prefix + kdata[ko[i]: ko[i + 1]]) for i in empty.tolist()]
    return h


def in_two(sets: list[np.ndarray]) -> int:
    """How many values occur in two or more of ``sets`` (each an array of unique values)."""
    if not sets:
        return 0
    _, counts = np.unique(np.concatenate(sets), return_counts=True)
    return int((counts > 1).sum())
