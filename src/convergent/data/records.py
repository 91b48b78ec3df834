"""Record encoding: molecular and bytes records to frame bodies and back, and the index
columns each schema puts in a shard (see :mod:`convergent.data` for the record fields and
:mod:`convergent.data.format` for the frames around the bodies).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson
import xxhash

from convergent.core.errors import DataError
from convergent.core.fsutil import dumps_json
from convergent.data.format import FRAME_SEED_SALT, FRAME_SIZE

_xxh3 = xxhash.xxh3_64_intdigest

# molecular frame body: fixed part then key, molecule id, numbers (u8), positions, forces,
# cell (f64), meta JSON.
_MOL = struct.Struct("<IdiiBBHHI")  # n_atoms, energy, charge, mult, pbc bits, flags, klen, mlen, meta_len
_MOL_HAS_FORCES = 1
_BYTES = struct.Struct("<HI")  # key length, payload length


def _as_array(rec: dict[str, Any], name: str, dtype: Any, shape: tuple[int, ...], key: str) -> np.ndarray:
    try:
        arr = np.asarray(rec[name], dtype=dtype)
    except KeyError:
        raise DataError(f"record {key!r}: missing field {name!r}") from None
    except (TypeError, ValueError) as exc:
        raise DataError(f"record {key!r}: field {name!r} is not {np.dtype(dtype).name}: {exc}") from None
    if arr.shape != shape:
        raise DataError(f"record {key!r}: field {name!r} has shape {arr.shape}, expected {shape}")
    return arr


def record_key(rec: dict[str, Any]) -> str:
    """The record's ``key`` (a non-empty string of at most 65535 UTF-8 bytes)."""
    if not isinstance(rec, dict):
        raise DataError(f"a record must be a dict, got {type(rec).__name__}")
    key = rec.get("key")
    if not isinstance(key, str) or not key or len(key.encode()) > 65535:
        raise DataError(f"record key {key!r}: must be a non-empty string of at most 65535 bytes")
    return key


@dataclass
class Encoded:
    """One encoded record: frame body plus the small fields that go into the index."""

    key: str
    body: bytes  # uncompressed frame body
    molecule_id: str = ""
    n_atoms: int = 0
    energy: float = float("nan")
    charge: int = 0
    multiplicity: int = 1
    size: int = 0  # payload size (bytes schema)
    payload: bytes | None = None  # set for bytes records small enough to inline


