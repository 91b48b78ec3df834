"""Node-local cache tier: shards of a "remote" dataset copied into a local directory.

The remote path is the parallel file system; the cache directory is node-local (NVMe,
/tmp). :class:`ShardCache` copies a shard atomically (temp file, fsync, rename) and checks
its xxh3-64 against the manifest while copying, so a corrupted remote or a torn copy is
never served. A byte budget is kept by evicting copies: first those the reader will not
need again, then the one whose next use (from the known shuffle order, see
:meth:`ShardCache.plan`) is furthest away; without a plan, the least recently used.
The cache only ever deletes its own copies of shards whose source still exists with the
same size: it never deletes the only copy of a dataset, and a dataset that lives inside
the cache directory is read in place and never managed.

Several processes on a node (DataLoader workers, ranks) share one cache directory; the
eviction decision is taken under an ``fcntl`` lock, copies go to unique temp names.
:class:`Prefetcher` copies the next shards in a background thread ahead of the reader.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import xxhash

from convergent.core.errors import DataError
from convergent.core.fsutil import file_mode, fsync_dir
from convergent.data.format import SHARD_SUFFIX

if TYPE_CHECKING:
    from convergent.data.manifest import Manifest, ShardInfo

MARKER = ".convergent-cache"
COPY_CHUNK = 8 * 2**20  # bytes per read while copying


class ShardSource(Protocol):
    """What the cache needs of a dataset (a :class:`~convergent.data.reader.Dataset`):
    its directory and its manifest's shard list."""

    path: Path
    manifest: Manifest


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


