"""Shard layout: header, checksummed record frames, columnar index, trailer.

A shard file (``shard-<tag>-<seq>.cvs``) is laid out as::

    header   16 bytes  magic b"CVGSHRD1" | u16 format version | u8 schema id | u8 codec
                       | u32 reserved (0)
    frames   one per stored record, back to back (records inlined in the index have none)
             u32 stored length | u32 raw length | u8 codec | 3 bytes 0 | u64 xxh3-64
             | stored bytes (zstd-compressed when codec == 1)
             The xxh3-64 of the stored bytes is seeded with the length and codec fields, so
             a change of any header field or stored byte changes it; the lengths are also
             checked against the offset table and the padding must be zero. (xxh3 instead
             of CRC-32 here: 10x faster on 4 KiB records; a miss has probability 2^-64.)
    index    columnar index: u32 JSON length | JSON column table | 8-byte aligned arrays.
             Always holds ``offsets`` (u64[n+1], frame start of record i, end = last) and
             ``key``; molecular shards add ``molecule_id``, ``n_atoms``, ``energy``,
             ``charge``, ``multiplicity``; bytes shards add ``size`` and the inlined small
             payloads (``inline``, a bytes column, empty for records stored in frames).
    trailer  40 bytes  u64 index offset | u64 index length | u64 record count
                       | u32 CRC-32 of header + index + the 24 trailer bytes before it
                       | u32 format version | magic b"CVGSEND1"

All integers are little-endian. Every byte of a shard is covered by a check: header,
index and trailer by the trailer CRC-32, each frame by its own xxh3-64. The dataset manifest additionally
records the xxh3-64 of each whole shard file (checked by ``data verify`` and on cache copy).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from convergent.errors import DataError

_xxh3 = xxhash.xxh3_64_intdigest

MAGIC = b"CVGSHRD1"
END_MAGIC = b"CVGSEND1"
FORMAT_VERSION = 1
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "convergent-dataset"
SHARD_SUFFIX = ".cvs"

SCHEMAS = {"molecular": 1, "bytes": 2}
SCHEMA_NAMES = {v: k for k, v in SCHEMAS.items()}
CODECS = {"none": 0, "zstd": 1}
CODEC_NAMES = {v: k for k, v in CODECS.items()}

HEADER = struct.Struct("<8sHBBI")  # 16 bytes
FRAME = struct.Struct("<IIBBHQ")  # 20 bytes: stored len, raw len, codec, pad u8, pad u16, xxh3
TRAILER = struct.Struct("<QQQII8s")  # 40 bytes
HEADER_SIZE = HEADER.size
FRAME_SIZE = FRAME.size
TRAILER_SIZE = TRAILER.size

# molecular frame body: fixed part then key, molecule id, numbers (u8), positions, forces,
# cell (f64), meta JSON.
_MOL = struct.Struct("<IdiiBBHHI")  # n_atoms, energy, charge, mult, pbc bits, flags, klen, mlen, meta_len
_MOL_HAS_FORCES = 1
_BYTES = struct.Struct("<HI")  # key length, payload length


def crc32(*parts: bytes | memoryview) -> int:
    """CRC-32 over the concatenation of ``parts``."""
    c = 0
    for p in parts:
        c = zlib.crc32(p, c)
    return c & 0xFFFFFFFF


def schema_id(name: str) -> int:
    """Numeric id of a record schema name; DataError for an unknown one."""
    try:
        return SCHEMAS[name]
    except KeyError:
        raise DataError(
            f"unknown record schema {name!r}", hint=f"use one of: {', '.join(SCHEMAS)}"
        ) from None


def codec_id(name: str) -> int:
    """Numeric id of a compression codec name; DataError for an unknown one."""
    try:
        return CODECS[name]
    except KeyError:
        raise DataError(
            f"unknown compression {name!r}", hint=f"use one of: {', '.join(CODECS)}"
        ) from None


# --------------------------------------------------------------------------- records


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
        meta = json.dumps(rec.get("meta") or {}, separators=(",", ":"), sort_keys=True).encode()
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


def decode_molecular(body: bytes | memoryview) -> dict[str, Any]:
    """Inverse of :func:`encode_molecular`; arrays are fresh, writable copies."""
    n, energy, charge, mult, pbc_bits, flags, kl, ml, metal = _MOL.unpack_from(body, 0)
    o = _MOL.size
    key = bytes(body[o : o + kl]).decode()
    o += kl
    mol_id = bytes(body[o : o + ml]).decode()
    o += ml
    numbers = np.frombuffer(body, np.uint8, n, o).astype(np.int64)
    o += n
    pos = np.frombuffer(body, np.float64, 3 * n, o).reshape(n, 3).copy()
    o += 24 * n
    if flags & _MOL_HAS_FORCES:
        forces = np.frombuffer(body, np.float64, 3 * n, o).reshape(n, 3).copy()
        o += 24 * n
    else:
        forces = np.full((n, 3), np.nan)
    cell = np.frombuffer(body, np.float64, 9, o).reshape(3, 3).copy()
    o += 72
    meta = json.loads(bytes(body[o : o + metal])) if metal else {}
    if o + metal != len(body):
        raise ValueError("molecular frame body has trailing bytes")
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
_PLAIN_SEED = np.uint64(0x9E3779B97F4A7C15)


def decode_plain_bytes_frames(view: memoryview, offsets: np.ndarray, local: list[int]) -> list[dict[str, Any] | None]:
    """Records ``local`` of a bytes shard whose frames are stored uncompressed, in one pass.

    The fast path of the streaming reader: the same checks as :func:`unpack_frame` and
    :func:`decode_bytes` (xxh3 with the header fields as seed, zero padding, lengths that
    match the offset table), the header checks vectorised over the batch, then one xxh3
    and two slices per record. ``offsets`` is the shard's offset table (int64, one more
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


