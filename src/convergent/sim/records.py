"""Records of a campaign: built from a labelled frame, then encoded and framed on the worker.

A worker hands the driver :class:`PackedRecord` objects: the record already encoded in the
dataset's shard format (:mod:`convergent.data.records`, :mod:`convergent.data.format`) and
compressed, plus the few fields of the shard index. The driver only checks the key and appends the bytes
(:meth:`~convergent.data.writer.DatasetWriter.write_encoded`), so encoding and compression
run in parallel on the workers instead of competing with them for the driver's core.
Units: positions Å, energy eV, forces eV/Å.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from convergent.core.errors import DataError
from convergent.data import format as fmt
from convergent.data.records import Encoded, encode_molecular
from convergent.sim.quarantine import quarantine_entry


def make_record(key: str, molecule_id: str, numbers, positions, charge, multiplicity,
                energy, forces, meta: dict[str, Any]) -> dict[str, Any]:
    """A molecular record dict (the schema of :mod:`convergent.data`), non-periodic."""
    return {
        "key": key,
        "molecule_id": molecule_id,
        "numbers": np.asarray(numbers, dtype=np.int64),
        "positions": np.asarray(positions, dtype=np.float64),
        "energy": float(energy),
        "forces": np.asarray(forces, dtype=np.float64),
        "cell": np.zeros((3, 3)),
        "pbc": np.zeros(3, dtype=bool),
        "charge": int(charge),
        "multiplicity": int(multiplicity),
        "meta": meta,
    }


@dataclass(slots=True)
class PackedRecord:
    """A record ready for the shard: its index fields (``index.body`` empty) and its frame."""

    index: Encoded
    frame: bytes  # format.pack_frame of the encoded body, with the dataset's codec

    @property
    def key(self) -> str:
        return self.index.key


_local = threading.local()  # a zstd compressor is not safe to share between threads


def _compressor(codec: int, level: int):
    if codec != 1:
        return None
    cache = _local.__dict__.setdefault("zstd", {})
    if level not in cache:
        import zstandard

        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def pack_record(record: dict[str, Any], compression: str = "zstd",
                zstd_level: int = 3) -> PackedRecord:
    """Encode and frame one molecular record (DataError if the store would refuse it)."""
    codec = fmt.codec_id(compression)
    enc = encode_molecular(record)
    frame = fmt.pack_frame(enc.body, codec, compressor=_compressor(codec, zstd_level))
    enc.body = b""
    return PackedRecord(enc, frame)


def pack_records(records: list[dict[str, Any]], compression: str = "zstd",
                 zstd_level: int = 3) -> tuple[list[PackedRecord], list[dict[str, Any]]]:
    """Pack every record; a record the dataset would refuse becomes a quarantine entry."""
    packed, refused = [], []
    for rec in records:
        try:
            packed.append(pack_record(rec, compression, zstd_level))
        except DataError as exc:
            refused.append(quarantine_entry(rec["key"], rec.get("molecule_id", ""),
                                            f"record refused by the dataset: {exc}"))
    return packed, refused