class ShardCache:
    """A byte-budgeted node-local copy of shards.

    Args:
        directory: node-local cache directory (created; marked with ``.convergent-cache``).
        budget_bytes: maximum bytes of shard copies kept (default 10 GiB). A shard larger
            than the budget is read from its source directly.
    """

    def __init__(self, directory: str | os.PathLike[str], budget_bytes: int = 10 * 2**30) -> None:
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        if self.budget_bytes <= 0:
            raise DataError(f"cache budget {budget_bytes} bytes must be positive")
        self.directory.mkdir(parents=True, exist_ok=True)
        marker = self.directory / MARKER
        if not marker.exists():
            marker.write_text("convergent node-local shard cache; safe to delete when idle\n")
        self._next_use: dict[tuple[str, str], int] = {}
        self._plock = threading.Lock()
        self._copy_locks: dict[str, threading.Lock] = {}
        self.stats = {"hits": 0, "misses": 0, "bypass": 0, "evicted": 0, "copied_bytes": 0}

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_plock"] = None
        d["_copy_locks"] = {}
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._plock = threading.Lock()

    # ------------------------------------------------------------------ layout
    def _sub(self, src_dir: Path) -> Path:
        ident = xxhash.xxh3_64_hexdigest(str(src_dir.resolve()).encode())[:16]
        return self.directory / ident

    def local_path(self, info: ShardInfo, src_dir: str | os.PathLike[str]) -> Path:
        """Where the copy of a shard lives (it may not be there)."""
        return self._sub(Path(src_dir)) / info.name

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # ------------------------------------------------------------------ plan
    def plan(self, src_dir: str | os.PathLike[str], names_in_order: Sequence[str]) -> None:
        """Tell the cache the order in which this process will next use shards of a dataset.

        Position 0 is the shard in use now. Replaces the previous plan for that dataset.
        """
        sub = str(self._sub(Path(src_dir)))
        nu: dict[tuple[str, str], int] = {}
        for i, name in enumerate(names_in_order):
            nu.setdefault((sub, name), i)
        with self._plock:
            self._next_use = {k: v for k, v in self._next_use.items() if k[0] != sub}
            self._next_use.update(nu)

    # ------------------------------------------------------------------ core
    def get(self, info: ShardInfo, src_dir: str | os.PathLike[str]) -> Path:
        """Local path of a verified copy of the shard, copying it in if needed."""
        src_dir = Path(src_dir)
        src = src_dir / info.name
        if _is_within(src_dir, self.directory):
            return src  # the dataset lives in the cache dir: read in place, never manage
        local = self.local_path(info, src_dir)
        with contextlib.suppress(FileNotFoundError):
            if local.stat().st_size == info.bytes:
                os.utime(local)  # LRU clock shared by all processes
                self.stats["hits"] += 1
                return local
        with self._copy_lock(local):  # one copy per shard in this process (prefetch vs read)
            return self._get_miss(info, src_dir, src, local)

    @contextlib.contextmanager
    def _copy_lock(self, local: Path) -> Iterator[None]:
        with self._plock:
            lock = self._copy_locks.setdefault(str(local), threading.Lock())
        with lock:
            yield

    def _get_miss(self, info: ShardInfo, src_dir: Path, src: Path, local: Path) -> Path:
        with contextlib.suppress(FileNotFoundError):
            if local.stat().st_size == info.bytes:
                self.stats["hits"] += 1
                return local
        self.stats["misses"] += 1
        if info.bytes > self.budget_bytes:
            self.stats["bypass"] += 1
            return src
        local.parent.mkdir(parents=True, exist_ok=True)
        note = local.parent / ".source"
        if not note.exists():
            # where the copies came from: eviction checks the source still exists
            from convergent.core.fsutil import atomic_write_text

            atomic_write_text(note, str(src_dir.resolve()) + "\n")
        with self._lock():
            if not self._make_room(info.bytes, keep=local):
                self.stats["bypass"] += 1
                return src
        self._copy(src, local, info)
        return local

    def _copy(self, src: Path, local: Path, info: ShardInfo) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{local.name}.", suffix=".tmp", dir=local.parent)
        os.fchmod(fd, file_mode())  # as readable as the source shard's group allows
        try:
            h = xxhash.xxh3_64()
            n = 0
            with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout:
                while chunk := fin.read(COPY_CHUNK):
                    h.update(chunk)
                    fout.write(chunk)
                    n += len(chunk)
                fout.flush()
                os.fsync(fout.fileno())
            if n != info.bytes or h.hexdigest() != info.xxh3_64:
                raise DataError(
                    f"shard {info.name}: checksum mismatch on copy to the cache "
                    f"({n} bytes, xxh3 {h.hexdigest()}; manifest: {info.bytes} bytes, xxh3 {info.xxh3_64})",
                    hint=f"the source {src} is corrupted; run 'convergent data verify'",
                )
            os.replace(tmp, local)
            fsync_dir(local.parent)
            self.stats["copied_bytes"] += n
        except FileNotFoundError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise DataError(f"shard {info.name}: source missing ({src})") from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def entries(self) -> list[tuple[Path, int, float]]:
        """(path, bytes, last use) of every shard copy in the cache (temp files included)."""
        out = []
        for sub in self.directory.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.name.endswith(SHARD_SUFFIX) or f.name.endswith(".tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        st = f.stat()
                        out.append((f, st.st_size, st.st_mtime))
        return out

    def used_bytes(self) -> int:
        """Bytes of shard copies currently in the cache."""
        return sum(b for _, b, _ in self.entries())

    def _source_of(self, local: Path) -> Path | None:
        src_file = local.parent / ".source"
        try:
            return Path(src_file.read_text().strip()) / local.name
        except OSError:
            return None

    def _evictable(self, local: Path, size: int) -> bool:
        """A copy may go only if its source still exists with the same size."""
        src = self._source_of(local)
        if src is None:
            return False
        try:
            return src.stat().st_size == size and not os.path.samefile(src, local)
        except OSError:
            return False

    def _make_room(self, need: int, keep: Path) -> bool:
        """Evict copies until ``need`` more bytes fit; False if that is impossible."""
        entries = [e for e in self.entries() if not e[0].name.endswith(".tmp")]
        used = sum(b for _, b, _ in self.entries())
        if used + need <= self.budget_bytes:
            return True
        with self._plock:
            next_use = dict(self._next_use)
        big = 1 << 62

        def rank(e: tuple[Path, int, float]) -> tuple[int, float]:
            nu = next_use.get((str(e[0].parent), e[0].name))
            # never needed again first (oldest first), then furthest next use
            return (big if nu is None else nu, -e[2])

        for path, size, _ in sorted(entries, key=rank, reverse=True):
            if used + need <= self.budget_bytes:
                break
            if path == keep or next_use.get((str(path.parent), path.name)) == 0:
                continue  # the shard in use now
            if not self._evictable(path, size):
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                used -= size
                self.stats["evicted"] += 1
        return used + need <= self.budget_bytes

    def clear(self) -> int:
        """Delete every evictable copy (never an only copy); returns bytes freed."""
        freed = 0
        with self._lock():
            for path, size, _ in self.entries():
                if path.name.endswith(".tmp") and time.time() - path.stat().st_mtime < 3600:
                    continue
                if path.name.endswith(".tmp") or self._evictable(path, size):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        freed += size
        return freed

    def warm(self, ds: ShardSource) -> int:
        """Copy a dataset's shards in manifest order until the budget is full; returns count."""
        n = 0
        for info in ds.manifest.shards:
            if self.used_bytes() + info.bytes > self.budget_bytes:
                break
            if self.get(info, ds.path) != ds.path / info.name:
                n += 1
        return n


class Prefetcher:
    """Copies the next ``ahead`` shards of a reader's sequence into the cache in a thread.

    ``advance()`` is called once per sample read (cheap: a counter); the thread keeps the
    cache's plan (next use of each shard) up to date for eviction by next use.
    """

    def __init__(self, cache: ShardCache, ds: ShardSource, ids: np.ndarray, shard_seq: np.ndarray,
                 ahead: int = 2) -> None:
        self.cache, self.ds, self.ahead = cache, ds, max(0, int(ahead))
        seq = np.asarray(shard_seq, np.int64)
        change = np.flatnonzero(np.diff(seq)) + 1 if len(seq) else np.zeros(0, np.int64)
        self.run_start = np.concatenate([[0], change]).astype(np.int64) if len(seq) else np.zeros(0, np.int64)
        self.run_shard = seq[self.run_start] if len(seq) else np.zeros(0, np.int64)
        self.pos = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
        self._thread.start()

    def advance(self, _sample_id: int = 0) -> None:
        self.pos += 1
        if self.pos in self._boundaries:
            self._wake.set()

    @property
    def _boundaries(self) -> set[int]:
        b = getattr(self, "_bset", None)
        if b is None:
            b = self._bset = set(self.run_start.tolist())
        return b

    def _run(self) -> None:
        names = [s.name for s in self.ds.manifest.shards]
        done: set[int] = set()
        try:
            while not self._stop.is_set():
                cur = int(np.searchsorted(self.run_start, self.pos, side="right")) - 1
                cur = max(cur, 0)
                upcoming = self.run_shard[cur:].tolist()
                self.cache.plan(self.ds.path, [names[s] for s in upcoming])
                wanted: list[int] = []
                for s in upcoming:
                    if s not in wanted:
                        wanted.append(s)
                    if len(wanted) > self.ahead:
                        break
                for s in wanted:
                    if self._stop.is_set():
                        return
                    if s not in done or not self.cache.local_path(self.ds.manifest.shards[s], self.ds.path).exists():
                        self.cache.get(self.ds.manifest.shards[s], self.ds.path)
                        done.add(s)
                self._wake.wait(0.2)
                self._wake.clear()
        except BaseException as exc:  # surfaced by the reader's own read of that shard
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
