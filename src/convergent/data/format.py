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

This module holds the container: constants, frames, header and trailer. Record bodies are
encoded by :mod:`convergent.data.records`, the index columns serialised by
:mod:`convergent.data.index`.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from convergent.core.errors import DataError
from convergent.data.index import unpack_index

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
FRAME_SEED_SALT = 0x9E3779B97F4A7C15  # xored into every frame's xxh3 seed (see frame_seed)
TRAILER_SIZE = TRAILER.size


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



# --------------------------------------------------------------------------- frames


def pack_frame(body: bytes, codec: int, level: int = 3, compressor: Any = None) -> bytes:
    """Frame ``body``; with codec zstd it is compressed when that makes it smaller."""
    stored, used = body, 0
    if codec == 1 and len(body) > 64:
        comp = compressor.compress(body) if compressor is not None else _zstd_c(level).compress(body)
        if len(comp) < len(body):
            stored, used = comp, 1
    digest = xxhash.xxh3_64_intdigest(stored, frame_seed(len(stored), len(body), used))
    return FRAME.pack(len(stored), len(body), used, 0, 0, digest) + stored


def frame_seed(stored_len: int, raw_len: int, codec: int) -> int:
    """Seed of a frame's xxh3: binds the header fields to the checksum."""
    return (raw_len << 32 | stored_len) ^ (codec << 61) ^ FRAME_SEED_SALT


def check_frame(buf: bytes | memoryview, where: str, record: int | None = None,
                offset: int | None = None) -> tuple[int, int, int]:
    """Check a frame's length, padding and xxh3; return ``(stored_len, raw_len, codec)``.

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
            or _xxh3(view[FRAME_SIZE:], frame_seed(stored_len, raw_len, codec)) != digest):
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
    return stored_len, raw_len, codec


def unpack_frame(buf: bytes | memoryview, where: str, decompressor: Any = None,
                 record: int | None = None, offset: int | None = None) -> bytes | memoryview:
    """Check a frame (:func:`check_frame`) and return its (decompressed) body."""
    stored_len, raw_len, codec = check_frame(buf, where, record, offset)
    stored = memoryview(buf)[FRAME_SIZE:]
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


# --------------------------------------------------------------------------- header/trailer


def pack_header(schema: int, codec: int) -> bytes:
    """The 16-byte shard header."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, schema, codec, 0)


def pack_trailer(header: bytes, index: bytes, index_offset: int, count: int) -> bytes:
    """The 40-byte trailer, whose CRC covers header, index and the trailer fields."""
    return trailer_from_crc(crc32(header, index), len(index), index_offset, count)


def trailer_from_crc(crc: int, index_len: int, index_offset: int, count: int) -> bytes:
    """:func:`pack_trailer` for an index that was streamed: ``crc`` is the running CRC-32
    of header + index (``zlib.crc32`` continued piece by piece)."""
    fields = struct.pack("<QQQ", index_offset, index_len, count)
    crc = zlib.crc32(fields, crc) & 0xFFFFFFFF
    return fields + struct.pack("<II8s", crc, FORMAT_VERSION, END_MAGIC)


@dataclass
class ShardMeta:
    """Parsed and checked header + trailer + index of one shard."""

    schema: int
    codec: int
    count: int
    index_offset: int
    index: dict[str, np.ndarray]


@dataclass
class ShardEnds:
    """Checked header and trailer of one shard (the index not yet read)."""

    schema: int
    codec: int
    count: int
    index_offset: int
    index_len: int
    header: bytes
    trailer: bytes
    crc: int  # the trailer's CRC-32 of header + index + trailer fields


def parse_shard_ends(read_at: Any, size: int, name: str) -> ShardEnds:
    """Read and check a shard's header and trailer (layout, versions, schema, codec).

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
    return ShardEnds(schema, codec, count, index_offset, index_len, header, trailer, crc)


def check_ends(ends: ShardEnds, index_crc: int, name: str) -> None:
    """Check the trailer CRC (``index_crc``: running ``zlib.crc32`` of header + index) and
    the schema and codec ids."""
    if zlib.crc32(ends.trailer[:24], index_crc) & 0xFFFFFFFF != ends.crc:
        raise DataError(f"shard {name}: header/index checksum mismatch (index at offset {ends.index_offset})",
                        hint="run 'convergent data verify' on the dataset")
    if ends.schema not in SCHEMA_NAMES:
        raise DataError(f"shard {name} at offset 10: unknown schema id {ends.schema}")
    if ends.codec not in CODEC_NAMES:
        raise DataError(f"shard {name} at offset 11: unknown codec id {ends.codec}")


def parse_shard_meta(read_at: Any, size: int, name: str) -> ShardMeta:
    """Read and check a shard's header, trailer and index.

    ``read_at(offset, length) -> bytes`` reads from the shard file of ``size`` bytes;
    ``name`` is used in error messages. Raises DataError naming the shard and offset.
    """
    ends = parse_shard_ends(read_at, size, name)
    index_offset, count = ends.index_offset, ends.count
    index = read_at(index_offset, ends.index_len)
    check_ends(ends, zlib.crc32(index, zlib.crc32(ends.header)), name)
    cols = unpack_index(index, f"shard {name} at offset {index_offset}")
    offs = cols.get("offsets")
    if offs is None or len(offs) != count + 1:
        raise DataError(f"shard {name}: index offset table has wrong length")
    if count and (offs[0] != HEADER_SIZE or offs[-1] != index_offset or np.any(np.diff(offs.astype(np.int64)) < 0)):
        raise DataError(f"shard {name}: index offset table is inconsistent with the layout")
    return ShardMeta(ends.schema, ends.codec, count, index_offset, cols)
