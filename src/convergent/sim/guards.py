"""Timeout guards of a campaign task and the reason string of a failed attempt.

* :func:`watchdog` (worker side): past ``timeout_s`` the task reports a timeout event and
  ends its worker process (the nanny restarts it); the driver then sees ``KilledWorker``.
* :class:`Backstop` (driver side): restarts a worker whose task of this campaign has been
  processing for too long, for when native code holding the GIL keeps the watchdog from
  running.
* :func:`failure_reason`: a readable reason (timeout, worker death, exception) for the
  quarantine file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

TIMEOUT_TOPIC = "convergent-timeout"


def watchdog(dask_key: str, timeout_s: float) -> threading.Timer | None:
    """Arm a timer that reports a timeout and ends this worker process after ``timeout_s``.

    Python cannot interrupt a calculation running in native code, so the only reliable
    way to stop it is to end the process; the Dask nanny starts a fresh worker and the
    scheduler reports the task as failed (``KilledWorker``) to the driver.
    """
    if not timeout_s or timeout_s <= 0:
        return None
    worker = None
    with contextlib.suppress(Exception):  # get_worker() works only in the task's thread
        from distributed import get_worker

        worker = get_worker()

    def fire() -> None:
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.log_event(TIMEOUT_TOPIC, {"key": dask_key, "timeout_s": timeout_s})
                _wait_until_scheduler_has(worker, dask_key, deadline=time.monotonic() + 10.0)
        os._exit(75)

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def _wait_until_scheduler_has(worker, dask_key: str, deadline: float) -> None:
    """Block (this timer thread) until the scheduler holds the timeout event of
    ``dask_key``, or until ``deadline`` (monotonic s). From a thread other than the
    worker's event loop, ``log_event`` only *schedules* the send, so waiting on the send
    buffer alone races a busy loop; asking the scheduler confirms delivery."""
    from distributed.utils import sync

    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            events = sync(worker.loop, worker.scheduler.events, topic=TIMEOUT_TOPIC, callback_timeout=2.0)
            if any(isinstance(m, dict) and m.get("key") == dask_key for _, m in events):
                return
        time.sleep(0.05)


def failure_reason(client, exc: BaseException, dask_key: str,
                    backstop: Backstop | None = None) -> str:
    """A readable reason for a failed task attempt (timeout, worker death, exception)."""
    from distributed.scheduler import KilledWorker

    if isinstance(exc, KilledWorker):
        if backstop is not None and dask_key in backstop.restarted:
            return (f"timeout: worker unresponsive for {backstop.restarted[dask_key]:.0f} s "
                    "(restarted by the driver)")
        with contextlib.suppress(Exception):
            for _, msg in client.get_events(TIMEOUT_TOPIC):
                if isinstance(msg, dict) and msg.get("key") == dask_key:
                    return f"timeout: task exceeded {msg.get('timeout_s')} s (worker restarted)"
        return "worker process died (KilledWorker)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:500]


class Backstop(threading.Thread):
    """Driver-side guard behind the in-task watchdog: restart a worker whose task of this
    campaign has been *processing* on it for more than ``limit_s`` seconds.

    The in-task watchdog cannot fire while native code holds the GIL (or if the worker's
    threads are wedged); this thread asks the worker's nanny for a restart instead. The
    task then fails with ``KilledWorker`` and goes through the normal retry/quarantine
    path with a timeout reason. ``limit_s`` should exceed the time a task may legitimately
    wait behind another one on the same worker (default in the campaign:
    ``2 * timeout_s + 30``).

    A restart is given ``restart_timeout_s`` (the nanny's own default of 30 s is too short
    for a wedged process plus a fresh worker's imports on a loaded node); each worker's
    outcome ("OK", "timed out", "removed" or an error) is kept in ``restart_status`` and
    anything but "OK" is logged as a warning, since the campaign then runs on fewer workers.
    """

    def __init__(self, client, prefix: str, limit_s: float, interval_s: float = 5.0,
                 restart_timeout_s: float = 120.0) -> None:
        super().__init__(name="convergent-backstop", daemon=True)
        self.client, self.prefix = client, prefix
        self.limit_s, self.interval_s = limit_s, interval_s
        self.restart_timeout_s = restart_timeout_s
        self.first_seen: dict[str, float] = {}
        self.restarted: dict[str, float] = {}  # key -> seconds it had been processing
        self.restart_status: dict[str, str] = {}  # worker -> outcome of its last restart
        self._halt = threading.Event()

    def check(self, now: float | None = None) -> list[str]:
        """One inspection; returns the workers it asked to restart."""
        now = time.monotonic() if now is None else now
        processing = self.client.processing()
        seen: set[str] = set()
        victims: list[str] = []
        for worker, keys in processing.items():
            for key in map(str, keys):
                if not key.startswith(self.prefix):
                    continue
                seen.add(key)
                age = now - self.first_seen.setdefault(key, now)
                if age > self.limit_s and worker not in victims:
                    victims.append(worker)
                    self.restarted[key] = age
        for key in list(self.first_seen):
            if key not in seen:
                del self.first_seen[key]
        if victims:
            self._restart(victims)
        return victims

    def _restart(self, workers: list[str]) -> None:
        """Restart ``workers`` through their nannies and record each outcome."""
        try:
            outcome = self.client.restart_workers(
                workers, timeout=self.restart_timeout_s, raise_for_error=False) or {}
        except Exception as exc:  # noqa: BLE001 - the guard must keep running
            outcome = {w: f"{type(exc).__name__}: {exc}" for w in workers}
        for worker in workers:
            status = str(outcome.get(worker, "no answer"))
            self.restart_status[worker] = status
            if status != "OK":
                log.warning("backstop: restart of wedged worker %s: %s; the campaign "
                            "continues on the remaining workers", worker, status)

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            with contextlib.suppress(Exception):
                self.check()

    def stop(self) -> None:
        self._halt.set()

