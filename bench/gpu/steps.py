"""CUDA-event timing of the GPU bench's plain loops (the prebuilt-batch sides of
bench/gpu/throughput.py and bench/gpu/edge.py, transformers' LM loop)."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def cuda_timed(step: Callable[[int], float], steps: int, warmup: int) -> dict[str, float]:
    """Run ``step(i)`` for ``i`` in ``0 .. steps-1``, each between two CUDA events with a
    synchronise after it; ``step`` returns the units (atoms, tokens) it processed. The
    medians over the steps after ``warmup``: units per second (``per_s``) and step time."""
    import torch

    times = []
    for i in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        units = step(i)
        b.record()
        b.synchronize()
        times.append((a.elapsed_time(b) / 1e3, units))
    t = times[warmup:]
    return {"per_s": statistics.median(u / s for s, u in t),
            "step_s": statistics.median(s for s, _ in t)}
