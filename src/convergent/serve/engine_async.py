"""Host work overlapped with the device step (``serve.engine.async_scheduling``).

vLLM v1's async scheduling runs the host's side of step N+1 while the device computes
step N. Our engine's version, for both executors:

* The last stage samples on the device and, where the executor allows it
  (:class:`~convergent.serve.executor.LocalExecutor`), does not wait for the tokens: it
  starts their copy into pinned host memory (``non_blocking``) and records a CUDA event
  (:class:`PendingSampled`); the executor's ``poll`` waits on that event only when the
  engine asks for the step's result. ``submit`` thus returns as soon as the step is
  launched.
* The engine defers the token listeners' work (:class:`AsyncOutput`): the events of
  step N-1 (the HTTP layer's detokenising and streaming, the dispatcher's bookkeeping)
  are handed out after step N is launched and before the engine waits for it, as are
  the new requests read from the API's queue. With a pipeline of stage processes
  (:class:`~convergent.serve.executor.ProcessExecutor`) the stages already run apart
  from the engine; the deferral moves the listeners' work off the engine's path from a
  result to the next submit.

The scheduler still needs step N's tokens before it schedules step N+1 (a request's
next decode input is the token it just sampled): the placeholder-token scheduling of
vLLM (step N+1 scheduled with the sampled ids filled in on the device) is the next step,
see docs/serving.md. The tokens are the same with and without async scheduling: only
when the host learns them and when it hands them on changes. ``auto`` turns it on for
CUDA; on the CPU the step itself is synchronous, so there is nothing to overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from convergent.serve.messages import Sampled, TokenEvent

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncOutput", "PendingSampled", "async_enabled"]


def async_enabled(setting: str, device: str) -> bool:
    """``serve.engine.async_scheduling``: ``auto`` is on for CUDA."""
    return setting == "on" or (setting == "auto" and device.startswith("cuda"))


@dataclass
class PendingSampled:
    """A step's sampled tokens on their way to the host: the non-blocking copy of the
    device tensor into pinned memory and the event recorded after it."""

    out: Sampled  # filled in but for the tokens (prompt logprobs, if any)
    rids: list[int]
    host: torch.Tensor  # int64 [n], pinned on CUDA
    event: Any = None  # torch.cuda.Event, None on the CPU (the copy is done)
    _done: bool = field(default=False, repr=False)

    @classmethod
    def start(cls, out: Sampled, rids: list[int], tokens: torch.Tensor) -> PendingSampled:
        """Start the copy of the device ``tokens`` (int64 [n])."""
        import torch

        if tokens.device.type != "cuda":
            return cls(out, rids, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return cls(out, rids, host, ev)

    def ready(self) -> bool:
        """Whether the copy has finished (never waits)."""
        return self.event is None or self.event.query()

    def result(self) -> Sampled:
        """Wait for the copy (the step's one wait) and return the step's output."""
        if not self._done:
            if self.event is not None:
                self.event.synchronize()
            self.out.tokens = dict(zip(self.rids, self.host.tolist(), strict=True))
            self._done = True
        return self.out


class AsyncOutput:
    """The engine's token events, handed out at once or (``defer_events``) after the
    next step is launched (:meth:`_flush_events`)."""

    _token_listeners: list[Callable[[TokenEvent], None]]
    defer_events: bool = False

    def _emit_event(self, ev: TokenEvent) -> None:
        if not self._token_listeners:
            return
        if self.defer_events:
            self.__dict__.setdefault("_deferred", []).append(ev)
            return
        for fn in self._token_listeners:
            fn(ev)

    def _flush_events(self) -> None:
        """Hand the deferred events to the listeners, in the order they happened."""
        pending = self.__dict__.get("_deferred")
        if not pending:
            return
        self.__dict__["_deferred"] = []
        for ev in pending:
            for fn in self._token_listeners:
                fn(ev)
