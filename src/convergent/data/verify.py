"""``data verify``: check every shard checksum, header/index/trailer and record frame.

The report names each bad shard and, where it can be located, the record and byte
offset of the damage. Shard files present but not in the manifest (leftovers of an
interrupted write) are listed as orphans, and temporary files of writes that never
finished (``.<name>.<random>.tmp``) as stray temp files; neither is an error.
:func:`clean_leftovers` removes both once they are older than ``min_age_s`` (a live
writer touches its files constantly, so only abandoned ones qualify).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from convergent.core.errors import DataError
from convergent.data import format as fmt
from convergent.data.index import strings
from convergent.data.manifest import ShardInfo, read_manifest
from convergent.data.reader import ShardReader


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_dataset`."""

    path: str
    shards: int = 0
    records: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)  # '.<name>.<random>.tmp' leftovers

    @property
    def ok(self) -> bool:
        return not self.problems


def _file_xxh3(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def verify_shard(root: Path, info: ShardInfo, deep: bool = True) -> list[str]:
    """Problems found in one shard (empty list if it is sound)."""
    problems: list[str] = []
    path = root / info.name
    if not path.is_file():
        return [f"shard {info.name}: file missing"]
    size = path.stat().st_size
    if size != info.bytes:
        problems.append(f"shard {info.name}: size {size} bytes, manifest says {info.bytes} "
                        f"({'truncated' if size < info.bytes else 'extended'})")
    digest = _file_xxh3(path)
    if digest != info.xxh3_64:
        problems.append(f"shard {info.name}: xxh3 {digest} != manifest {info.xxh3_64}")
    rd = ShardReader(root, info)
    try:
        meta = rd.meta
    except DataError as exc:
        return [exc.message] + problems
    if deep:
        keys = strings(meta.index, "key")
        for i in range(meta.count):
            try:
                rec = rd.record(i)
            except DataError as exc:
                problems.append(exc.message)
                break
            if rec["key"] != keys[i]:
                problems.append(f"shard {info.name} record {i}: key {rec['key']!r} != index key {keys[i]!r}")
                break
        rd.release()
    if len(problems) == 1 and problems[0].startswith(f"shard {info.name}: xxh3"):
        problems[0] += " (damage not located by the frame checks)"
    # the located problem (record / offset) first, whole-file checks after
    return sorted(problems, key=lambda p: ": xxh3 " in p or ": size " in p)


def verify_dataset(path: str | os.PathLike[str], deep: bool = True,
                   on_shard: Callable[[str], None] | None = None) -> VerifyReport:
    """Check a dataset: manifest, every shard's xxh3, layout, and (``deep``) every record.

    Also checks that keys are unique across shards. ``on_shard(name)`` is called after
    each shard (for progress).
    """
    root = Path(path)
    manifest = read_manifest(root)
    rep = VerifyReport(str(root))
    listed = {s.name for s in manifest.shards}
    rep.orphans = sorted(p.name for p in root.glob(f"shard-*{fmt.SHARD_SUFFIX}") if p.name not in listed)
    rep.temp_files = stray_temp_files(root)
    seen: dict[str, str] = {}
    for info in manifest.shards:
        probs = verify_shard(root, info, deep=deep)
        rep.problems.extend(probs)
        rep.shards += 1
        rep.records += info.records
        rep.bytes += info.bytes
        if not probs:
            for key in strings(ShardReader(root, info).meta.index, "key"):
                if key in seen:
                    rep.problems.append(f"duplicate key {key!r} in shards {seen[key]} and {info.name}")
                    break
                seen[key] = info.name
        if on_shard is not None:
            on_shard(info.name)
    return rep


def stray_temp_files(root: str | os.PathLike[str]) -> list[str]:
    """Names of temporary files left in a dataset directory by writes that did not finish
    (shards and manifest are written as ``.<name>.<random>.tmp`` and renamed)."""
    return sorted(p.name for p in Path(root).glob(".*.tmp") if p.is_file())


def clean_leftovers(path: str | os.PathLike[str], min_age_s: float = 3600.0) -> tuple[list[str], list[str]]:
    """Delete stray temp files and orphan shards not modified for ``min_age_s`` seconds.

    Returns ``(removed, kept_recent)`` file names. Files the manifest lists are never
    touched; recent leftovers are kept because a writer may still be working on them.
    """
    root = Path(path)
    listed = {s.name for s in read_manifest(root).shards}
    candidates = [root / n for n in stray_temp_files(root)]
    candidates += [p for p in root.glob(f"shard-*{fmt.SHARD_SUFFIX}") if p.name not in listed]
    removed, recent = [], []
    now = time.time()
    for p in sorted(candidates):
        try:
            if now - p.stat().st_mtime < min_age_s:
                recent.append(p.name)
                continue
            p.unlink()
            removed.append(p.name)
        except FileNotFoundError:
            continue
    return removed, recent
