"""Where an offline run's time goes: the engine step's split and the requests' latencies.

While the engine records (offline :meth:`~convergent.serve.engine.Engine.run`; serving
online records nothing), :class:`StepTiming` (a mixin of the engine) times its loop with
``perf_counter`` stamps around the executor's ``submit`` and ``poll`` and, where the
stages run in the engine's process on CUDA, a pair of CUDA events around each step's
launch. :class:`StepSplit` divides the loop's wall time into

* **host prepare** — the engine thread neither waiting for a result nor (on the CPU, where
  the stages compute inside ``submit``) computing: the scheduler, the step's metadata,
  kernel launches or graph replays, applying the sampled tokens;
* **GPU** — the device's time for the steps: the CUDA events' elapsed time (from the
  event the engine records as it hands a step to the executor to the one after the
  tokens' copy: a span, so a launch-bound step's device waits for the host's launches
  inside ``submit`` count in it), or, without events, the stages' busy intervals (the
  CPU's compute; for stage processes the busiest stage's);
* **sync** — the engine thread blocked in ``poll`` waiting for a step's tokens.

``by_kind`` splits the steps into pure decodes (``decode``: one new token per sequence,
what the decode graphs take) and the others (``mixed``: prefills, chunks and decodes
together): their count, the host's time inside ``submit`` a step (the forward's launches
or graph replays, on CUDA) and the GPU's (CUDA events) a step.

``host_prepare + sync (+ GPU on the CPU) = wall``; on CUDA the GPU's share is its busy
fraction, which overlaps the host's (async scheduling launches step N+1's host work
while step N runs). :func:`token_latencies` gives TTFT (arrival to first token) and TPOT
(first token to finish over the further tokens) percentiles from the requests.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["StepSplit", "StepTiming", "TokenLatencies", "step_kind", "token_latencies"]


@dataclass(frozen=True)
class StepSplit:
    """An engine loop's time, split (seconds; see the module's docstring)."""

    steps: int
    wall_s: float
    host_prepare_s: float
    gpu_s: float
    sync_s: float
    decide_s: float  # of host_prepare: the scheduler's schedule()/complete()
    gpu_timer: str  # "cuda_events" or "stage_busy"
    by_kind: dict[str, dict[str, float]] | None = None  # decode / mixed (module docstring)

    def to_dict(self) -> dict[str, Any]:
        w = max(self.wall_s, 1e-12)
        n = max(self.steps, 1)
        return {
            **asdict(self),
            "host_prepare_fraction": self.host_prepare_s / w,
            "gpu_fraction": self.gpu_s / w,
            "sync_fraction": self.sync_s / w,
            "host_prepare_ms_per_step": 1e3 * self.host_prepare_s / n,
            "gpu_ms_per_step": 1e3 * self.gpu_s / n,
            "sync_ms_per_step": 1e3 * self.sync_s / n,
        }


@dataclass(frozen=True)
class TokenLatencies:
    """Time to first token and time per output token (seconds), p50 and p99."""

    requests: int
    ttft_s_p50: float | None
    ttft_s_p99: float | None
    tpot_s_p50: float | None
    tpot_s_p99: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_kind(meta: Any) -> str:
    """``decode`` (one new token per sequence after a context) or ``mixed``."""
    decode = meta.query_lens and all(q == 1 for q in meta.query_lens) and min(
        meta.context_lens) >= 2
    return "decode" if decode else "mixed"


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def token_latencies(reqs: list[Any]) -> TokenLatencies:
    """TTFT = ``first_token_time - arrival``; TPOT = ``(finish_time - first_token_time) /
    (outputs - 1)`` over requests with more than one output token (requests that never
    produced a token are left out)."""
    ttft = [r.first_token_time - r.arrival for r in reqs if r.first_token_time is not None]
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in reqs
            if r.first_token_time is not None and r.finish_time is not None and len(r.output) > 1]
    return TokenLatencies(len(ttft), _pct(ttft, 50), _pct(ttft, 99), _pct(tpot, 50),
                          _pct(tpot, 99))


class StepTiming:
    """The engine's step timing (a mixin: it reads the engine's executor, ``_record``,
    ``stats``, ``sched`` and ``cfg``)."""

    def _timings(self) -> dict[str, Any]:
        t = self.__dict__.get("_step_timing")
        if t is None:
            import torch

            dev = self.cfg.engine.device
            events = self._use_local and dev.startswith("cuda") and torch.cuda.is_available()
            t = self.__dict__["_step_timing"] = {"submit": 0.0, "sync": 0.0, "steps": 0,
                                                "events": [] if events else None, "kinds": {}}
        return t

    def _timed_submit(self, meta: Any) -> None:
        """``executor.submit(meta)``, timed while recording."""
        if not self._record:
            self.executor.submit(meta)
            return
        t = self._timings()
        ev = t["events"]
        t0 = time.perf_counter()
        if ev is not None:
            import torch

            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        self.executor.submit(meta)
        if ev is not None:
            b.record()
            ev.append((meta.bid, a, b))
        dt = time.perf_counter() - t0
        t["submit"] += dt
        t["steps"] += 1
        t["kinds"][meta.bid] = (step_kind(meta), dt)

    def _timed_poll(self, timeout: float) -> list[Any]:
        """``executor.poll(timeout)``, its wait counted as sync while recording."""
        if not self._record:
            return self.executor.poll(timeout=timeout)
        t0 = time.perf_counter()
        out = self.executor.poll(timeout=timeout)
        self._timings()["sync"] += time.perf_counter() - t0
        return out

    def step_device_s(self) -> dict[int, float]:
        """Each recorded step's device seconds by micro-batch id (CUDA events; else the
        stages' busy intervals from the batch log, summed over stages)."""
        ev = self._timings()["events"]
        if ev is not None:
            if ev:
                ev[-1][2].synchronize()
            return {bid: a.elapsed_time(b) / 1e3 for bid, a, b in ev}
        return {bid: sum(t1 - t0 for t0, t1 in e["stages"].values())
                for bid, e in self.stats.batch_log.items() if e["stages"]}

    def step_split(self) -> StepSplit:
        """The loop's :class:`StepSplit` so far."""
        t = self._timings()
        wall = max(0.0, self.stats.t_end - self.stats.t_start)
        if t["events"] is not None:
            gpu, timer, in_thread = sum(self.step_device_s().values()), "cuda_events", False
        else:
            busy = [sum(t1 - t0 for t0, t1 in iv) for iv in self.stats.busy]
            in_thread = self._use_local  # the stages compute inside submit, on this thread
            gpu, timer = (sum(busy) if in_thread else max(busy, default=0.0)), "stage_busy"
        host = max(0.0, wall - t["sync"] - (gpu if in_thread else 0.0))
        return StepSplit(t["steps"], wall, host, gpu, t["sync"], self.stats.decide_s, timer,
                         self._by_kind(t))

    def _by_kind(self, t: dict[str, Any]) -> dict[str, dict[str, float]]:
        """Steps, submit ms and device ms a step of each kind (device only with events)."""
        dev = self.step_device_s() if t["events"] is not None else {}
        out: dict[str, dict[str, float]] = {}
        for bid, (kind, dt) in t["kinds"].items():
            k = out.setdefault(kind, {"steps": 0, "submit_s": 0.0, "gpu_s": 0.0})
            k["steps"] += 1
            k["submit_s"] += dt
            k["gpu_s"] += dev.get(bid, 0.0)
        for k in out.values():
            n = k["steps"]
            k["submit_ms_per_step"] = 1e3 * k.pop("submit_s") / n
            k["gpu_ms_per_step"] = 1e3 * k.pop("gpu_s") / n if dev else None
        return out

    def timing_summary(self) -> dict[str, Any]:
        """``step_split``, ``token_latency`` and ``_step_device_s`` (by micro-batch id,
        for calibrating a cost table) of the finished requests."""
        return {"step_split": self.step_split().to_dict(),
                "token_latency": token_latencies(list(self.sched.finished)).to_dict(),
                "_step_device_s": self.step_device_s()}
