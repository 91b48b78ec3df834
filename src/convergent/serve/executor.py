"""Executors: where the engine's stages run, and how their death is noticed.

* :class:`LocalExecutor` — all stages in this process, run one after another (the
  ``sequential`` scheduler's one process; also handy in tests).
* :class:`ProcessExecutor` — one process per stage, ``torch.distributed`` point-to-point
  activations between them (gloo on CPU), metadata through queues. :meth:`check` watches
  the stage processes: an exit code (killed by a signal, crashed) or a heartbeat older
  than the timeout raises :class:`StageFailure` naming the stage and the reason.

Both take :class:`~convergent.serve.messages.BatchMeta` in :meth:`submit` and return
:data:`~convergent.serve.messages.StageReport` records from :meth:`poll`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import signal
import socket
import time

from convergent.core.errors import ConvergentError
from convergent.serve.engine_async import PendingSampled
from convergent.serve.messages import (
    BatchMeta,
    BatchResult,
    Heartbeat,
    RendezvousPort,
    StageBusy,
    StageError,
    StageMessage,
    StageReady,
    StageReport,
    StopStage,
)
from convergent.serve.stage import StageRunner, StageSpec

__all__ = ["LocalExecutor", "ProcessExecutor", "StageFailure", "free_port"]


class StageFailure(ConvergentError):
    """A pipeline stage died, crashed or stopped answering (the message says which/why)."""

    exit_code = 1


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_reason(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


class LocalExecutor:
    """Runs the stages in this process. ``defer`` (``serve.engine.async_scheduling``):
    :meth:`submit` launches a step and returns without waiting for its tokens
    (:class:`~convergent.serve.engine_async.PendingSampled`); :meth:`poll` waits."""

    def __init__(self, specs: list[StageSpec], defer: bool = False) -> None:
        import torch

        torch.set_num_threads(max(1, specs[0].engine.torch_threads))
        self.runners = [StageRunner(s) for s in specs]
        self.kv_bytes = sum(r.kv.nbytes for r in self.runners)
        self.defer = defer
        self._done: list[StageReport] = []
        self._pending: list[tuple[int, PendingSampled, float]] = []

    def submit(self, meta: BatchMeta) -> None:
        x = None
        last = len(self.runners) - 1
        for s, r in enumerate(self.runners):
            t0 = time.monotonic()
            try:
                x = r.run(meta, x, defer=self.defer and s == last)
            except Exception as exc:
                raise StageFailure(f"stage {s} failed: {exc!r}") from exc
            t1 = time.monotonic()
            if s < last:
                self._done.append(StageBusy(s, meta.bid, t0, t1))
        if isinstance(x, PendingSampled):
            self._pending.append((meta.bid, x, t0))
        else:
            self._done.append(BatchResult(meta.bid, x, t0, t1))

    def poll(self, timeout: float) -> list[StageReport]:
        """The finished steps' reports; a launched step's tokens are waited for here."""
        for bid, pending, t0 in self._pending:
            try:
                sampled = pending.result()
            except Exception as exc:
                self._pending = []
                raise StageFailure(f"stage {len(self.runners) - 1} failed: {exc!r}") from exc
            self._done.append(BatchResult(bid, sampled, t0, time.monotonic()))
        self._pending = []
        out, self._done = self._done, []
        return out

    def check(self) -> None:
        """Nothing to watch: a failure surfaces as an exception of :meth:`submit`."""

    def close(self, kill: bool = False) -> None:
        self._done = []
        self._pending = []


class ProcessExecutor:
    """One spawned process per stage; see :func:`convergent.serve.stage.stage_main`."""

    def __init__(
        self,
        specs: list[StageSpec],
        start_timeout: float = 300.0,
        heartbeat_timeout: float = 30.0,
    ) -> None:
        import multiprocessing as mp

        from convergent.serve.stage import stage_main

        ctx = mp.get_context("spawn")
        self.out_q = ctx.Queue()
        self.in_qs = [ctx.Queue() for _ in specs]
        self.heartbeat_timeout = heartbeat_timeout
        hb_every = min(1.0, heartbeat_timeout / 4)
        rdzv_s = max(10.0, min(120.0, start_timeout / 2))
        self.procs = [
            ctx.Process(
                target=stage_main,
                args=(s, self.in_qs[i], self.out_q, hb_every, rdzv_s),
                daemon=True,
                name=f"serve-stage-{i}",
            )
            for i, s in enumerate(specs)
        ]
        for p in self.procs:
            p.start()
        self.kv_bytes = 0
        self._await_ready(len(specs), time.monotonic() + start_timeout)
        self.last_beat = [time.monotonic()] * len(specs)
        self._checked = 0.0
        self._pending: list[StageReport] = []  # reports read by check()

    def _await_ready(self, n: int, deadline: float) -> None:
        """Wait for every stage's :class:`StageReady` (forwarding stage 0's rendezvous
        port to the others); a stage error, death or the deadline raises StageFailure."""
        ready = 0
        while ready < n:
            try:
                msg: StageMessage = self.out_q.get(timeout=0.5)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(self.procs) if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    self.close(kill=True)
                    why = (
                        f"stage {dead[0][0]} {_exit_reason(dead[0][1])} while starting"
                        if dead
                        else "pipeline stages did not start in time"
                    )
                    raise StageFailure(why) from None
                continue
            if isinstance(msg, StageError):
                self.close(kill=True)
                why = _last_line(msg.traceback)
                raise StageFailure(f"stage {msg.stage} failed to start: {why}")
            if isinstance(msg, RendezvousPort):  # stage 0's store: tell the others where
                for q in self.in_qs[1:]:
                    q.put(msg)
            elif isinstance(msg, StageReady):
                ready += 1
                self.kv_bytes += msg.kv_bytes

    def submit(self, meta: BatchMeta) -> None:
        for i, q in enumerate(self.in_qs):
            if i == 0:
                q.put(meta)
            else:  # later stages do not need the token ids
                q.put(dataclasses.replace(meta, input_ids=[]))

    def poll(self, timeout: float) -> list[StageReport]:
        out = []
        try:
            out.append(self.out_q.get(timeout=timeout))
            while True:
                out.append(self.out_q.get_nowait())
        except queue.Empty:
            pass
        msgs, self._pending = self._pending + self._sort(out), []
        self.check()
        return msgs + self._pending

    def _sort(self, out: list[StageMessage]) -> list[StageReport]:
        """Record heartbeats, raise on a stage's error report, return the rest."""
        now = time.monotonic()
        msgs: list[StageReport] = []
        for m in out:
            if isinstance(m, Heartbeat):
                self.last_beat[m.stage] = now
            elif isinstance(m, StageError):
                raise self._failure(f"stage {m.stage} failed: {_last_line(m.traceback)}")
            elif isinstance(m, StageBusy | BatchResult):
                msgs.append(m)
        return msgs

    def _failure(self, report: str) -> StageFailure:
        """A stage reported an error: if a peer process died (its neighbours then fail on
        the broken link), name the dead one as the cause."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            dead = [(i, p) for i, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
            if dead:
                i, p = dead[0]
                self.close(kill=True)
                return StageFailure(f"stage {i} (pid {p.pid}) {_exit_reason(p.exitcode)}")
            time.sleep(0.05)
        self.close(kill=True)
        return StageFailure(report)

    def check(self) -> None:
        """Raise :class:`StageFailure` if a stage process is gone or silent (at most every
        0.1 s: ``exitcode`` is a non-blocking ``waitpid``)."""
        now = time.monotonic()
        if now - self._checked < 0.1:
            return
        self._checked = now
        out = []
        with contextlib.suppress(queue.Empty):
            while True:  # heartbeats that arrived while nothing was polled
                out.append(self.out_q.get_nowait())
        self._pending.extend(self._sort(out))
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                raise StageFailure(f"stage {i} (pid {p.pid}) {_exit_reason(p.exitcode)}")
            if now - self.last_beat[i] > self.heartbeat_timeout:
                raise StageFailure(
                    f"stage {i} (pid {p.pid}) sent no heartbeat for "
                    f"{now - self.last_beat[i]:.1f} s (serve.faults.heartbeat_timeout_s)"
                )

    def close(self, kill: bool = False) -> None:
        """Stop the stages: politely (a stop message, then join), or at once (``kill``:
        after a failure the survivors may be blocked on a dead peer)."""
        if not kill:
            for q in self.in_qs:
                with contextlib.suppress(Exception):
                    q.put(StopStage())
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for q in [*self.in_qs, self.out_q]:
            with contextlib.suppress(Exception):
                q.cancel_join_thread()
                q.close()


def _last_line(tb: str) -> str:
    lines = [x for x in str(tb).strip().splitlines() if x.strip()]
    return lines[-1] if lines else "unknown error"
