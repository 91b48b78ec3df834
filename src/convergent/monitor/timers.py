"""Step timers: wall-clock sections of a training step, in seconds.

``StepTimer`` accumulates named sections (``data_wait``, ``compute``, ``comm``,
``optimizer``) within one step; on CUDA it synchronises the device at section
boundaries so the numbers are real, on CPU it reads ``time.perf_counter``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator


def _sync(device: object | None) -> None:
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


class StepTimer:
    """Accumulate wall time per named section; ``reset()`` at each step start."""

    def __init__(self, device: object | None = None) -> None:
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self._start = time.perf_counter()

    def reset(self) -> None:
        """Start a new step: clear sections and restart the step clock."""
        self.totals = defaultdict(float)
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the body and add it to ``name`` (seconds)."""
        _sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            self.totals[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Add an externally measured duration (e.g. exposed comm from a hook)."""
        self.totals[name] += max(0.0, float(seconds))

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Reattribute ``seconds`` (clamped to what ``src`` holds) from ``src`` to ``dst``."""
        s = min(max(0.0, float(seconds)), self.totals.get(src, 0.0))
        self.totals[src] -= s
        self.totals[dst] += s

    def elapsed(self) -> float:
        """Seconds since the last ``reset()``."""
        _sync(self.device)
        return time.perf_counter() - self._start

    def get(self, name: str) -> float:
        return float(self.totals.get(name, 0.0))


def peak_memory_bytes(device: object | None = None) -> int:
    """Peak memory of this process: CUDA max allocated, else max RSS (bytes)."""
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
