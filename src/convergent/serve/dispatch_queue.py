"""The dispatcher's admission queue and routing over its instances.

:class:`Dispatcher` holds what :mod:`convergent.serve.dispatch` knows of each
:class:`Instance` (health, requests and tokens outstanding, KV use) and hands requests the
instance to go to, waiting while none has room (see that module for the policies).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import time
from dataclasses import dataclass, field

from convergent.serve.restarts import RestartBudget

__all__ = ["Dispatcher", "Instance"]


@dataclass
class Instance:
    """One serving instance as the dispatcher sees it."""

    index: int
    url: str
    healthy: bool = False
    outstanding: int = 0  # requests forwarded and not finished
    outstanding_tokens: int = 0
    kv_used: float = 0.0
    served: int = 0
    failed: int = 0
    proc: subprocess.Popen | None = None
    restarts: int = 0
    failures: RestartBudget = field(default_factory=RestartBudget)  # its exits


class Dispatcher:
    """Admission queue and routing over instances (all on one asyncio loop)."""

    def __init__(self, instances: list[Instance], policy: str = "load", max_outstanding: int = 64):
        self.instances = instances
        self.policy = policy
        self.max_outstanding = max_outstanding
        self._cond: asyncio.Condition | None = None
        self._rr = itertools.count()
        self.waiting = 0
        self.rerouted = 0

    @property
    def cond(self) -> asyncio.Condition:
        """The condition every change of room or health notifies (made on the running loop)."""
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def pick(self) -> Instance | None:
        """The instance the policy routes to next among the healthy ones with room, or ``None``."""
        ok = [i for i in self.instances if i.healthy and i.outstanding < self.max_outstanding]
        if not ok:
            return None
        if self.policy == "round_robin":
            n = len(self.instances)
            start = next(self._rr)
            for k in range(n):
                inst = self.instances[(start + k) % n]
                if inst in ok:
                    return inst
        return min(ok, key=lambda i: (i.outstanding_tokens, i.kv_used, i.index))

    async def acquire(self, tokens: int, timeout: float) -> Instance | None:
        """Wait (FIFO-ish) for an instance with room; ``None`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        async with self.cond:
            self.waiting += 1
            try:
                while (inst := self.pick()) is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.cond.wait(), timeout=min(left, 0.5))
                inst.outstanding += 1
                inst.outstanding_tokens += tokens
                return inst
            finally:
                self.waiting -= 1

    async def release(self, inst: Instance, tokens: int) -> None:
        """Give back the room a finished request held on ``inst``."""
        async with self.cond:
            inst.outstanding -= 1
            inst.outstanding_tokens -= tokens
            self.cond.notify_all()

    async def set_health(self, inst: Instance, healthy: bool, kv: float | None = None) -> None:
        """Record an instance's health (and KV use) and wake the requests waiting for room."""
        async with self.cond:
            inst.healthy = healthy
            if kv is not None:
                inst.kv_used = kv
            self.cond.notify_all()
