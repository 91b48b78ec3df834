"""Exposed communication time for FSDP2, HSDP and pipeline steps (seconds).

DDP's exposed communication is measured by its comm hook (see
:mod:`convergent.train.compression`). The other strategies call their collectives from
the training thread, so their *exposed* communication is the wall time that thread
spends blocked in them; communication that gloo's worker threads (or NCCL streams)
carry out while the training thread computes is overlapped and not counted. This
module wraps, once per process, the Python entry points where that blocking happens:

* FSDP2 (``fully_shard`` hook path): ``foreach_all_gather`` (copy-in + all-gather),
  ``foreach_all_gather_copy_out`` (wait + copy-out) and ``foreach_reduce``
  (reduce-scatter, HSDP all-reduce) as called from ``_fsdp_param_group``;
* DTensor functional collectives (the gathered-forward FSDP path, gradient-norm
  reductions of sharded gradients): ``wait_tensor``, where the training thread blocks
  on an issued collective;
* pipelining: ``_batch_p2p`` (issue of send/recv) and ``_wait_batch_p2p`` (wait); a
  stage waiting for its neighbour's activations or gradients is blocked here too, so for
  pipelines ``comm_s`` includes the bubble (transfer + idle wait on the other stage).

Nested calls count once. Exact for CPU/gloo, where these calls are where the training
thread waits; on CUDA they time only the host side (a lower bound). If a torch version
lacks one of these names it is skipped and ``CommClock.hooks`` says which were found.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

_TARGETS: dict[str, tuple[str, list[str]]] = {
    "fsdp": (
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        ["foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce"],
    ),
    "funcol": ("torch.distributed._functional_collectives", ["wait_tensor"]),
    "pipeline": ("torch.distributed.pipelining.schedules", ["_batch_p2p", "_wait_batch_p2p"]),
}
_FOR_STRATEGY = {"fsdp": ["fsdp", "funcol"], "hsdp": ["fsdp", "funcol"], "pipeline": ["pipeline"]}


@dataclass
class CommClock:
    """Running total of training-thread seconds spent blocked in communication."""

    seconds: float = 0.0
    calls: int = 0
    hooks: list[str] = field(default_factory=list)
    _depth: threading.local = field(default_factory=threading.local)

    def wrap(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth:
                return fn(*args, **kwargs)
            self._depth.n = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
                self._depth.n = 0

        timed.__convergent_comm_clock__ = self  # type: ignore[attr-defined]
        return timed


CLOCK = CommClock()


def install(strategy: str) -> CommClock | None:
    """Wrap the blocking entry points for ``strategy``; None if it has none to time."""
    groups = _FOR_STRATEGY.get(strategy)
    if not groups:
        return None
    for group in groups:
        modname, names = _TARGETS[group]
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for name in names:
            fn = getattr(mod, name, None)
            if fn is None or hasattr(fn, "__convergent_comm_clock__"):
                continue
            setattr(mod, name, CLOCK.wrap(fn))
            CLOCK.hooks.append(f"{modname}.{name}")
    return CLOCK
