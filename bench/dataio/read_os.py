"""OS-level measurements of bench/dataio/read.py: memory of a process tree, page-cache
eviction and residency of a system's files, and open/stat system calls under strace."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import numpy as np


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out.extend(int(x) for x in fh.read().split())
    except OSError:
        pass
    return out


def _mem(pid: int) -> tuple[int, int]:
    """(RSS, private bytes) of a process; private excludes shared and file-cache pages."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            rss = priv = 0
            for line in fh:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                    priv += int(line.split()[1]) * 1024
            return rss, priv
    except OSError:
        return 0, 0


class RssSampler:
    """Peak memory of this process and of its process tree (DataLoader workers), every 50 ms.

    RSS counts mapped file pages (page cache of memory-mapped shards) too; ``private``
    (Private_Clean + Private_Dirty from smaps_rollup) is the memory the readers own.
    Only this process's descendants are read (no scan of the whole /proc).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.peak_main = self.peak_tree = self.peak_private_tree = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids, todo = [], [self.pid]
            while todo:
                p = todo.pop()
                pids.append(p)
                todo.extend(_children(p))
            mems = [_mem(p) for p in pids]
            self.peak_main = max(self.peak_main, mems[0][0])
            self.peak_tree = max(self.peak_tree, sum(m[0] for m in mems))
            self.peak_private_tree = max(self.peak_private_tree, sum(m[1] for m in mems))
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()



# ---------------------------------------------------------------------------- page cache


def system_files(system: str, data: Path) -> list[str]:
    """Every file a system reads (its data directory; the cached and random-access variants
    read convergent's)."""
    if system == "ideal":
        return []
    root = data / ("convergent" if system.startswith("convergent") else system)
    out, todo = [], [str(root)]
    while todo:
        with os.scandir(todo.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    out.append(e.path)
    return sorted(out)


def evict(files: list[str]) -> dict:
    """Drop ``files`` from the page cache: sync, then POSIX_FADV_DONTNEED (no root needed).

    When /proc/sys/vm/drop_caches is writable, also free the kernel's dentry and inode
    caches (``2``: metadata only, so other users' file data stays cached), so that the
    metadata lookups of a cold parallel file system are paid too.
    """
    t0 = time.perf_counter()
    os.sync()  # dirty pages (data written recently) cannot be dropped; one sync for all
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("2\n")
        meta = True
    except OSError:
        meta = False
    return {"evict_seconds": time.perf_counter() - t0, "dentry_inode_cache_dropped": meta}


_libc = None


def resident_fraction(files: list[str], sample: int = 2000, seed: int = 0) -> float:
    """Fraction of the pages of (a random sample of) ``files`` in the page cache (mincore)."""
    import ctypes
    import ctypes.util

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    rng = np.random.default_rng(seed)
    pick = files if len(files) <= sample else [files[i] for i in rng.choice(len(files), sample, replace=False)]
    have = total = 0
    for f in pick:
        fd = os.open(f, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            n = -(-size // page)
            vec = ctypes.create_string_buffer(n)
            _libc.mincore(addr, size, vec)
            _libc.munmap(addr, size)
            have += sum(b & 1 for b in vec.raw)
            total += n
        finally:
            os.close(fd)
    return have / total if total else 0.0


TRACED = ("open", "openat", "openat2", "creat", "stat", "lstat", "fstat", "newfstatat", "statx",
          "access", "faccessat", "faccessat2")
_CALL = re.compile(r"^\d+\s+(\w+)\((.*)")


def count_syscalls(trace: Path, data_dir: Path) -> dict:
    """Open and stat calls of a whole run (all processes), and those on the data files.

    ``fstat`` has no path and counts in the totals only; "data" calls name a path under
    the data directory (relative paths resolved against it are rare and not counted).
    """
    data = str(data_dir.resolve())
    tot = {"open": 0, "stat": 0}
    on_data = {"open": 0, "stat": 0}
    by_call: dict[str, int] = {}
    with open(trace, errors="replace") as fh:
        for line in fh:
            m = _CALL.match(line)
            if not m:
                continue
            name, rest = m.group(1), m.group(2)
            kind = "open" if name.startswith("open") or name == "creat" else "stat"
            tot[kind] += 1
            by_call[name] = by_call.get(name, 0) + 1
            q = rest.find('"')
            if q >= 0 and rest[q + 1 :].startswith(data):
                on_data[kind] += 1
    return {"open_calls": tot["open"], "stat_calls": tot["stat"],
            "open_calls_on_data": on_data["open"], "stat_calls_on_data": on_data["stat"],
            "by_call": by_call}
