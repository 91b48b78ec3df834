"""The restart budget of serving: how many failures within a window still restart.

One rule for the engine's stage pipeline (:mod:`convergent.serve.engine`) and the
dispatcher's instance processes (:mod:`convergent.serve.dispatch`): after a failure, a
restart is allowed while ``serve.faults.restart_on_failure`` holds and at most
``serve.faults.max_restarts`` failures happened within the last :data:`FAILURE_WINDOW_S`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from convergent.serve.config import FaultsConfig

__all__ = ["FAILURE_WINDOW_S", "RestartBudget"]

FAILURE_WINDOW_S = 600.0  # serve.faults.max_restarts counts failures within this window


@dataclass
class RestartBudget:
    """Times of recent failures (monotonic seconds) and the restarts they still allow."""

    window_s: float = FAILURE_WINDOW_S
    times: list[float] = field(default_factory=list)

    def record(self, now: float | None = None) -> None:
        """Count one failure at ``now`` (default: the clock), forgetting those older than
        the window."""
        now = time.monotonic() if now is None else now
        self.times = [t for t in self.times if now - t < self.window_s] + [now]

    @property
    def recent(self) -> int:
        """Failures counted (within the window when last recorded)."""
        return len(self.times)

    def allows(self, cfg: FaultsConfig) -> bool:
        """Whether ``cfg`` allows another restart after the failures counted."""
        return cfg.restart_on_failure and self.recent <= cfg.max_restarts

    def refusal(self, cfg: FaultsConfig) -> str:
        """Why no restart, naming the settings (for the error message)."""
        return (
            f"serve.faults.restart_on_failure={cfg.restart_on_failure}, {self.recent} "
            f"failure(s) in {self.window_s:.0f} s, serve.faults.max_restarts={cfg.max_restarts}"
        )