def encode_molecular(rec: dict[str, Any]) -> Encoded:
    """Validate and encode a molecular record (see :mod:`convergent.data` for the fields)."""
    key = record_key(rec)
    numbers = _as_array(rec, "numbers", np.int64, np.shape(rec.get("numbers", [])), key)
    if numbers.ndim != 1:
        raise DataError(f"record {key!r}: 'numbers' must be 1-D, got shape {numbers.shape}")
    n = int(numbers.shape[0])
    if n and (numbers.min() < 0 or numbers.max() > 255):
        raise DataError(f"record {key!r}: atomic numbers must be in 0..255")
    pos = _as_array(rec, "positions", np.float64, (n, 3), key)
    forces_in = rec.get("forces")
    flags = 0
    if forces_in is not None:
        forces = _as_array(rec, "forces", np.float64, (n, 3), key)
        flags |= _MOL_HAS_FORCES
    else:
        forces = None
    cell = rec.get("cell")
    cell_arr = np.zeros((3, 3)) if cell is None else _as_array(rec, "cell", np.float64, (3, 3), key)
    pbc = rec.get("pbc")
    pbc_arr = np.zeros(3, bool) if pbc is None else _as_array(rec, "pbc", bool, (3,), key)
    pbc_bits = int(pbc_arr[0]) | int(pbc_arr[1]) << 1 | int(pbc_arr[2]) << 2
    try:
        energy = float(rec["energy"]) if rec.get("energy") is not None else float("nan")
        charge = int(rec.get("charge", 0) or 0)
        mult = int(rec.get("multiplicity", 1) or 1)
    except (TypeError, ValueError) as exc:
        raise DataError(f"record {key!r}: bad scalar field: {exc}") from None
    mol_id = str(rec.get("molecule_id", "") or "")
    try:
        meta = dumps_json(rec.get("meta") or {}, separators=(",", ":"), sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise DataError(f"record {key!r}: 'meta' is not JSON-serialisable: {exc}") from None
    kb, mb = key.encode(), mol_id.encode()
    if len(mb) > 65535:
        raise DataError(f"record {key!r}: molecule_id longer than 65535 bytes")
    head = _MOL.pack(n, energy, charge, mult, pbc_bits, flags, len(kb), len(mb), len(meta))
    parts = [head, kb, mb, numbers.astype(np.uint8).tobytes(), pos.tobytes()]
    if forces is not None:
        parts.append(forces.tobytes())
    parts += [cell_arr.tobytes(), meta]
    return Encoded(key, b"".join(parts), mol_id, n, energy, charge, mult)


class _MolLayout(NamedTuple):
    """A molecular frame body's header fields and where each part of it starts."""

    n: int
    energy: float
    charge: int
    mult: int
    pbc_bits: int
    key: int
    mol: int
    numbers: int
    positions: int
    forces: int | None  # None: the record has no forces
    cell: int
    meta: int
    end: int


def _layout(body: bytes | memoryview) -> _MolLayout:
    """Parse the header of a frame body written by :func:`encode_molecular` (one place that
    knows the part order: key, molecule id, numbers, positions, [forces], cell, meta)."""
    n, energy, charge, mult, pbc_bits, flags, kl, ml, metal = _MOL.unpack_from(body, 0)
    key = _MOL.size
    numbers = key + kl + ml
    positions = numbers + n
    forces = positions + 24 * n if flags & _MOL_HAS_FORCES else None
    cell = (forces if forces is not None else positions) + 24 * n
    meta = cell + 72
    if meta + metal != len(body):
        raise ValueError("molecular frame body has trailing bytes")
    return _MolLayout(n, energy, charge, mult, pbc_bits, key, key + kl, numbers, positions, forces,
                      cell, meta, meta + metal)


def decode_molecular(body: bytes | memoryview) -> dict[str, Any]:
    """Inverse of :func:`encode_molecular`; arrays are fresh, writable copies."""
    L = _layout(body)
    n = L.n
    key = bytes(body[L.key: L.mol]).decode()
    mol_id = bytes(body[L.mol: L.numbers]).decode()
    numbers = np.frombuffer(body, np.uint8, n, L.numbers).astype(np.int64)
    pos = np.frombuffer(body, np.float64, 3 * n, L.positions).reshape(n, 3).copy()
    if L.forces is not None:
        forces = np.frombuffer(body, np.float64, 3 * n, L.forces).reshape(n, 3).copy()
    else:
        forces = np.full((n, 3), np.nan)
    cell = np.frombuffer(body, np.float64, 9, L.cell).reshape(3, 3).copy()
    meta = json.loads(bytes(body[L.meta: L.end])) if L.end > L.meta else {}
    energy, charge, mult, pbc_bits = L.energy, L.charge, L.mult, L.pbc_bits
    return {
        "key": key,
        "molecule_id": mol_id,
        "numbers": numbers,
        "positions": pos,
        "energy": energy,
        "forces": forces,
        "cell": cell,
        "pbc": np.array([bool(pbc_bits & 1), bool(pbc_bits & 2), bool(pbc_bits & 4)]),
        "charge": charge,
        "multiplicity": mult,
        "meta": meta,
    }


@dataclass
class MolecularFields:
    """What a scan over labels reads of a molecular record (see :func:`molecular_fields`)."""

    numbers: np.ndarray  # uint8[n], a read-only view
    energy: float
    forces: np.ndarray | None  # float64[n, 3], a read-only view; None without forces
    meta: dict[str, Any]


def _loads(raw: bytes | memoryview) -> Any:
    """JSON with orjson (several times faster than the stdlib on meta dicts), falling back to
    the stdlib for what orjson refuses but ``json.dumps`` writes (NaN, Infinity)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(bytes(raw))


def molecular_fields(body: bytes | memoryview) -> MolecularFields:
    """Atomic numbers, energy, forces and meta of a molecular frame body, without copying
    the arrays nor decoding positions, cell, key and molecule id (the per-record cost of
    :func:`decode_molecular` that label statistics do not need)."""
    L = _layout(body)
    forces = None if L.forces is None else np.frombuffer(body, np.float64, 3 * L.n, L.forces).reshape(L.n, 3)
    return MolecularFields(np.frombuffer(body, np.uint8, L.n, L.numbers), L.energy, forces,
                           _loads(body[L.meta: L.end]) if L.end > L.meta else {})


def encode_bytes(rec: dict[str, Any], inline_bytes: int) -> Encoded:
    """Validate and encode a generic ``{key, payload}`` record; small payloads are inlined."""
    key = record_key(rec)
    payload = rec.get("payload")
    if isinstance(payload, (bytearray, memoryview)):
        payload = bytes(payload)
    if not isinstance(payload, bytes):
        raise DataError(f"record {key!r}: 'payload' must be bytes, got {type(payload).__name__}")
    if len(payload) >= 2**32:
        raise DataError(f"record {key!r}: payload larger than 4 GiB")
    if len(payload) <= inline_bytes:
        return Encoded(key, b"", size=len(payload), payload=payload)
    kb = key.encode()
    return Encoded(key, _BYTES.pack(len(kb), len(payload)) + kb + payload, size=len(payload))


def decode_bytes(body: bytes | memoryview) -> dict[str, Any]:
    """Inverse of :func:`encode_bytes` for a record stored in a frame."""
    kl, pl = _BYTES.unpack_from(body, 0)
    o = _BYTES.size
    key = bytes(body[o : o + kl]).decode()
    payload = bytes(body[o + kl : o + kl + pl])
    if o + kl + pl != len(body):
        raise ValueError("bytes frame body has trailing bytes")
    return {"key": key, "payload": payload}


# frame header (FRAME) followed by the bytes-record header (_BYTES), as one numpy record
_PLAIN_HEAD = np.dtype([("stored", "<u4"), ("raw", "<u4"), ("codec", "u1"), ("pad1", "u1"),
                        ("pad2", "<u2"), ("digest", "<u8"), ("klen", "<u2"), ("plen", "<u4")])
_PLAIN_SEED = np.uint64(FRAME_SEED_SALT)  # codec 0: frame_seed(l, l, 0) == (l << 32 | l) ^ salt


def decode_plain_bytes_frames(view: memoryview, offsets: np.ndarray, local: list[int]) -> list[dict[str, Any] | None]:
    """Records ``local`` of a bytes shard whose frames are stored uncompressed, in one pass.

    The fast path of ``ShardReader.records`` (:mod:`convergent.data.reader`): the same
    checks as :func:`~convergent.data.format.unpack_frame` and :func:`decode_bytes` (xxh3 with the
    header fields as seed, zero padding, lengths that match the offset table), the header
    checks vectorised over the batch, then one xxh3 and two slices per record. ``offsets`` is the shard's offset table (int64, one more
    than records). An entry is ``None`` where the record is inlined, compressed or fails
    a check: the caller decodes that one with the general path, which raises the precise
    error.
    """
    idx = np.asarray(local, np.int64)
    a, b = offsets[idx], offsets[idx + 1]
    hs = _PLAIN_HEAD.itemsize
    raw = np.frombuffer(view, np.uint8)
    # gather the headers (clipped at the end of the shard; short frames fail below)
    heads = raw[np.minimum(a[:, None] + np.arange(hs), len(raw) - 1)]
    h = heads.view(_PLAIN_HEAD).reshape(-1)
    sl = b - a - FRAME_SIZE
    o = a + hs + h["klen"]
    ok = ((sl >= _BYTES.size) & (h["stored"] == sl) & (h["raw"] == sl) & (h["codec"] == 0)
          & (h["pad1"] == 0) & (h["pad2"] == 0) & (o + h["plen"] == b))
    seeds = ((sl.astype(np.uint64) << np.uint64(32)) | sl.astype(np.uint64)) ^ _PLAIN_SEED
    xxh, frame = _xxh3, FRAME_SIZE
    out: list[dict[str, Any] | None] = []
    for good, ai, bi, oi, seed, digest in zip(ok.tolist(), a.tolist(), b.tolist(), o.tolist(),
                                               seeds.tolist(), h["digest"].tolist(), strict=True):
        if not good or xxh(view[ai + frame : bi], seed) != digest:
            out.append(None)
            continue
        try:
            key = str(view[ai + hs : oi], "utf-8")
        except UnicodeDecodeError:
            out.append(None)
            continue
        out.append({"key": key, "payload": view[oi:bi].tobytes()})
    return out
