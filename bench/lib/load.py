"""A benchmark runs alone: the load guard of :mod:`bench.lib.harness`.

Two measurements decide whether a run was alone on the machine:

* the 1-minute load average when the run starts (above ``0.5 × cores`` the machine is
  busy; the guard first waits up to ``settle_s`` for it to fall, since the previous
  benchmark's own load decays with a one-minute time constant);
* the CPU time that processes *outside* the benchmark's process tree take while it runs,
  sampled from ``/proc/<pid>/stat`` every ``interval`` seconds (a process is the
  benchmark's when its parent chain reaches the benchmark's pid when first seen; it stays
  so after it is re-parented). Above ``0.25 × cores × wall`` the run was shared.

Kernel threads (children of ``kthreadd``, pid 2) are left out: they mostly serve the
benchmark's own I/O. An outside process that starts and ends between two samples is
missed, so the share is a lower bound.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_LOAD_PER_CORE = 0.5
MAX_OUTSIDE_SHARE = 0.25
_CLK = os.sysconf("SC_CLK_TCK")
_KTHREADD = 2


@dataclass(frozen=True)
class Proc:
    ppid: int
    comm: str
    cpu_s: float


def proc_table() -> dict[int, Proc]:
    """Every process now: parent, name and CPU seconds (user + system, all threads)."""
    out: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # gone since listdir
            continue
        comm = raw[raw.index("(") + 1: raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2:].split()  # rest[0] is field 3 (state)
        out[int(name)] = Proc(int(rest[1]), comm, (int(rest[11]) + int(rest[12])) / _CLK)
    return out


@dataclass
class LoadGuard:
    """Samples the machine while a benchmark runs; :meth:`report` says whether it was alone."""

    root_pid: int = field(default_factory=os.getpid)
    interval: float = 0.5
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    load_start: float | None = None
    waited_s: float = 0.0
    _ours: set[int] = field(default_factory=set)
    _prev: dict[int, Proc] = field(default_factory=dict)
    _outside: dict[tuple[int, str], float] = field(default_factory=dict)
    _t0: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def max_load(self) -> float:
        return MAX_LOAD_PER_CORE * self.cores

    def settle(self, wait_s: float) -> float:
        """Wait up to ``wait_s`` for the 1-minute load to fall to :attr:`max_load`; return it."""
        t0 = time.monotonic()
        load = os.getloadavg()[0]
        while load > self.max_load and time.monotonic() - t0 < wait_s:
            print(f"[load] 1-minute load {load:.2f} > {self.max_load:g}; waiting for it to "
                  "settle", file=sys.stderr, flush=True)
            time.sleep(min(10.0, max(0.0, wait_s - (time.monotonic() - t0))))
            load = os.getloadavg()[0]
        self.waited_s = time.monotonic() - t0
        self.load_start = load
        return load

    def start(self) -> LoadGuard:
        self._t0 = time.monotonic()
        self._ours = {self.root_pid}
        self._prev = proc_table()
        self._adopt(self._prev)
        threading.Thread(target=self._run, name="load-guard", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _adopt(self, table: dict[int, Proc]) -> None:
        """Add to ours every process whose parent is ours (until nothing changes)."""
        grew = True
        while grew:
            new = {pid for pid, p in table.items() if pid not in self._ours and p.ppid in self._ours}
            self._ours |= new
            grew = bool(new)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        table = proc_table()
        with self._lock:
            self._adopt(table)
            for pid, p in table.items():
                if pid in self._ours or pid == _KTHREADD or p.ppid in (0, _KTHREADD):
                    continue
                before = self._prev.get(pid)
                delta = p.cpu_s - before.cpu_s if before and before.comm == p.comm else p.cpu_s
                if delta > 0:
                    key = (pid, p.comm)
                    self._outside[key] = self._outside.get(key, 0.0) + delta
            self._prev = table

    def cpu_s_of(self, pid: int) -> float:
        """CPU seconds counted so far for the outside process ``pid`` (0 for one of ours)."""
        with self._lock:
            return sum(cpu for (p, _), cpu in self._outside.items() if p == pid)

    def report(self) -> dict[str, Any]:
        """The record written into a result: the load at the start, the outside CPU share,
        the busiest outside processes, and ``loaded`` with its reasons."""
        self.sample()
        with self._lock:
            wall = max(time.monotonic() - self._t0, 1e-9)
            outside = sum(self._outside.values())
            top = sorted(self._outside.items(), key=lambda kv: -kv[1])[:5]
        share = outside / (self.cores * wall)
        reasons = []
        if self.load_start is not None and self.load_start > self.max_load:
            reasons.append(f"1-minute load {self.load_start:.2f} at the start > "
                           f"{self.max_load:g} (0.5 x {self.cores} cores)")
        if share > MAX_OUTSIDE_SHARE:
            reasons.append(f"processes outside the benchmark took {share:.0%} of the machine's "
                           f"CPU time during the run (> {MAX_OUTSIDE_SHARE:.0%})")
        return {"loaded": bool(reasons), "reasons": reasons, "cores": self.cores,
                "load_avg_start": self.load_start, "waited_for_load_s": round(self.waited_s, 1),
                "wall_s": round(wall, 2), "outside_cpu_s": round(outside, 2),
                "outside_cpu_share": round(share, 4),
                "max_load": self.max_load, "max_outside_share": MAX_OUTSIDE_SHARE,
                "top_outside": [{"pid": pid, "comm": comm, "cpu_s": round(cpu, 2)}
                                for (pid, comm), cpu in top]}