# --------------------------------------------------------------------------- frames


def pack_frame(body: bytes, codec: int, level: int = 3, compressor: Any = None) -> bytes:
    """Frame ``body``; with codec zstd it is compressed when that makes it smaller."""
    stored, used = body, 0
    if codec == 1 and len(body) > 64:
        comp = compressor.compress(body) if compressor is not None else _zstd_c(level).compress(body)
        if len(comp) < len(body):
            stored, used = comp, 1
    digest = xxhash.xxh3_64_intdigest(stored, _frame_seed(len(stored), len(body), used))
    return FRAME.pack(len(stored), len(body), used, 0, 0, digest) + stored


def _frame_seed(stored_len: int, raw_len: int, codec: int) -> int:
    """Seed of a frame's xxh3: binds the header fields to the checksum."""
    return (raw_len << 32 | stored_len) ^ (codec << 61) ^ 0x9E3779B97F4A7C15


def unpack_frame(buf: bytes | memoryview, where: str, decompressor: Any = None,
                 record: int | None = None, offset: int | None = None) -> bytes | memoryview:
    """Check a frame's CRC and length and return its (decompressed) body.

    ``buf`` is exactly the frame as delimited by the offset table. ``where`` names the
    shard (with ``record`` and ``offset`` given, "shard <where> record <i> at offset <o>"
    is used in error messages; else ``where`` is used as is).
    """
    if len(buf) >= FRAME_SIZE:
        stored_len, raw_len, codec, pad1, pad2, digest = FRAME.unpack_from(buf, 0)
    else:
        stored_len, raw_len, codec, pad1, pad2, digest = -1, 0, 0, 0, 0, 0
    view = memoryview(buf)
    if (stored_len != len(buf) - FRAME_SIZE or pad1 or pad2
            or _xxh3(view[FRAME_SIZE:], _frame_seed(stored_len, raw_len, codec)) != digest):
        if record is not None:
            where = f"shard {where} record {record} at offset {offset}"
        if stored_len == -1:
            raise DataError(f"{where}: frame of {len(buf)} bytes is shorter than its header")
        if stored_len != len(buf) - FRAME_SIZE:
            raise DataError(f"{where}: frame length {stored_len} disagrees with the offset table")
        if pad1 or pad2:
            raise DataError(f"{where}: frame header padding is not zero (corrupted record)")
        raise DataError(f"{where}: frame checksum mismatch (corrupted record)",
                        hint="run 'convergent data verify' on the dataset")
    stored = view[FRAME_SIZE:]
    if codec == 0 and raw_len == stored_len:
        return stored
    if record is not None:
        where = f"shard {where} record {record} at offset {offset}"
    if codec == 0:
        raise DataError(f"{where}: frame raw length {raw_len} != stored length {stored_len}")
    if codec != 1:
        raise DataError(f"{where}: unknown frame codec {codec}")
    d = decompressor if decompressor is not None else _zstd_d()
    try:
        body = d.decompress(stored, max_output_size=raw_len)
    except Exception as exc:  # zstd raises ZstdError
        raise DataError(f"{where}: zstd frame does not decompress: {exc}") from None
    if len(body) != raw_len:
        raise DataError(f"{where}: frame decompressed to {len(body)} bytes, expected {raw_len}")
    return body


