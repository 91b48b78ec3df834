"""The dataset manifest (``manifest.json``): schema, shards, record counts, xxh3 checksums.

The manifest is the commit point of a dataset: shards are written and renamed first, the
manifest last (atomically), so a half-written dataset is never readable as complete.
Shard files not listed in the manifest are leftovers of an interrupted write and are
ignored by readers.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from convergent.core.errors import DataError, parse_error_text
from convergent.core.fsutil import atomic_write_text, dumps_json
from convergent.data.format import (
    FORMAT_VERSION,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    SCHEMAS,
)


@dataclass
class ShardInfo:
    """One shard as listed in the manifest."""

    name: str  # file name inside the dataset directory
    records: int  # number of records
    bytes: int  # file size, bytes
    xxh3_64: str  # hex digest of the whole file


@dataclass
class Manifest:
    """What a committed dataset contains."""

    schema: str
    compression: str
    shards: list[ShardInfo] = field(default_factory=list)
    format: str = MANIFEST_FORMAT
    format_version: int = FORMAT_VERSION
    schema_version: int = SCHEMA_VERSION
    created: float = field(default_factory=time.time)  # unix seconds
    updated: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def records(self) -> int:
        """Total number of records."""
        return sum(s.records for s in self.shards)

    @property
    def bytes(self) -> int:
        """Total size of the shards, bytes."""
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> str:
        d = asdict(self)
        d["records"] = self.records
        d["bytes"] = self.bytes
        return dumps_json(d, indent=1) + "\n"


def manifest_path(path: str | Path) -> Path:
    """``<dataset>/manifest.json``."""
    return Path(path) / MANIFEST_NAME


def write_manifest(path: str | Path, manifest: Manifest) -> None:
    """Write the manifest atomically (temp file, fsync, rename)."""
    manifest.updated = time.time()
    atomic_write_text(manifest_path(path), manifest.to_json())


def read_manifest(path: str | Path) -> Manifest:
    """Read and validate ``<path>/manifest.json``; DataError naming the problem."""
    p = manifest_path(path)
    if not Path(path).exists():
        raise DataError(f"dataset not found: {path}", hint="check the path or create the dataset first")
    if not p.is_file():
        raise DataError(
            f"{path}: no {MANIFEST_NAME} (not a dataset, or a write that never committed)",
            hint="write the dataset with DatasetWriter or 'convergent data pack'",
        )
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(parse_error_text(p, "JSON", exc), hint="restore manifest.json from a good copy") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{p}: unreadable manifest: {exc}") from None
    if not isinstance(d, dict) or d.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{p}: not a convergent dataset manifest")
    if d.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{p}: unknown dataset format version {d.get('format_version')!r} "
            f"(this code reads {FORMAT_VERSION})",
            hint="upgrade convergent or re-pack the dataset",
        )
    if d.get("schema") not in SCHEMAS:
        raise DataError(f"{p}: unknown record schema {d.get('schema')!r}")
    if d.get("schema_version") != SCHEMA_VERSION:
        raise DataError(
            f"{p}: unknown schema version {d.get('schema_version')!r} for schema {d['schema']!r} "
            f"(this code reads {SCHEMA_VERSION})",
            hint="upgrade convergent or re-pack the dataset",
        )
    try:
        shards = [ShardInfo(**s) for s in d["shards"]]
        m = Manifest(
            schema=d["schema"], compression=d["compression"], shards=shards,
            created=float(d.get("created", 0.0)), updated=float(d.get("updated", 0.0)),
            extra=dict(d.get("extra") or {}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{p}: malformed manifest: {exc}") from None
    if "records" in d and d["records"] != m.records:
        raise DataError(f"{p}: manifest total {d['records']} != sum of shard counts {m.records}")
    names = [s.name for s in shards]
    if len(set(names)) != len(names):
        raise DataError(f"{p}: a shard is listed twice")
    return m


def check_dataset(path: str | Path, field: str) -> None:
    """Raise DataError ``<field>: <problem>`` unless ``path`` holds a readable manifest
    (checked before a stage creates anything)."""
    try:
        read_manifest(path)
    except DataError as exc:
        raise DataError(f"{field}: {exc.message}", hint=exc.hint) from None
