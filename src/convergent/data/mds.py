"""Write mosaicml-streaming's MDS format (version 2) without the ``streaming`` package.

mosaicml-streaming 0.13.0 pins numpy<2.2, xxhash<4, transformers<5 and a CUDA
torchvision, so it cannot live in this environment; its on-disk format is small and
documented, so ``data export --to mds`` writes it directly. Layout written here:

* ``shard.NNNNN.mds``: u32 sample count n | u32 offsets[n + 1] (absolute file positions of
  the samples, the last one is the file size) | the column config as sorted-key JSON |
  the samples. A sample is a u32 byte size for each variable-size column (in column
  order) followed by every column's encoded bytes, in column order (columns sorted by
  name).
* ``index.json``: ``{"version": 2, "shards": [...]}``, one entry per shard with its
  sample count, ``raw_data`` (basename, bytes, hashes) and the column config.

Encodings used: ``str`` (UTF-8), ``bytes``, ``int`` (int64), ``float64``, ``json``
(UTF-8 JSON) and ``ndarray:<dtype>`` (dynamic shape: one byte ``ndim << 2 | k`` where
the shape is stored as ``uint8/16/32/64`` for ``k = 0..3``, then the shape, then the
values). All little-endian. Each shard carries its xxh3-64 (hex) under the ``xxh3_64``
hash, which streaming checks when asked to validate hashes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from convergent.core.errors import DataError
from convergent.core.fsutil import atomic_write_text, dumps_json

BYTES_COLUMNS = {"key": "str", "payload": "bytes"}
MOLECULAR_COLUMNS = {
    "key": "str", "molecule_id": "str", "numbers": "ndarray:int64", "positions": "ndarray:float64",
    "forces": "ndarray:float64", "cell": "ndarray:float64", "pbc": "json", "energy": "float64",
    "charge": "int", "multiplicity": "int", "meta": "json",
}
_FIXED = {"int": 8, "float64": 8}  # encodings of a fixed size (no size field in the sample)
_SHAPE_DTYPES = ("<u1", "<u2", "<u4", "<u8")


def _ndarray(value: Any, dtype: str, name: str) -> bytes:
    arr = np.ascontiguousarray(value, dtype=dtype)
    if arr.size == 0 or arr.ndim == 0 or arr.ndim >= 64:
        raise DataError(f"MDS export of {name}: cannot store an array of shape {arr.shape}",
                        hint="MDS ndarrays need 1..63 axes and at least one element")
    top = max(arr.shape)
    k = 0 if top < 2**8 else 1 if top < 2**16 else 2 if top < 2**32 else 3
    shape = np.asarray(arr.shape, _SHAPE_DTYPES[k]).tobytes()
    return bytes([arr.ndim << 2 | k]) + shape + arr.astype(arr.dtype.newbyteorder("<")).tobytes()


def encode_value(encoding: str, value: Any, name: str) -> bytes:
    """Bytes of one column value in MDS ``encoding`` (``name`` describes it in errors)."""
    if encoding == "str":
        return str(value).encode()
    if encoding == "bytes":
        return bytes(value)
    if encoding == "int":
        return struct.pack("<q", int(value))
    if encoding == "float64":
        return struct.pack("<d", float(value))
    if encoding == "json":
        return dumps_json(value.tolist() if isinstance(value, np.ndarray) else value).encode()
    if encoding.startswith("ndarray:"):
        return _ndarray(value, encoding.split(":", 1)[1], name)
    raise DataError(f"MDS export of {name}: encoding {encoding!r} is not supported")


class MDSShardWriter:
    """Writes samples into MDS shards of at most ``size_limit`` bytes, then ``index.json``.

    Shards are written to a temporary name and renamed; ``index.json`` comes last, so an
    interrupted export has no index.
    """

    def __init__(self, out: str | os.PathLike[str], columns: dict[str, str],
                 size_limit: int = 128 * 2**20) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.names = sorted(columns)
        self.encodings = [columns[n] for n in self.names]
        self.sizes = [_FIXED.get(e) for e in self.encodings]
        self.size_limit = int(size_limit)
        self.config = {"column_encodings": self.encodings, "column_names": self.names,
                       "column_sizes": self.sizes, "compression": None, "format": "mds",
                       "hashes": ["xxh3_64"], "size_limit": self.size_limit, "version": 2}
        self._config_bytes = json.dumps(self.config, sort_keys=True).encode()
        self.shards: list[dict[str, Any]] = []
        self._samples: list[bytes] = []
        self._bytes = 0

    def encode(self, sample: dict[str, Any]) -> bytes:
        heads, parts = [], []
        for name, enc, size in zip(self.names, self.encodings, self.sizes, strict=True):
            data = encode_value(enc, sample[name], f"record {sample.get('key')!r} column {name!r}")
            if size is None:
                heads.append(len(data))
            parts.append(data)
        return struct.pack(f"<{len(heads)}I", *heads) + b"".join(parts)

    def write(self, sample: dict[str, Any]) -> None:
        data = self.encode(sample)
        overhead = 8 + len(self._config_bytes) + 4 * (len(self._samples) + 1)
        if self._samples and overhead + self._bytes + len(data) + 4 > self.size_limit:
            self.flush()
        self._samples.append(data)
        self._bytes += len(data)

    def flush(self) -> None:
        """Write the buffered samples as one shard."""
        n = len(self._samples)
        if n == 0:
            return
        start = 4 + 4 * (n + 1) + len(self._config_bytes)
        offsets = np.zeros(n + 1, np.uint64)
        np.cumsum([len(s) for s in self._samples], out=offsets[1:])
        offsets += start
        if offsets[-1] >= 2**32:
            raise DataError(f"MDS shard of {int(offsets[-1])} bytes exceeds 4 GiB",
                            hint="use a smaller shard size")
        blob = b"".join([struct.pack("<I", n), offsets.astype("<u4").tobytes(), self._config_bytes,
                         *self._samples])
        name = f"shard.{len(self.shards):05d}.mds"
        tmp = self.out / f".{name}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.out / name)
        raw = {"basename": name, "bytes": len(blob), "hashes": {"xxh3_64": xxhash.xxh3_64_hexdigest(blob)}}
        self.shards.append(dict(self.config, samples=n, raw_data=raw, zip_data=None))
        self._samples, self._bytes = [], 0

    def finish(self) -> int:
        """Flush the last shard and write ``index.json``; returns the sample count."""
        self.flush()
        atomic_write_text(self.out / "index.json",
                          dumps_json({"shards": self.shards, "version": 2}, sort_keys=True))
        return sum(s["samples"] for s in self.shards)


def write_mds(records: Iterable[dict[str, Any]], out: str | os.PathLike[str], schema: str,
              size_limit: int = 128 * 2**20) -> int:
    """Write records of ``schema`` (``bytes`` or ``molecular``) as MDS; returns the count."""
    columns = BYTES_COLUMNS if schema == "bytes" else MOLECULAR_COLUMNS
    w = MDSShardWriter(out, columns, size_limit)
    for rec in records:
        w.write(rec)
    return w.finish()
