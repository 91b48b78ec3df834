"""Step timers: sections of a training step, in seconds.

``StepTimer`` accumulates named sections (``data_wait``, ``compute``, ``comm``,
``optimizer``) within one step.

* On CPU it reads ``time.perf_counter``.
* On CUDA a section records a pair of CUDA events on the current stream and never
  synchronises: the GPU timestamps the events when it reaches them, so a section is the
  *device* time between its start and end marks. ``data_wait`` is then the time the
  device sat idle waiting for the host to hand over the next batch, and the step time is
  the device time from the step's start mark to its end mark. :meth:`StepTimer.snapshot`
  returns a :class:`StepTiming` that is resolved later (one event synchronisation, when
  the metrics are written), so the training step itself is never synchronised.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def _is_cuda(device: object | None) -> bool:
    return device is not None and getattr(device, "type", None) == "cuda"


@dataclass
class StepTiming:
    """One step's sections; :meth:`resolve` -> ``{name: seconds}`` plus ``step_s``.

    ``host`` holds perf-counter or externally measured seconds; ``events`` CUDA event
    pairs per section; ``moves`` reattributions applied after the events are read.
    """

    host: dict[str, float]
    step_s: float | None = None  # host clock (CPU)
    events: dict[str, list[tuple[Any, Any]]] = field(default_factory=dict)
    step_events: tuple[Any, Any] | None = None
    moves: list[tuple[str, str, float]] = field(default_factory=list)

    def resolve(self) -> dict[str, float]:
        """Seconds per section and ``step_s`` (waits for the step's end event on CUDA)."""
        totals = defaultdict(float, self.host)
        step_s = self.step_s
        if self.step_events is not None:
            start, end = self.step_events
            end.synchronize()
            step_s = start.elapsed_time(end) / 1e3
        for name, pairs in self.events.items():
            totals[name] += sum(a.elapsed_time(b) for a, b in pairs) / 1e3
        for src, dst, s in self.moves:
            s = min(max(0.0, s), totals.get(src, 0.0))
            totals[src] -= s
            totals[dst] += s
        out = {k: float(v) for k, v in totals.items()}
        out["step_s"] = float(step_s or 0.0)
        return out


class StepTimer:
    """Accumulate time per named section; ``reset()`` at each step start."""

    def __init__(self, device: object | None = None) -> None:
        self.device = device
        self.on_device = _is_cuda(device)
        self.totals: dict[str, float] = defaultdict(float)
        self._events: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self._moves: list[tuple[str, str, float]] = []
        self._start = time.perf_counter()
        self._start_event: Any = None
        if self.on_device:
            self._start_event = self._event()

    def _event(self) -> Any:
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def reset(self) -> None:
        """Start a new step: clear sections and restart the step clock."""
        self.totals = defaultdict(float)
        self._events = defaultdict(list)
        self._moves = []
        self._start = time.perf_counter()
        if self.on_device:
            self._start_event = self._event()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the body and add it to ``name`` (seconds; device time on CUDA)."""
        if self.on_device:
            a = self._event()
            try:
                yield
            finally:
                self._events[name].append((a, self._event()))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        """Add an externally measured duration (e.g. exposed comm from a hook)."""
        self.totals[name] += max(0.0, float(seconds))

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Reattribute ``seconds`` (clamped to what ``src`` holds) from ``src`` to ``dst``."""
        if self.on_device:  # the event sections are only known later
            self._moves.append((src, dst, float(seconds)))
            return
        s = min(max(0.0, float(seconds)), self.totals.get(src, 0.0))
        self.totals[src] -= s
        self.totals[dst] += s

    def elapsed(self) -> float:
        """Seconds since the last ``reset()`` (host clock; synchronises on CUDA)."""
        if self.on_device:
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._start

    def snapshot(self) -> StepTiming:
        """This step's timing, to be resolved later (no synchronisation here)."""
        if self.on_device:
            return StepTiming(
                dict(self.totals), None, {k: list(v) for k, v in self._events.items()},
                (self._start_event, self._event()), list(self._moves),
            )
        return StepTiming(dict(self.totals), time.perf_counter() - self._start)

    def get(self, name: str) -> float:
        """Seconds of ``name`` so far (resolves the event sections on CUDA)."""
        if self.on_device:
            t = StepTiming(dict(self.totals), 0.0, {k: list(v) for k, v in self._events.items()},
                           None, list(self._moves))
            for _, b in (p for v in self._events.values() for p in v):
                b.synchronize()
            return t.resolve().get(name, 0.0)
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
