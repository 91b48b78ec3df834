"""FLOP counting and MFU (model FLOPs utilisation).

MFU = achieved model FLOP/s / peak FLOP/s of the device for the dtype in use.

* Achieved FLOPs are counted, not guessed: :func:`count_flops` runs one real training
  micro-step under ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions,
  attention — forward, backward and, for force training, the double backward), and the
  trainer scales that count by the step's atoms or tokens.
* Peak on CPU is *measured*: the best of several timed square GEMMs in the dtype, with
  the process's torch thread count (:func:`measured_cpu_peak`). Every run measures
  again and a cache keyed by CPU model x threads x dtype keeps the maximum ever seen (a
  peak measured under load is too low and would overstate MFU). On CUDA the peak comes
  from :data:`GPU_PEAK_FLOPS` (dense, no sparsity) matched on the device name.
* :class:`Peak` carries the value with its source; the trainer writes both into every
  metrics record (``peak_flops``, ``peak_source``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergent.cluster.resources import cpu_name
from convergent.core.fsutil import atomic_write_text, dumps_json

# Dense peak FLOP/s per GPU (vendor datasheets, no structured sparsity).
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "H100 PCIe": {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12},
    "H100": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "H200": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "A10G": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12},
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
    "V100": {"fp32": 15.7e12, "fp16": 125e12, "bf16": 15.7e12},
    "MI250X": {"fp32": 47.9e12, "bf16": 383e12, "fp16": 383e12},
    "MI300X": {"fp32": 163.4e12, "bf16": 1307e12, "fp16": 1307e12},
    "GH200": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
}


def gpu_peak_flops(device_name: str, dtype: str) -> float | None:
    """Table peak for a GPU name (longest matching key wins), or None if unknown."""
    best: tuple[int, float] | None = None
    for key, peaks in GPU_PEAK_FLOPS.items():
        if key.lower() in device_name.lower() and dtype in peaks:
            if best is None or len(key) > best[0]:
                best = (len(key), peaks[dtype])
    return best[1] if best else None


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def _cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "convergent"
    return root / "gemm_peak.json"


def measure_gemm_flops(dtype: str = "fp32", n: int = 512, repeats: int = 5) -> float:
    """Best achieved FLOP/s of an ``n x n @ n x n`` GEMM in ``dtype`` with current threads."""
    import torch

    td = _torch_dtype(dtype)
    a = torch.randn(n, n).to(td)
    b = torch.randn(n, n).to(td)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    inner = 4
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / inner)
    return 2.0 * n**3 / best


@dataclass(frozen=True)
class Peak:
    """A device peak (FLOP/s per process) and where it came from (``source``)."""

    flops: float | None
    source: str  # "override" | "table:<gpu key>:<dtype>" | "measured:<cache key>" | "unknown"

    def record(self) -> dict[str, Any]:
        """Metric fields naming the peak used for MFU."""
        return {"peak_flops": self.flops, "peak_source": self.source}


def cpu_peak_key(dtype: str, threads: int) -> str:
    """Cache key of a CPU GEMM peak: CPU model x torch threads x dtype."""
    return f"{cpu_name()}|threads={threads}|{dtype}"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def measured_cpu_peak(dtype: str = "fp32", use_cache: bool = True) -> Peak:
    """Measured CPU GEMM peak for ``dtype`` at this process's torch thread count.

    A peak is a maximum, and a measurement on a busy machine only ever comes out low, so
    every call measures again and the cache (``~/.cache/convergent/gemm_peak.json``,
    keyed by :func:`cpu_peak_key`) keeps the best value seen: it rises when a new
    measurement is higher and never falls. Entries: ``{"flops", "measurements",
    "last", "updated"}`` (FLOP/s, count, latest FLOP/s, unix time).
    """
    import torch

    key = cpu_peak_key(dtype, torch.get_num_threads())
    value = measure_gemm_flops(dtype)
    if not use_cache:
        return Peak(value, f"measured:{key}:uncached")
    path = _cache_file()
    cache = _read_cache(path)
    entry = cache.get(key) if isinstance(cache.get(key), dict) else {}
    best = max(value, float(entry.get("flops", 0.0)))
    cache[key] = {
        "flops": best,
        "measurements": int(entry.get("measurements", 0)) + 1,
        "last": value,
        "updated": time.time(),
    }
    try:
        atomic_write_text(path, dumps_json(cache, indent=1))
    except OSError:
        pass  # a read-only home still gets this run's measurement
    return Peak(best, f"measured:{key}")


def gpu_peak(device_name: str, dtype: str, tf32: bool = False) -> Peak:
    """Table peak for a CUDA device name; fp32 counts at the TF32 peak when ``tf32``."""
    want = "tf32" if dtype == "fp32" and tf32 else dtype
    value = gpu_peak_flops(device_name, want)
    if value is None and want == "tf32":
        want = "fp32"
        value = gpu_peak_flops(device_name, want)
    return Peak(value, f"table:{device_name}:{want}" if value else "unknown")


def device_peak(device: Any, dtype: str, override: float | None = None) -> Peak:
    """Peak FLOP/s of one process's device for ``dtype``: override, GPU table or CPU GEMM."""
    if override:
        return Peak(float(override), "override")
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        tf32 = torch.get_float32_matmul_precision() != "highest"
        return gpu_peak(torch.cuda.get_device_name(device), dtype, tf32)
    return measured_cpu_peak(dtype)


def count_flops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under FlopCounterMode; return (its result, total FLOPs counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = fn()
    return out, int(counter.get_total_flops())


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None when the peak or time is unknown)."""
    if not peak or seconds <= 0:
        return None
    return float(flops) / seconds / peak
