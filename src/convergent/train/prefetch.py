"""Keep the device fed: batches prepared ahead of the step, copied ahead on CUDA.

:class:`Prefetcher` runs ``make(step)`` (a rank's micro-batches of one step: record
reads, collation) for the coming steps in one background thread, ``depth`` steps
ahead, in step order — the batches are pure functions of the step, so the data of a
run does not change. On CUDA the host tensors are pinned in that thread, and
:meth:`Prefetcher.get` copies them to the device with ``non_blocking=True`` on a side
stream one step ahead: the copy of step ``s + 1`` overlaps the compute of step ``s``,
and the compute stream waits only for its own batch (the trainer calls
:meth:`Prefetcher.ahead` once a step's compute is queued). On CPU ``get`` returns the host
batches as they are (``to`` with the CPU device is a no-op).

A failure in the worker thread is raised by ``get`` with its original traceback.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Prefetcher", "map_tensors"]

_DONE = object()


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in ``obj`` (tensors, tuples, lists, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple | list):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: map_tensors(getattr(obj, f.name), fn)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


class Prefetcher:
    """Micro-batches of ``steps`` (in order) from ``make``, ``depth`` steps ahead.

    ``depth = 0`` builds each step's batches inline in :meth:`get` (no thread).
    """

    def __init__(
        self,
        make: Callable[[int], list[Any]],
        steps: Iterable[int],
        device: torch.device,
        depth: int = 2,
    ) -> None:
        self.make = make
        self.device = device
        self.cuda = device.type == "cuda"
        self.depth = depth
        self._steps = iter(steps)
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._staged: tuple[int, list[Any]] | None = None  # next step, already copying
        if depth > 0:
            self._thread = threading.Thread(target=self._work, name="prefetch", daemon=True)
            self._thread.start()

    # -- host side

    def _host(self, step: int) -> list[Any]:
        mbs = self.make(step)
        if self.cuda:
            mbs = map_tensors(mbs, lambda t: t.pin_memory())
        return mbs

    def _work(self) -> None:
        try:
            for step in self._steps:
                item = (step, self._host(step))
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._q.put(exc)
            return
        self._q.put(_DONE)

    def _next_host(self) -> tuple[int, list[Any]] | None:
        if self._thread is None:
            step = next(self._steps, None)
            return None if step is None else (step, self._host(step))
        item = self._q.get()
        if isinstance(item, BaseException):
            raise item
        return None if item is _DONE else item

    # -- device side

    def _copy(self, mbs: list[Any]) -> list[Any]:
        if not self.cuda:
            return mbs
        with torch.cuda.stream(self._stream):
            return map_tensors(mbs, lambda t: t.to(self.device, non_blocking=True))

    def _stage(self) -> None:
        nxt = self._next_host()
        self._staged = None if nxt is None else (nxt[0], self._copy(nxt[1]))

    def get(self, step: int) -> list[Any]:
        """The device micro-batches of ``step`` (steps must be asked for in order)."""
        if self._staged is None:
            self._stage()
        if self._staged is None:
            raise RuntimeError(f"prefetch: no batches left for step {step}")
        got, mbs = self._staged
        if got != step:
            raise RuntimeError(f"prefetch: asked for step {step}, next prepared is {got}")
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self._stream)  # the compute waits for its batch's copy only

            def keep(t: torch.Tensor) -> torch.Tensor:
                t.record_stream(cur)  # memory made on the side stream, used on this one
                return t

            mbs = map_tensors(mbs, keep)
        self._staged = None
        return mbs

    def ahead(self) -> None:
        """On CUDA, start copying the next step's batches now (call once this step's
        compute is queued: the copy then overlaps it). No-op on CPU."""
        if self.cuda and self._staged is None:
            self._stage()

    def close(self) -> None:
        """Stop the worker thread (batches already prepared are dropped)."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    self._thread.join(timeout=0.1)
            self._thread = None