def _zstd_c(level: int) -> Any:
    import zstandard

    return zstandard.ZstdCompressor(level=level)


def _zstd_d() -> Any:
    import zstandard

    return zstandard.ZstdDecompressor()


# --------------------------------------------------------------------------- index


def _string_column(values: list[str]) -> tuple[np.ndarray, np.ndarray]:
    enc = [v.encode() for v in values]
    off = np.zeros(len(enc) + 1, np.uint64)
    np.cumsum([len(b) for b in enc], out=off[1:]) if enc else None
    return off, np.frombuffer(b"".join(enc), np.uint8)


def _bytes_column(values: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    off = np.zeros(len(values) + 1, np.uint64)
    if values:
        np.cumsum([len(b) for b in values], out=off[1:])
    return off, np.frombuffer(b"".join(values), np.uint8)


def pack_index(columns: dict[str, np.ndarray]) -> bytes:
    """Serialise named numpy arrays: u32 JSON length, JSON table, 8-byte aligned data."""
    table, blobs, pos = [], [], 0
    for name, arr in columns.items():
        arr = np.ascontiguousarray(arr)
        data = arr.tobytes()
        table.append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape),
                      "offset": pos, "nbytes": len(data)})
        pad = (-len(data)) % 8
        blobs.append(data + b"\0" * pad)
        pos += len(data) + pad
    head = json.dumps(table, separators=(",", ":")).encode()
    head += b" " * ((-(4 + len(head))) % 8)
    return struct.pack("<I", len(head)) + head + b"".join(blobs)


