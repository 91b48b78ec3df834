"""Checkpoint-and-exit on preemption (``convergent train --submit --requeue``).

With ``CONVERGENT_REQUEUE=1`` in the environment (the sbatch script sets it), SIGTERM and
SIGUSR1 only raise a flag. After every optimizer step the ranks agree on the flag (one
all-reduce of a single number, MAX) so that all of them stop after the *same* step: the
trainer writes a DCP checkpoint there, logs a ``train.preempted`` record and
:mod:`convergent.train.main` exits with code 0. Slurm requeues the job (``scontrol
requeue``, or the script's answer to ``--signal=B:USR1@N``) and the next start resumes
from that checkpoint (``checkpoint.resume``), so the losses equal an uninterrupted run's.
Without the variable nothing is installed and no collective is added.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

REQUEUE_ENV = "CONVERGENT_REQUEUE"


class Preempted(Exception):
    """Training stopped after ``step`` on a preemption signal (checkpoint written)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"preempted after step {step}; checkpoint written")
        self.step = step


class Preemption:
    """The flag set by SIGTERM/SIGUSR1 and the collective check of it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.signal_name: str | None = None
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._on_signal)

    @classmethod
    def from_env(cls) -> Preemption:
        return cls(os.environ.get(REQUEUE_ENV, "") not in ("", "0"))

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler shape
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            log.warning("%s received: checkpoint after this step, then exit",
                        self.signal_name)

    def requested(self) -> bool:
        """True on every rank once any rank got the signal (collective when enabled)."""
        if not self.enabled:
            return False
        import torch
        import torch.distributed as dist

        flag = 1.0 if self.signal_name else 0.0
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return bool(flag)
        device = "cpu"
        if dist.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        t = torch.tensor([flag], dtype=torch.float32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t.item() > 0 and self.signal_name is None:
            self.signal_name = "peer"
        return t.item() > 0
