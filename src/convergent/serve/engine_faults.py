"""What the engine does when its pipeline fails or the server shuts down (a mixin of
:class:`~convergent.serve.engine.Engine`, which holds the state it works on).

A stage failure (:class:`~convergent.serve.executor.StageFailure`, or any error of the
loop) ends the requests running in the stages with the reason, hands the queue to a fresh
scheduler and KV map, and restarts the stages while the
:class:`~convergent.serve.restarts.RestartBudget` allows; otherwise the queue ends too
(retryable) and the fatal listeners hear why. A shutdown ends what still runs at its
deadline.
"""

from __future__ import annotations

import time

from convergent.serve.executor import StageFailure
from convergent.serve.kv_cache import BlockManager
from convergent.serve.scheduler_base import RequestStatus

__all__ = ["FailureHandling"]


class FailureHandling:
    """Failure and shutdown handling of :class:`~convergent.serve.engine.Engine`; it uses
    the engine's ``sched``, ``bm``, ``in_flight``, ``executor``, ``failures`` and its
    health fields, and ``_new_scheduler``, ``_make_executor`` and ``_emit``."""

    def _fail_all(self, reason: str) -> None:
        """End every unfinished request with ``finish_reason="error"`` (``retryable`` where
        none of it reached the stages)."""
        for r in [*self.sched.running, *self.sched.waiting]:
            r.retryable = not (r.in_flight or r.num_computed or r.output)
            self.sched.abort(r.rid)
            r.finish_reason, r.error = "error", reason
            self._emit(r, -1)

    def _fail_running(self, reason: str) -> None:
        """The pipeline died: end the requests it held (admitted, with KV in the stages)
        with ``finish_reason="error"``; a fresh scheduler and KV map keep the queue."""
        running, queued = list(self.sched.running), list(self.sched.waiting)
        self.in_flight.clear()
        self.bm = BlockManager(self.bm.num_blocks, self.bm.block_size)
        self.sched = self._new_scheduler()
        for r in running:
            r.retryable = False  # admitted: its prefill went to the stages
            r.state, r.finish_reason, r.error = RequestStatus.FINISHED, "error", reason
            r.in_flight = False
            self._emit(r, -1)
        for r in queued:  # never in the stages (or preempted out of them): queue again
            waited = r.queued_at
            self.sched.add(r)
            r.queued_at = waited
            if r.finished:
                self._emit(r, -1)

    def _recover(self, exc: Exception) -> bool:
        """After a failure: end all requests, then restart the pipeline (true) or give up."""
        reason = str(exc) if isinstance(exc, StageFailure) else f"engine error: {exc!r}"
        self.healthy = False
        self.failure = reason
        self.failures.record()
        self._fail_running(reason)
        self.executor.close(kill=True)
        while self.failures.allows(self.cfg.faults) and not self._stop.is_set():
            try:
                self.executor = self._make_executor()
            except Exception as again:
                self.failures.record()
                self.failure = f"{reason}; restart failed: {again}"
                time.sleep(min(5.0, 0.5 * self.failures.recent))
                continue
            self.restarts += 1
            self.healthy = True
            return True
        self._fail_all(reason)  # no pipeline will run the queue
        if self._stop.is_set():
            return False
        self.error = StageFailure(f"{reason} (no restart: {self.failures.refusal(self.cfg.faults)})")
        for fn in self._fatal_listeners:
            fn(self.error)
        return False

    def begin_shutdown(self, timeout_s: float) -> None:
        """Stop accepting (the API checks :attr:`accepting`); requests still running after
        ``timeout_s`` end with an error. Thread-safe."""
        self._shutdown_at = time.monotonic() + max(0.0, timeout_s)

    @property
    def accepting(self) -> bool:
        return self.healthy and self.error is None and self._shutdown_at is None

    @property
    def shutting_down(self) -> bool:
        return self._shutdown_at is not None

    @property
    def stalled(self) -> bool:
        """The engine thread has not looped for ``serve.faults.heartbeat_timeout_s``."""
        return time.monotonic() - self.last_loop > self.cfg.faults.heartbeat_timeout_s