def unpack_index(buf: bytes | memoryview, where: str) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_index` (arrays are read-only views of ``buf``)."""
    try:
        (hl,) = struct.unpack_from("<I", buf, 0)
        table = json.loads(bytes(buf[4 : 4 + hl]))
        base = 4 + hl
        out = {}
        for col in table:
            dt = np.dtype(col["dtype"])
            count = int(np.prod(col["shape"])) if col["shape"] else 1
            if col["offset"] + col["nbytes"] + base > len(buf) or count * dt.itemsize != col["nbytes"]:
                raise ValueError(f"column {col['name']!r} out of bounds")
            arr = np.frombuffer(buf, dt, count, base + col["offset"]).reshape(col["shape"])
            out[col["name"]] = arr
        return out
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise DataError(f"{where}: malformed shard index: {exc}") from None


def build_index(schema: str, encoded: list[Encoded], offsets: list[int]) -> dict[str, np.ndarray]:
    """The columnar index of a shard from its encoded records and frame offsets."""
    cols: dict[str, np.ndarray] = {"offsets": np.asarray(offsets, np.uint64)}
    cols["key.off"], cols["key.utf8"] = _string_column([e.key for e in encoded])
    if schema == "molecular":
        cols["molecule_id.off"], cols["molecule_id.utf8"] = _string_column(
            [e.molecule_id for e in encoded]
        )
        cols["n_atoms"] = np.asarray([e.n_atoms for e in encoded], np.int32)
        cols["energy"] = np.asarray([e.energy for e in encoded], np.float64)
        cols["charge"] = np.asarray([e.charge for e in encoded], np.int32)
        cols["multiplicity"] = np.asarray([e.multiplicity for e in encoded], np.int32)
    else:
        cols["size"] = np.asarray([e.size for e in encoded], np.uint64)
        cols["inline.off"], cols["inline.data"] = _bytes_column(
            [e.payload if e.payload is not None else b"" for e in encoded]
        )
        cols["inlined"] = np.asarray([e.payload is not None for e in encoded], np.uint8)
    return cols


def strings(cols: dict[str, np.ndarray], name: str) -> list[str]:
    """Decode a string column of an index into a list of str."""
    off = cols[f"{name}.off"]
    raw = cols[f"{name}.utf8"].tobytes()
    o = off.tolist()
    return [raw[o[i] : o[i + 1]].decode() for i in range(len(o) - 1)]


# --------------------------------------------------------------------------- header/trailer


def pack_header(schema: int, codec: int) -> bytes:
    """The 16-byte shard header."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, schema, codec, 0)


def pack_trailer(header: bytes, index: bytes, index_offset: int, count: int) -> bytes:
    """The 40-byte trailer, whose CRC covers header, index and the trailer fields."""
    fields = struct.pack("<QQQ", index_offset, len(index), count)
    crc = crc32(header, index, fields)
    return fields + struct.pack("<II8s", crc, FORMAT_VERSION, END_MAGIC)


@dataclass
class ShardMeta:
    """Parsed and checked header + trailer + index of one shard."""

    schema: int
    codec: int
    count: int
    index_offset: int
    index: dict[str, np.ndarray]


def parse_shard_meta(read_at: Any, size: int, name: str) -> ShardMeta:
    """Read and check a shard's header, trailer and index.

    ``read_at(offset, length) -> bytes`` reads from the shard file of ``size`` bytes;
    ``name`` is used in error messages. Raises DataError naming the shard and offset.
    """
    if size < HEADER_SIZE + TRAILER_SIZE:
        raise DataError(f"shard {name}: truncated ({size} bytes, smaller than header + trailer)")
    header = read_at(0, HEADER_SIZE)
    magic, version, schema, codec, _ = HEADER.unpack(header)
    if magic != MAGIC:
        raise DataError(f"shard {name} at offset 0: bad magic {magic!r}, not a convergent shard")
    trailer = read_at(size - TRAILER_SIZE, TRAILER_SIZE)
    index_offset, index_len, count, crc, tversion, end = TRAILER.unpack(trailer)
    if end != END_MAGIC:
        raise DataError(
            f"shard {name} at offset {size - TRAILER_SIZE}: bad end marker (truncated or corrupted)",
            hint="the shard was cut short; re-create it or restore it from a good copy",
        )
    if version != tversion:
        raise DataError(f"shard {name}: header version {version} != trailer version {tversion}")
    if version != FORMAT_VERSION:
        raise DataError(
            f"shard {name}: unknown shard format version {version} (this code reads {FORMAT_VERSION})",
            hint="upgrade convergent or re-pack the dataset",
        )
    if index_offset < HEADER_SIZE or index_offset + index_len + TRAILER_SIZE != size:
        raise DataError(
            f"shard {name} at offset {size - TRAILER_SIZE}: trailer layout does not match the "
            f"file size {size} (truncated or corrupted)"
        )
    index = read_at(index_offset, index_len)
    if crc32(header, index, trailer[:24]) != crc:
        raise DataError(f"shard {name}: header/index checksum mismatch (index at offset {index_offset})",
                        hint="run 'convergent data verify' on the dataset")
    if schema not in SCHEMA_NAMES:
        raise DataError(f"shard {name} at offset 10: unknown schema id {schema}")
    if codec not in CODEC_NAMES:
        raise DataError(f"shard {name} at offset 11: unknown codec id {codec}")
    cols = unpack_index(index, f"shard {name} at offset {index_offset}")
    offs = cols.get("offsets")
    if offs is None or len(offs) != count + 1:
        raise DataError(f"shard {name}: index offset table has wrong length")
    if count and (offs[0] != HEADER_SIZE or offs[-1] != index_offset or np.any(np.diff(offs.astype(np.int64)) < 0)):
        raise DataError(f"shard {name}: index offset table is inconsistent with the layout")
    return ShardMeta(schema, codec, count, index_offset, cols)
